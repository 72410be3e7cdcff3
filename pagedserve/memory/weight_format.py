"""Which format a model's linear weights take and which kernel each kind of layer runs: the rule written once
and without torch.

`layers/backend.py`'s `KernelBackend.choose` applies it to what this process has (the native kernels it
loaded, oneDNN's probe matmul); the memory plan (engine/memory_plan.py, `pagedserve plan`) applies it to what
the CPU's flags promise, before anything is built or loaded, so the two cannot follow different rules. The
layers take the size rules (`native_linear`, `decoder_kernels_fit`, `fused_rotary`) from here through the
backend; `LayerKernels` says what a model's layers run, in the same words for the start-up log (from the
loaded modules, models/llama.py) and `pagedserve doctor` (from the config, `expected_layer_kernels`).

Linear kinds (WeightFormat.logits_head turns them into memory/sizes' layouts): "packed" (bf16 on pagedserve's native
kernel where it runs, else oneDNN's blocked layout), "int8" (weight-only int8: the native kernel where it
runs, else torch's `_weight_int8pack_mm`), "plain" (`F.linear`: the reference path, GPUs).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

from pagedserve.memory.probe import is_x86, native_kernel_isa
from pagedserve.memory.sizes import moe_shape

SUPPORTED_QUANTIZATION = (None, "int8")
# vLLM's --quantization gguf, and what platform.default_quantization picks for a block-quantized GGUF: the file's
# NATIVE_GGUF_BLOCKS matrices run on the native block kernel as stored, its other block types requantized per row to
# int8 ("int8" linears either way; the memory plan takes off what the blocks save: CheckpointInfo.gguf_block_savings).
FILE_QUANTIZATION = "gguf"


# The CPU classes (probe.cpu_class) where `--dtype auto` serves a 4/5-bit GGUF from its own blocks: measured there.
BLOCK_CLASSES = ("avx512", "avx512-bf16")


def default_file_quantization(kernels_class: str, verifies_drafts: bool = False) -> str:
    """What `--dtype auto` serves a block-quantized GGUF with where native kernels of this CPU class run
    (probe.cpu_class of the build that runs: platform.native_kernels_class). Its own blocks on BLOCK_CLASSES
    (benchmarks/gguf_blocks.py on 2 cores, RESULTS.md "GGUF blocks as stored"), where decode reads fewer bytes:
    - "avx512" (AVX-512 VNNI without BF16: Ice Lake, Cascade Lake): batch-1 decode 1.55-1.8x int8's per linear, 5 rows
      0.9-1.05x, 8-256 rows 0.76-0.99x (whole models: decode 1.2x, prompts 0.95x), where the int8 kernel's prefill is
      an integer tile too;
    - "avx512-bf16" (a Zen 4; the Zen 5 shares the class, unmeasured): one row 1.27-1.64x, 2 rows 1.07-1.45x, 5-16
      rows 0.73-1.02x, 64-256 rows 0.77-0.87x against int8's prefill on vdpbf16ps panels; whole models decode
      1.11-1.28x, a 512-token prompt 0.86-0.89x: for a 512-token prompt and 128 tokens the blocks take 4-9 % less time,
      and 10 % less memory.
    int8 elsewhere:
    - "avx512-amx": the int8 kernel's prefill runs exact bf16 panels on AMX tiles (~8x the vector units), which the
      block kernel's integer tile does not have: unmeasured there, and likely several times slower for a prompt;
    - "avx2": on a Zen 3 unpacking the blocks, not memory, bounds the kernel: one linear at batch 1 0.9-1.56x int8's
      speed, 2 rows 0.78-1.15x, 5-16 rows 0.56-1.0x, 64-256 rows 0.72-0.93x; whole models decode 1.02-1.13x, a
      512-token prompt 0.78-0.87x (after the AVX2 kernel's rework of 12-07, which took decode from 0.87-0.91x):
      faster decode by a tenth does not pay for prompts a fifth slower;
    - a model that verifies speculative drafts (`verifies_drafts`), on every class: its steps run 1 + k rows, where a
      verification of 5 drafts cost 2.7 one-row steps on the blocks against 1.75-1.9 on int8 (the Ice Lake,
      benchmarks/speculative.py; RESULTS_speculative.md), so n-gram speculation ran Qwen2.5-Coder's edit 1.74x over
      plain blocks against 2.66x over plain int8, 51 against 71 tok/s. A draft model keeps the rule above (one row a
      step)."""
    return FILE_QUANTIZATION if kernels_class in BLOCK_CLASSES and not verifies_drafts else "int8"


def file_quantization_reason(kernels_class: str, verifies_drafts: bool = False, ranks: int = 1) -> str:
    """Why `--dtype auto` serves a block-quantized GGUF as default_file_quantization does here (doctor's words)."""
    if ranks > 1:  # platform.default_quantization
        return (f"--dtype auto requantizes the file to int8 for {ranks} tensor-parallel ranks (they split each "
                "matrix; the file's blocks are not split)")
    blocks = default_file_quantization(kernels_class) == FILE_QUANTIZATION  # the class's choice without drafts
    if blocks and verifies_drafts:
        return ("--dtype auto requantizes the file to int8 for speculative decoding (a verification's 1 + k rows run "
                "faster on int8 than on the file's blocks: --quantization gguf keeps them)")
    if blocks:
        return (f"--dtype auto on CPU class {kernels_class} keeps the file's 4/5-bit blocks (decode reads fewer bytes; "
                "batches of 5 rows and more run at 0.75-1.0x int8's: --quantization int8 requantizes)")
    return (f"--dtype auto on CPU class {kernels_class} requantizes the file to int8 (the block kernel's batches or "
            "prompts are slower than int8's here, or not measured: --quantization gguf keeps the blocks)")
# What the native kernels need of a model's sizes (their vector loops and weight blocks).
INT8_K_MULTIPLE = 64  # an int8 linear's in_features
BF16_K_MULTIPLE = 16  # a bf16 linear's in_features
VECTOR_MULTIPLE = 16  # hidden, intermediate and head_dim, for the norms, SiLU x up and decode attention
MAX_HEAD_DIM = 256
ROTARY_MULTIPLE = 32  # head_dim, for rotary fused into the KV write
# The activation dtypes pagedserve's native kernels take (pagedserve.kernels.ACTIVATION_DTYPES is this, in torch).
NATIVE_DTYPES = ("bfloat16", "float32")
# The MLP gates the native kernels have (act(gate) x up; cpu_kernels.c's PS_ACT_* in this order): SiLU, and GELU's tanh
# approximation (Gemma's gelu_pytorch_tanh). Others (the exact GELU) run torch ops and keep the decode stack off.
NATIVE_ACTIVATIONS = ("silu", "gelu_pytorch_tanh")
# The dtypes oneDNN's packed linear is tried for (layers/linear.py's packing_supported).
ONEDNN_PACKED_DTYPES = ("bfloat16", "float32")
# On x86, oneDNN reorders a bf16 weight only with one of these flag sets (its error message names them): not on
# AVX2-only CPUs, where it raises instead.
ONEDNN_BF16_FLAGS = ({"avx512bw", "avx512vl", "avx512dq"}, {"avx_ne_convert"})


# The ggml block types the native block kernel runs as stored (cpu_kernels.c's ps_linear_q), by name, and their bits.
NATIVE_GGUF_BLOCKS = {"Q4_0": 4, "Q4_1": 4, "Q5_0": 5, "Q5_1": 5, "Q4_K": 4, "Q5_K": 5}
# A decoder layer's linears and the logits head (the start-up log's names) and the checkpoint matrices each is made of:
# fused ones (q/k/v, gate/up) from several, or from one where the checkpoint stores them fused (Phi-3's qkv_proj).
LINEAR_PARTS = {"qkv": (("q_proj", "k_proj", "v_proj"), ("qkv_proj",)), "o": (("o_proj",),),
                "gate_up": (("gate_proj", "up_proj"), ("gate_up_proj",)), "down": (("down_proj",),),
                "logits": (("lm_head",),)}


def gguf_block_linears(types: dict[str, str]) -> set[str]:
    """Which linears keep their GGUF blocks under --quantization gguf (the rest run int8): `types` maps the
    checkpoint matrices of one decoder layer ("q_proj", ...; "lm_head" for an untied logits head) to their ggml
    type names; a linear keeps them where each of its parts is a NATIVE_GGUF_BLOCKS type of one kind: one width, and
    K-quant scales for all or none (a fused q/k/v of Q4_0 and Q5_0 parts, or Q4_0 and Q4_K, becomes int8, as
    layers/linear.fuse_rows stacks them)."""
    kept = set()
    for linear, alternatives in LINEAR_PARTS.items():
        for parts in alternatives:
            if all(part in types for part in parts):
                kinds = {(NATIVE_GGUF_BLOCKS.get(types[part]), types[part].endswith("_K")) for part in parts}
                if len(kinds) == 1 and None not in next(iter(kinds)):
                    kept.add(linear)
                break
    return kept


def check_quantization(quantization: str | None) -> None:
    if quantization not in SUPPORTED_QUANTIZATION and quantization != FILE_QUANTIZATION:
        raise ValueError(f"quantization {quantization!r} is not supported; supported: int8, gguf (a GGUF file)")


def wants_native_kernels(device: str, dtype: str, reference: bool) -> bool:
    """Whether a model in `dtype` on `device` runs the native kernels where they load (not on the
    reference path, which is torch ops only)."""
    return not reference and device == "cpu" and dtype in NATIVE_DTYPES


def onednn_may_pack(device: str, dtype: str, flags: set[str], machine: str | None = None) -> bool:
    """Whether oneDNN's packed linear is tried at all (where it is, packing_supported probes it): float32 on a
    CPU, and bf16 where an x86 CPU's flags (probe.cpu_flags) let oneDNN convert bf16 (other CPUs: the probe
    decides)."""
    if device != "cpu" or dtype not in ONEDNN_PACKED_DTYPES:
        return False
    if dtype == "float32" or not is_x86(machine):
        return True
    return any(needed <= flags for needed in ONEDNN_BF16_FLAGS)


def linear_kind(dtype: str, quantization: str | None, reference: bool, native: bool,
                onednn_packs: Callable[[], bool]) -> str:
    """"int8" when quantized (int8, or a GGUF's own blocks); else "plain" on the reference path; else "packed" for bf16
    on the native kernels (`native`: they run for this model) or where oneDNN packs (`onednn_packs`, asked only
    then)."""
    if quantization in ("int8", FILE_QUANTIZATION):
        return "int8"
    if reference:
        return "plain"
    if (native and dtype == "bfloat16") or onednn_packs():
        return "packed"
    return "plain"


def native_bf16_linears(kind: str, native: bool, dtype: str) -> bool:
    """bf16 linears run pagedserve's kernel (its packed layout; a tied embedding reads rows from it)."""
    return kind == "packed" and native and dtype == "bfloat16"


def native_kernels_expected(flags: set[str], enabled: bool = True, machine: str | None = None) -> bool:
    """Whether pagedserve.kernels.cpu_kernels() gives kernels on this host, told from the CPU's flags alone:
    enabled (PAGEDSERVE_CPU_KERNELS, envs.cpu_kernels_enabled()), an x86-64 machine and an ISA they are
    written for (probe.native_kernel_isa). It assumes the library then builds and loads: nothing is
    compiled or loaded here, so a host without a C compiler (or a failed build) is predicted wrongly."""
    return enabled and is_x86(machine) and native_kernel_isa(flags) is not None


@dataclass(frozen=True)
class WeightFormat:
    linear_kind: str  # "packed", "int8" or "plain"
    native_bf16_linears: bool

    @property
    def int8_linears(self) -> bool:
        return self.linear_kind == "int8"

    def logits_head(self, tied_embeddings: bool, computes_logits: bool = True) -> str:
        """How prepare() holds the logits projection, in memory/sizes.LOGITS_HEADS' words: int8 with the
        linears; a tied embedding packed for oneDNN gets a second copy, unless the native bf16 kernel's lookups
        read the packed rows; everything else reads tensors the checkpoint already has."""
        if not computes_logits:
            return "none"
        if self.linear_kind == "int8":
            return "int8"
        if self.linear_kind == "packed" and tied_embeddings and not self.native_bf16_linears:
            return "copy"
        return "shared"


def expected_weight_format(device: str, dtype: str, quantization: str | None, reference: bool,
                           native_kernels: bool, flags: set[str]) -> WeightFormat:
    """The format KernelBackend.choose picks, for the memory plan: `native_kernels` as
    native_kernels_expected says, and oneDNN assumed to pack wherever it is tried on a CPU with `flags` (choose
    also checks a probe matmul, which needs torch; it fails only on a torch built without oneDNN)."""
    check_quantization(quantization)
    native = native_kernels and wants_native_kernels(device, dtype, reference)
    kind = linear_kind(dtype, quantization, reference, native, lambda: onednn_may_pack(device, dtype, flags))
    return WeightFormat(kind, native_bf16_linears(kind, native, dtype))


# ---- which kernel each kind of layer runs --------------------------------------------------------------


def native_linear(kind: str, native_bf16: bool, native: bool, in_features: int) -> bool:
    """Whether a linear of `kind` with `in_features` runs the native kernel (`native_bf16`: bf16 linears do,
    native_bf16_linears; `native`: the kernels run for this model)."""
    if kind == "int8":
        return native and in_features % INT8_K_MULTIPLE == 0
    return kind == "packed" and native_bf16 and in_features % BF16_K_MULTIPLE == 0


# What a linear runs (layers/linear.py: each class says which of these it is, as `implementation`).
LINEAR_IMPLEMENTATIONS = {"native-bf16": "native bf16", "native-int8": "native int8",
                          "native-gguf": "native GGUF blocks", "onednn": "oneDNN packed", "torch-int8": "torch int8",
                          "plain": "F.linear"}  # -> words of the log and doctor


def linear_implementation(kind: str, native: bool, onednn_packs: Callable[[], bool]) -> str:
    """What a linear of `kind` runs (a key of LINEAR_IMPLEMENTATIONS): `native` where native_linear says the
    native kernel takes it; a "packed" linear off the native kernel runs oneDNN where it packs this dtype
    here (`onednn_packs`, asked only then), else F.linear (a bf16 linear the AVX2 kernel does not take)."""
    if kind == "int8":
        return "native-int8" if native else "torch-int8"
    if kind == "packed":
        if native:
            return "native-bf16"
        if onednn_packs():
            return "onednn"
    return "plain"


def linear_words(implementation: str, isa: str | None) -> str:
    """A linear's kernel in the start-up log's and doctor's words; `isa` names the native kernels' ISA."""
    words = LINEAR_IMPLEMENTATIONS[implementation]
    return f"{words} ({isa})" if implementation.startswith("native") else words


def decoder_kernels_fit(hidden: int, intermediate: int, head_dim: int) -> bool:
    """Whether a decoder's sizes fit the native norms, SiLU x up, rotary and decode attention."""
    return not any(d % VECTOR_MULTIPLE for d in (hidden, intermediate, head_dim)) and head_dim <= MAX_HEAD_DIM


def rotary_dim(hf_config: object, head_dim: int) -> int:
    """How many leading dimensions of each head rotary rotates, as transformers reads it: all of them but where
    `partial_rotary_factor` says less (Phi-4-mini: 0.75); the rest pass through unrotated."""
    params = getattr(hf_config, "rope_parameters", None)
    factor = params.get("partial_rotary_factor") if isinstance(params, dict) else None
    return int(head_dim * (factor or getattr(hf_config, "partial_rotary_factor", None) or 1.0))


def partial_rotary(hf_config: object) -> bool:
    """Rotary leaves part of each head unrotated (Phi-4-mini)."""
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
    return rotary_dim(hf_config, head_dim) < head_dim


def kv_quantized(kv_cache_dtype: str) -> bool:
    """An 8-bit KV pool (--kv-cache-dtype fp8*, with a scale per token and head; the native kernels write and read
    it as torch ops do)."""
    return kv_cache_dtype.startswith("fp8")


def fused_rotary(attention_native: bool, head_dim: int, partial: bool = False) -> bool:
    """Rotary runs fused with the KV write (one native call, Qwen3's and Gemma 3's per-head q/k norms included)
    where attention runs the native kernels, not where it rotates only part of each head (`partial`)."""
    return attention_native and not partial and head_dim % ROTARY_MULTIPLE == 0


@dataclass(frozen=True)
class LinearKernel:
    name: str  # qkv | o | gate_up | down | logits
    words: str  # linear_kernel's
    native: bool  # on pagedserve's native kernel


@dataclass(frozen=True)
class LayerKernels:
    """What every decoder layer of a model runs (they are alike), in the words of the start-up log and doctor."""

    num_layers: int
    linears: tuple[LinearKernel, ...]
    decoder_native: bool  # norms, the MLP's gate x up and attention on the native kernels
    rotary_fused: bool
    tp: tuple[int, int] | None = None  # (rank, world size) with tensor parallelism
    activation: str = "silu"  # the MLP's gate; the native kernel and the decode stack's MLP: NATIVE_ACTIVATIONS
    native_attention: bool | None = None  # attention on the native kernels where the norms are not (Gemma); None:
    # as decoder_native
    sdpa_prefill: bool = False  # prefill chunks' attention on torch's SDPA, decode's native (probe.sdpa_prefill)
    softcapped: bool = False  # capped scores' prefill chunks on torch ops (capped_prefill_on_torch)
    experts: tuple[int, int] | None = None  # (experts, experts per token) of mixture-of-experts MLPs

    @property
    def activation_native(self) -> bool:
        return self.decoder_native and self.activation in NATIVE_ACTIVATIONS

    @property
    def attention_native(self) -> bool:
        return self.decoder_native if self.native_attention is None else self.native_attention

    @property
    def stack(self) -> bool:
        """Decode-only steps run every layer on the C decoder layer: it needs every part of a layer native (and
        one MLP: experts run layer by layer)."""
        return self.experts is None and self.activation_native and self.rotary_fused and all(
            linear.native for linear in self.linears if linear.name != "logits")

    @property
    def prefill_words(self) -> str:
        if self.softcapped:
            return "torch (capped scores)"
        if not self.attention_native:
            return "torch SDPA"
        return ("torch SDPA from 256 x 256 query x key pairs a chunk (the CPU's rule, probe.sdpa_prefill, or "
                "PAGEDSERVE_CPU_SDPA_PREFILL=1), native below" if self.sdpa_prefill else "native")

    def lines(self) -> list[str]:
        native = "native" if self.decoder_native else "torch"
        stack = "off" if self.experts is None else "off (mixture-of-experts layers run layer by layer)"
        if self.stack:
            stack = "on, one native call" if self.tp is None else (
                f"on (tensor parallel, rank {self.tp[0]} of {self.tp[1]}: two native calls per layer, all-reducing "
                "after each)")
        experts = "" if self.experts is None else f" (MLPs: {self.experts[0]} experts, {self.experts[1]} per token)"
        return [f"{self.num_layers} decoder layers{experts}: " + ", ".join(f"{l.name} {l.words}" for l in self.linears),
                f"norms {native}; {_ACTIVATION_WORDS.get(self.activation, self.activation)} x up "
                f"{'native' if self.activation_native else 'torch'}; "
                f"rotary + KV write {'native' if self.rotary_fused else 'torch'}; "
                f"decode attention {'native' if self.attention_native else 'torch'}; "
                f"prefill attention {self.prefill_words}",
                f"decode stack (every layer's C attention and MLP halves for decode-only steps): {stack}"]


_ACTIVATION_WORDS = {"silu": "SiLU", "gelu": "GELU", "gelu_pytorch_tanh": "GELU (tanh)"}


def capped_prefill_on_torch(capped: bool, batch_invariant: bool) -> bool:
    """Whether prefill chunks of attention that caps its scores (Gemma 2) run torch's eager attention (the native
    prefill kernel with the cap ran a 2048-token prompt at 0.89x on the AMX Xeon): yes, except in batch-invariant
    mode, where they take the native kernels with the cap, since torch's row blocks follow the chunking. The one rule
    for layers.attention.paged_attention and for what the start-up log and doctor say."""
    return capped and not batch_invariant


def layer_words(words: list[str]) -> str:
    """One linear's words over a decoder's layers (one entry a layer): the kernel they all run, or each kernel with
    its count of layers, in the order they first appear (a GGUF's types may differ from layer to layer: "native GGUF
    blocks (avx512) in 12 of 24 layers, native int8 (avx512) in 12")."""
    counts = Counter(words)
    if len(counts) == 1:
        return words[0]
    (first, count), *rest = counts.items()
    return f"{first} in {count} of {len(words)} layers, " + ", ".join(f"{other} in {n}" for other, n in rest)


def expected_layer_kernels(fmt: WeightFormat, isa: str | None, hf_config: object, onednn_packs: bool,
                           tp_size: int = 1, logits: bool = True, activation: str = "silu",
                           sdpa_prefill: bool = False, softcapped: bool = False,
                           block_linears: list[set[str]] | None = None) -> LayerKernels:
    """What a Llama-family decoder's layers will run, from its config: `fmt` and `isa` (the native kernels'
    ISA where they run for this model, else None) as KernelBackend.choose gives them; `onednn_packs`:
    onednn_may_pack for the model's device and dtype; `tp_size` ranks shard
    o's input (the heads) and down's (the intermediate width) as distributed/sharding.py does; `logits`:
    the model has an LM head (not an embedding model); `activation`: the MLP's gate (the native kernel's are
    NATIVE_ACTIVATIONS); `sdpa_prefill`: probe.sdpa_prefill for this CPU and dtype; `softcapped`: the attention caps
    its scores; `block_linears`: per layer, the linears that keep a GGUF's blocks (gguf_block_linears; "logits" in
    each where the head does): the native block kernel where the native kernels run. An 8-bit KV pool
    (--kv-cache-dtype fp8) changes none of it."""
    cfg = hf_config
    heads = cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    hidden, intermediate = cfg.hidden_size, cfg.intermediate_size // tp_size  # this rank's MLP width
    moe = moe_shape(cfg)
    widths = {intermediate}  # every MLP's width (the first layer's is the one reported)
    if moe is not None:  # no tensor parallelism (sharding.py refuses it)
        widths = {moe.width, moe.shared_width} - {0} | ({intermediate} if moe.dense_layers else set())
        intermediate = intermediate if 0 in moe.dense_layers else moe.width
    kind = fmt.linear_kind
    fits = isa is not None and kind != "plain" and all(decoder_kernels_fit(hidden, w, head_dim) for w in widths)
    inputs = (("qkv", hidden), ("o", heads // tp_size * head_dim), ("gate_up", hidden),
              ("down", intermediate)) + ((("logits", hidden),) if logits else ())
    layers = block_linears if block_linears and isa is not None and kind == "int8" else [set()]
    linears = []
    for name, width in inputs:
        native = native_linear(kind, fmt.native_bf16_linears, isa is not None, width)
        plain = linear_implementation(kind, native, lambda: onednn_packs)
        per_layer = ["native-gguf" if name in blocks else plain for blocks in layers[:1 if name == "logits" else None]]
        linears.append(LinearKernel(name, layer_words([linear_words(i, isa) for i in per_layer]),
                                    all(i == "native-gguf" or native for i in per_layer)))
    linears = tuple(linears)
    return LayerKernels(cfg.num_hidden_layers, linears, fits, fused_rotary(fits, head_dim, partial_rotary(cfg)),
                        None if tp_size == 1 else (0, tp_size), activation, sdpa_prefill=fits and sdpa_prefill,
                        softcapped=fits and softcapped, experts=None if moe is None else (moe.num_experts, moe.top_k))
