"""The one place where pagedserve reads environment variables (besides `cli/`).

Everything below the CLI receives values as arguments; this module only supplies defaults.
"""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """Where fetched models are kept: $PAGEDSERVE_CACHE, else $XDG_CACHE_HOME/pagedserve, else ~/.cache/pagedserve."""
    explicit = os.environ.get("PAGEDSERVE_CACHE")
    if explicit:
        path = Path(explicit).expanduser()
        if path.exists() and not path.is_dir():  # "[Errno 20] Not a directory" named neither the variable nor why
            raise ValueError(f"PAGEDSERVE_CACHE={explicit} is a file, not a folder: point it at a folder (it is "
                             "created if missing)")
        return path
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "pagedserve"


def cpu_kernels_enabled() -> bool:
    """$PAGEDSERVE_CPU_KERNELS=0 turns the native CPU kernels off (torch ops everywhere); default on."""
    return _switch("PAGEDSERVE_CPU_KERNELS", default=True)


def cpu_amx_enabled() -> bool:
    """$PAGEDSERVE_CPU_AMX=0 keeps linears off AMX tiles on CPUs that have them: bf16 ones, int8 prefill panels
    and int8 decode batches (the AVX-512 vector kernels run instead); default on."""
    return _switch("PAGEDSERVE_CPU_AMX", default=True)


def cpu_bf16_attention(default: bool) -> bool:
    """$PAGEDSERVE_CPU_BF16_ATTENTION=1/0: bf16 attention by vdpbf16ps, or by float32 FMAs, on CPUs with AVX512-BF16
    (elsewhere FMAs only). Unset: `default`, the rule probe.bf16_attention_by_dot gives for this CPU."""
    return _switch("PAGEDSERVE_CPU_BF16_ATTENTION", default=default)


def cpu_sdpa_prefill(default: bool) -> bool:
    """$PAGEDSERVE_CPU_SDPA_PREFILL=1/0: prefill chunks' attention on torch's SDPA, or on the native kernel (each row
    as a decode row). Unset: `default`, the rule probe.sdpa_prefill gives for this CPU and dtype."""
    return _switch("PAGEDSERVE_CPU_SDPA_PREFILL", default=default)


CPU_ISAS = ("native", "avx2", "avx2-vnni", "avx512-vnni")


def cpu_isa() -> str:
    """$PAGEDSERVE_CPU_ISA: which build of the native CPU kernels to run. "native" (default): the best
    this CPU has; "avx2": the AVX2 + FMA + F16C kernels, also on an AVX-512 CPU (to test or compare them
    on any x86 machine); "avx2-vnni": those with AVX-VNNI's int8 sums (the paths of an Alder Lake or later
    Intel core), on any CPU with AVX-VNNI; "avx512-vnni": the AVX-512 kernels built without BF16 and AMX (the
    paths of a Cascade Lake or Ice Lake), on any AVX-512 VNNI CPU. Raises ValueError for anything else; a build
    this CPU cannot run is refused when the kernels load (builder.BUILD_FLAGS)."""
    value = os.environ.get("PAGEDSERVE_CPU_ISA", "").strip().lower() or "native"
    if value not in CPU_ISAS:
        raise ValueError(f"PAGEDSERVE_CPU_ISA={value!r} is not one of {', '.join(CPU_ISAS)}; unset it for the best "
                         "instruction set this CPU has")
    return value


def batch_invariant() -> bool:
    """$PAGEDSERVE_BATCH_INVARIANT=1 (or vLLM's VLLM_BATCH_INVARIANT=1): a request's tokens do not depend on which
    other requests share its steps. Int8 linears then take kernels with exact integer sums at every batch size
    instead of the bf16 panels at prefill sizes (on AVX512-BF16 and AMX CPUs; elsewhere they already do): a
    prompt's prefill 0.72-0.97x as fast there (0.67-0.83x on AMX, whose AMX-INT8 tiles take the exact sums).
    Default off."""
    return _switch("PAGEDSERVE_BATCH_INVARIANT", default=_switch("VLLM_BATCH_INVARIANT", default=False))


def huge_pages_enabled() -> bool:
    """$PAGEDSERVE_HUGE_PAGES=1 puts packed CPU weights on transparent huge pages: a few per cent faster
    batch-1 decoding, but ~1 s longer start-up for a 1 GB model where the kernel must compact memory to
    find 2 MiB pages (benchmarks/PROFILE.md); default off."""
    return _switch("PAGEDSERVE_HUGE_PAGES", default=False)


def api_key() -> str | None:
    """API key for the server ($PAGEDSERVE_API_KEY, else vLLM's $VLLM_API_KEY), or None."""
    return os.environ.get("PAGEDSERVE_API_KEY") or os.environ.get("VLLM_API_KEY") or None


def client_api_key() -> str | None:
    """The key a client command (bench) sends: api_key(), else $OPENAI_API_KEY, which vLLM's bench sends (a server
    never takes its own key from it)."""
    return api_key() or os.environ.get("OPENAI_API_KEY") or None


def vllm_cpu_kvcache_space_gib() -> float | None:
    """$VLLM_CPU_KVCACHE_SPACE (GiB of KV cache on CPU), honoured for drop-in compatibility with vLLM."""
    raw = os.environ.get("VLLM_CPU_KVCACHE_SPACE")
    if not raw:
        return None
    try:
        value = float(raw)
    except ValueError as exc:
        raise ValueError(f"VLLM_CPU_KVCACHE_SPACE must be a number of GiB, got {raw!r}") from exc
    if not value >= 0:  # nan too
        raise ValueError(f"VLLM_CPU_KVCACHE_SPACE must be a number of GiB >= 0 (0: the default size), got {raw!r}")
    return value if value > 0 else None


def vllm_cpu_omp_threads_bind() -> str | None:
    """$VLLM_CPU_OMP_THREADS_BIND: the cores of each tensor-parallel rank, '|'-separated (--cpu-binding's default),
    or vLLM's "nobind" (ranks not bound); None where unset or "auto"/"all" (pagedserve's own default binding)."""
    raw = os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "").strip()
    if raw.lower() == "nobind":
        return "nobind"
    return None if raw.lower() in ("", "auto", "all") else raw


def allow_long_max_model_len() -> bool:
    """$PAGEDSERVE_ALLOW_LONG_MAX_MODEL_LEN=1 (or vLLM's $VLLM_ALLOW_LONG_MAX_MODEL_LEN=1) lets --max-model-len go
    past the context the model was trained for (with a warning): refused otherwise, as vLLM does."""
    return _switch("PAGEDSERVE_ALLOW_LONG_MAX_MODEL_LEN", default=False) or _switch("VLLM_ALLOW_LONG_MAX_MODEL_LEN",
                                                                                   default=False)


def log_stats_interval_s() -> float:
    """Seconds between the server's stats lines: $PAGEDSERVE_LOG_STATS_INTERVAL, else vLLM's
    $VLLM_LOG_STATS_INTERVAL, else 10 (vLLM's default)."""
    for name in ("PAGEDSERVE_LOG_STATS_INTERVAL", "VLLM_LOG_STATS_INTERVAL"):
        raw = os.environ.get(name)
        if raw:
            try:
                value = float(raw)
            except ValueError as exc:
                raise ValueError(f"{name} must be a number of seconds, got {raw!r}") from exc
            if not value < 1e9:  # inf (and nan) killed the stats thread: time.sleep overflows
                raise ValueError(f"{name} must be a finite number of seconds, got {raw!r}")
            if value > 0:  # 0 and less: the default, as vLLM reads it
                return value
    return 10.0


def _switch(name: str, default: bool) -> bool:
    """An on/off variable: 0/false/no/off turn it off, 1/true/yes/on on; unset (or anything else) keeps `default`."""
    value = os.environ.get(name, "").strip().lower()
    if value in ("0", "false", "no", "off"):
        return False
    if value in ("1", "true", "yes", "on"):
        return True
    return default
