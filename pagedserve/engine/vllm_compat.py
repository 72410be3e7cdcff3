"""vLLM settings that pagedserve takes without a setting of its own, so that a `vllm serve ...` command line (or
`LLM(..., trust_remote_code=True)`) runs unchanged, and says what it did with each.

One table, read by `pagedserve serve` (the flags, in their own --help section) and by `LLM(...)` (the same names
as keyword arguments). Three kinds:
- ignored: the setting exists for something pagedserve does not have or always does its own way (CUDA graphs,
  swap space, a checkpoint's remote code); it is taken, and start-up logs why it has no effect;
- only: accepted at the values that describe what pagedserve does (`--pipeline-parallel-size 1`); another value is
  refused before anything loads, naming what to do instead;
- unsupported: a feature pagedserve does not have (LoRA, hub revisions); refused, with the way
  to get what was meant where there is one.
A vLLM flag pagedserve implements is an ordinary setting (EngineArgs, ServeOptions), never listed here.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

IGNORED, ONLY, UNSUPPORTED = "ignored", "only", "unsupported"

_NO_HUB = ("pagedserve serves a local checkpoint (or a packaged model name) and does not download from the "
           "Hugging Face hub: download it first (`huggingface-cli download MODEL --revision R --local-dir DIR`) "
           "and serve DIR")

_NO_LORA = ("LoRA adapters are not supported: merge the adapter into the weights (peft's merge_and_unload) and serve "
            "the merged checkpoint")


@dataclass(frozen=True)
class CompatSetting:
    flags: tuple[str, ...]  # the first is the long flag; its name with '_' is the LLM(...) keyword
    kind: str
    reason: str  # why it has no effect (ignored), what pagedserve does (only), or what to do instead (unsupported)
    takes_value: bool = True  # False: a switch (--x / --no-x)
    allowed: tuple[str, ...] = ()  # kind "only": the values that match pagedserve (compared case-insensitively)
    choices: tuple[str, ...] = ()  # kind "ignored": vLLM's values (another one is refused, as vLLM refuses it)
    number: bool = False  # kind "ignored": vLLM takes a number (anything else is refused, as vLLM refuses it)
    many: bool = False  # it takes several values (a list)

    @property
    def name(self) -> str:
        return self.flags[0].removeprefix("--").replace("-", "_")


COMPAT_SETTINGS: tuple[CompatSetting, ...] = (
    # ignored
    CompatSetting(("--trust-remote-code",), IGNORED, "pagedserve runs its own model code for the architectures it "
                  "supports and never imports a checkpoint's Python files", takes_value=False),
    CompatSetting(("--disable-log-requests",), IGNORED, "requests are logged only with --enable-log-requests",
                  takes_value=False),
    CompatSetting(("--disable-frontend-multiprocessing",), IGNORED, "the HTTP server and the engine share one "
                  "process", takes_value=False),
    CompatSetting(("--swap-space",), IGNORED, "a preempted request's KV cache is recomputed when it resumes, not "
                  "swapped to host memory", number=True),
    CompatSetting(("--cpu-offload-gb",), IGNORED, "weights stay on the device that runs them; the memory plan "
                  "refuses a model that does not fit", number=True),
    CompatSetting(("--download-dir",), IGNORED, "a local model is read where it is, and packaged models are "
                  "fetched into $PAGEDSERVE_CACHE (set it to choose where); nothing is downloaded from a hub"),
    CompatSetting(("--max-seq-len-to-capture",), IGNORED, "no CUDA graphs are captured: every forward runs eagerly"),
    CompatSetting(("--compilation-config", "-O"), IGNORED, "models are not graph-compiled (the native CPU kernels are "
                  "a library built once)"),
    CompatSetting(("--disable-custom-all-reduce",), IGNORED, "there is no custom CUDA all-reduce", takes_value=False),
    CompatSetting(("--num-scheduler-steps",), IGNORED, "the scheduler runs once per forward", number=True),
    CompatSetting(("--async-scheduling",), IGNORED, "the scheduler runs between forwards", takes_value=False),
    CompatSetting(("--max-parallel-loading-workers",), IGNORED, "weights load in this process, as one stream",
                  number=True),
    CompatSetting(("--calculate-kv-scales",), IGNORED, "fp8 KV caches keep a scale per token and head, computed as "
                  "they are written", takes_value=False),
    CompatSetting(("--ignore-patterns",), IGNORED, "only the model's *.safetensors (or the .gguf file) are read",
                  many=True),
    CompatSetting(("--cudagraph-capture-sizes",), IGNORED, "no CUDA graphs are captured: every forward runs eagerly",
                  many=True),
    CompatSetting(("--show-hidden-metrics-for-version",), IGNORED, "every metric pagedserve has is shown"),
    CompatSetting(("--h11-max-incomplete-event-size",), IGNORED, "uvicorn's own limits apply (request bodies: "
                  "--max-request-body-bytes)", number=True),
    CompatSetting(("--h11-max-header-count",), IGNORED, "uvicorn's own limits apply", number=True),
    CompatSetting(("--max-num-partial-prefills",), IGNORED, "prompts prefill side by side within "
                  "--max-num-batched-tokens; --long-prefill-token-threshold N keeps a long one from taking a whole "
                  "step", number=True),
    CompatSetting(("--max-long-partial-prefills",), IGNORED, "prompts prefill side by side within "
                  "--max-num-batched-tokens; --long-prefill-token-threshold N keeps a long one from taking a whole "
                  "step", number=True),
    CompatSetting(("--prefix-caching-hash-algo",), IGNORED, "prefix-cache blocks are keyed by their token ids and "
                  "a 128-bit BLAKE2b digest of their prefix's key, always",
                  choices=("sha256", "sha256_cbor", "builtin", "xxhash", "xxhash_cbor")),
    # only
    CompatSetting(("--pipeline-parallel-size", "-pp"), ONLY, "pipeline parallelism is not supported: split a model "
                  "with --tensor-parallel-size N", allowed=("1",)),
    CompatSetting(("--data-parallel-size", "-dp"), ONLY, "data-parallel engines are replicas here: "
                  "--replicas N (Ray Serve)", allowed=("1",)),
    CompatSetting(("--api-server-count", "-asc"), ONLY, "one HTTP server process serves every request", allowed=("1",)),
    CompatSetting(("--distributed-executor-backend",), ONLY, "tensor-parallel ranks are processes of this host",
                  allowed=("mp", "uni")),
    CompatSetting(("--tokenizer-mode",), ONLY, "the checkpoint's own tokenizer is used (tokenizer.json or the "
                  "GGUF's vocabulary)", allowed=("auto", "hf")),
    CompatSetting(("--load-format",), ONLY, "the format is told from the files (safetensors or GGUF)",
                  allowed=("auto", "safetensors", "gguf")),
    CompatSetting(("--config-format",), ONLY, "the model's config is read from config.json (or the GGUF's "
                  "metadata)", allowed=("auto", "hf")),
    CompatSetting(("--model-impl",), ONLY, "models run on pagedserve's own implementation", allowed=("auto", "vllm")),
    CompatSetting(("--logprobs-mode",), ONLY, "logprobs are the raw model's, as vLLM's default",
                  allowed=("raw_logprobs",)),
    CompatSetting(("--decode-context-parallel-size", "-dcp"), ONLY, "decode context parallelism is not supported",
                  allowed=("1",)),
    CompatSetting(("--guided-decoding-backend",), ONLY, "structured outputs run on xgrammar "
                  "(--structured-outputs-config for its settings)", allowed=("auto", "xgrammar")),
    # unsupported
    CompatSetting(("--enable-lora",), UNSUPPORTED, _NO_LORA, takes_value=False),
    CompatSetting(("--lora-modules",), UNSUPPORTED, _NO_LORA),
    CompatSetting(("--logits-processors",), UNSUPPORTED, "custom logits processors are not supported (logit_bias, "
                  "penalties and structured outputs are)"),
    CompatSetting(("--tool-server",), UNSUPPORTED, "built-in tool servers are not supported: give tools in the "
                  "request (--enable-auto-tool-choice --tool-call-parser NAME)"),
    CompatSetting(("--kv-transfer-config",), UNSUPPORTED, "disaggregated prefill (KV transfer) is not supported"),
    CompatSetting(("--enable-sleep-mode",), UNSUPPORTED, "sleep mode is not supported: stop the server to free its "
                  "memory", takes_value=False),
    CompatSetting(("--limit-mm-per-prompt",), UNSUPPORTED, "multimodal inputs are not supported (text models only)"),
    CompatSetting(("--max-loras",), UNSUPPORTED, _NO_LORA),
    CompatSetting(("--max-lora-rank",), UNSUPPORTED, _NO_LORA),
    CompatSetting(("--max-cpu-loras",), UNSUPPORTED, _NO_LORA),
    CompatSetting(("--enable-expert-parallel",), UNSUPPORTED, "expert parallelism is not supported: pagedserve "
                  "serves dense models", takes_value=False),
    CompatSetting(("--mm-processor-kwargs",), UNSUPPORTED, "multimodal inputs are not supported (text models only)"),
    CompatSetting(("--allowed-local-media-path",), UNSUPPORTED, "multimodal inputs are not supported (text models "
                  "only)"),
    CompatSetting(("--enable-prompt-embeds",), UNSUPPORTED, "prompts are text or token ids; embeddings as prompts are "
                  "not supported", takes_value=False),
    CompatSetting(("--skip-tokenizer-init",), UNSUPPORTED, "the server tokenizes and detokenizes: send token ids as "
                  "the prompt instead", takes_value=False),
    CompatSetting(("--hf-overrides",), UNSUPPORTED, "edit the checkpoint's config.json (a copy of the model "
                  "directory) instead"),
    CompatSetting(("--rope-scaling",), UNSUPPORTED, "set rope_scaling in the checkpoint's config.json (a copy of the "
                  "model directory) instead"),
    CompatSetting(("--rope-theta",), UNSUPPORTED, "set rope_theta in the checkpoint's config.json (a copy of the "
                  "model directory) instead"),
    CompatSetting(("--middleware",), UNSUPPORTED, "the server imports no user code: put a reverse proxy in front "
                  "for extra middleware"),
    CompatSetting(("--tool-parser-plugin",), UNSUPPORTED, "the server imports no user code: --tool-call-parser takes "
                  "hermes, llama3_json, mistral, granite, phi4_mini_json or pythonic"),
    CompatSetting(("--otlp-traces-endpoint",), UNSUPPORTED, "OpenTelemetry tracing is not supported: /metrics has "
                  "vLLM's Prometheus metrics"),
    CompatSetting(("--collect-detailed-traces",), UNSUPPORTED, "OpenTelemetry tracing is not supported: /metrics "
                  "has vLLM's Prometheus metrics"),
    CompatSetting(("--kv-events-config",), UNSUPPORTED, "KV cache events are not published"),
    CompatSetting(("--headless",), UNSUPPORTED, "the engine and its HTTP server run together", takes_value=False),
    CompatSetting(("--enable-ssl-refresh",), UNSUPPORTED, "restart the server to load new certificates",
                  takes_value=False),
    CompatSetting(("--hf-token",), UNSUPPORTED, _NO_HUB),
    CompatSetting(("--pooler-config",), UNSUPPORTED, "pooling is read from the model's sentence-transformers files "
                  "(modules.json); --task embed for a decoder"),
    CompatSetting(("--override-pooler-config",), UNSUPPORTED, "pooling is read from the model's sentence-transformers "
                  "files (modules.json); --task embed for a decoder"),
    CompatSetting(("--enable-tokenizer-info-endpoint",), UNSUPPORTED, "there is no /tokenizer_info: /tokenize and "
                  "/detokenize are served", takes_value=False),
    CompatSetting(("--enable-server-load-tracking",), UNSUPPORTED, "there is no /load endpoint: /metrics has "
                  "vllm:num_requests_running and vllm:num_requests_waiting", takes_value=False),
    CompatSetting(("--log-config-file",), UNSUPPORTED, "logs go to stderr (levels: -v, --uvicorn-log-level)"),
    CompatSetting(("--revision",), UNSUPPORTED, _NO_HUB),
    CompatSetting(("--tokenizer-revision",), UNSUPPORTED, _NO_HUB),
    CompatSetting(("--code-revision",), UNSUPPORTED, _NO_HUB),
)

_BY_NAME = {setting.name: setting for setting in COMPAT_SETTINGS}


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    """The table's flags, in a --help section of their own (one line each)."""
    group = parser.add_argument_group(
        "vLLM flags taken for compatibility (a `vllm serve` command line runs unchanged)")
    labels = {IGNORED: "no effect", UNSUPPORTED: "refused"}
    for setting in COMPAT_SETTINGS:
        label = labels.get(setting.kind) or f"only {' or '.join(setting.allowed)}"
        help_text = f"{label}: {setting.reason}".replace("%", "%%")
        if setting.takes_value:
            group.add_argument(*setting.flags, dest=setting.name, default=None, metavar="VALUE", help=help_text,
                               **({"nargs": "+"} if setting.many else {}))
        else:  # --x and vLLM's --no-x
            group.add_argument(*setting.flags, dest=setting.name, default=None,
                               action=argparse.BooleanOptionalAction, help=help_text)


def _is_number(value: Any) -> bool:
    try:
        float(value)
    except (TypeError, ValueError):
        return False
    return True


def given(values: Mapping[str, Any]) -> dict[str, Any]:
    """The table's settings among `values` (parsed flags or keyword arguments) that were given."""
    return {name: value for name, value in values.items() if name in _BY_NAME and value is not None}


def check(values: Mapping[str, Any], keyword: bool = False) -> list[str]:
    """ValueError for the first refused setting among `values`; else one line per ignored one, for the log.
    `keyword`: name them as LLM(...) keyword arguments instead of flags."""
    notes = []
    for name, value in given(values).items():
        setting = _BY_NAME[name]
        shown = f"{name}={value!r}" if keyword else setting.flags[0] + ("" if value is True or value is False
                                                                        else f" {value}")
        if setting.kind == UNSUPPORTED and not _asks_nothing(value):
            raise ValueError(f"{shown}: {setting.reason}")
        if setting.kind == ONLY and str(value).strip().lower() not in setting.allowed:
            raise ValueError(f"{shown}: {setting.reason} (accepted: {', '.join(setting.allowed)})")
        if setting.kind == IGNORED and value is not False:  # --no-x asks for what pagedserve does anyway
            if setting.choices and str(value) not in setting.choices:
                raise ValueError(f"{shown}: not one of {', '.join(setting.choices)} (vLLM's values; it has no "
                                 f"effect here: {setting.reason})")
            if setting.number and not _is_number(value):
                raise ValueError(f"{shown}: not a number (vLLM takes one; it has no effect here: {setting.reason})")
            notes.append(f"{shown} has no effect: {setting.reason}")
    _check_combinations(values)
    return notes


def _asks_nothing(value: Any) -> bool:
    """A refused setting's value that asks for nothing: --no-x, or an empty dict (LLM(hf_overrides={}), vLLM's
    default) or list."""
    return value is False or value in ({}, [], "{}")


def _check_combinations(values: Mapping[str, Any]) -> None:
    """The table's accepted values that contradict the rest of the command line (each was taken silently)."""
    backend = str(values.get("distributed_executor_backend") or "").strip().lower()
    ranks = values.get("tensor_parallel_size") or 1
    if backend == "uni" and isinstance(ranks, int) and ranks > 1:
        raise ValueError(f"--distributed-executor-backend uni runs the model in one process, and "
                         f"--tensor-parallel-size {ranks} runs one per rank: leave the backend out (or give mp)")
    load_format = str(values.get("load_format") or "auto").strip().lower()
    kind = _model_format(values.get("model"))
    if load_format in ("safetensors", "gguf") and kind is not None and kind != load_format:
        raise ValueError(f"--load-format {load_format}: the model {values.get('model')} is {kind}; leave the flag "
                         "out (the format is told from the files)")


def _model_format(model: Any) -> str | None:
    """"gguf" or "safetensors" for a model path or packaged name; None where it cannot be told without loading."""
    if not isinstance(model, str):
        return None
    from pathlib import Path

    from pagedserve.formats import is_gguf_path

    if Path(model).exists():
        if is_gguf_path(model):
            return "gguf"
        # a directory of safetensors (one holding a .gguf is refused as a model, naming the file, later)
        return "safetensors" if Path(model).is_dir() and any(Path(model).glob("*.safetensors")) else None
    from pagedserve.models.fetch import KNOWN_MODELS

    known = KNOWN_MODELS.get(model)
    return None if known is None else "safetensors" if known.is_directory else "gguf"


def keyword_names() -> list[str]:
    """The table's settings as LLM(...) keyword arguments."""
    return list(_BY_NAME)


def split_keywords(kwargs: dict[str, Any], model: str | None = None) -> tuple[dict[str, Any], list[str]]:
    """LLM(...)'s keyword arguments without the table's (checked, against `model` too: ValueError for a refused
    one), and the notes."""
    notes = check({**kwargs, "model": model}, keyword=True)
    return {k: v for k, v in kwargs.items() if k not in _BY_NAME}, notes
