"""`pagedserve doctor MODEL`'s model checks: the files, the memory plan `serve` would compute with the same
flags (create_engine_config, from headers only: the verdicts agree with `serve` and `pagedserve plan`), and what
each kind of decoder layer will run. The engine's configuration is resolved once and shared by the last two."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from pagedserve import envs
from pagedserve.cli.check_result import FAIL, PASS, WARN, CheckResult
from pagedserve.engine.arg_utils import EngineArgs
from pagedserve.engine.memory_plan import softcapped_attention
from pagedserve.memory import probe
from pagedserve.memory.weight_format import (FILE_QUANTIZATION, NATIVE_ACTIVATIONS, capped_prefill_on_torch,
                                             expected_layer_kernels, expected_weight_format, file_quantization_reason,
                                             gguf_block_linears, onednn_may_pack, partial_rotary, wants_native_kernels)

if TYPE_CHECKING:
    from pagedserve.config import EngineConfig

SIZING_ERRORS = (OSError, ValueError, KeyError)  # what create_engine_config raises for a model it cannot size


def check_model(path: str | Path) -> CheckResult:
    """Config, weights (complete, not truncated, of config.json's shape) and tokenizer (it loads): headers and the
    tokenizer only, no weights read."""
    from pagedserve.engine.setup import load_tokenizer
    from pagedserve.models.validate import ModelValidationError, validate_model_path

    from pagedserve.chat_template import template_problem

    try:
        validate_model_path(path)
        tokenizer = load_tokenizer(str(path))
    except ModelValidationError as exc:
        return CheckResult("model", FAIL, str(exc))  # the message names the fix
    problem = template_problem(getattr(tokenizer, "chat_template", None))
    if problem:
        return CheckResult("model", WARN, f"{path}: config, weights and tokenizer are complete, but its {problem}: "
                           "chat requests would get a 400", "serve with --chat-template FILE (a working template)")
    if not getattr(tokenizer, "chat_template", None):  # a PASS: completions and embeddings need none
        return CheckResult("model", PASS, f"{path}: config, weights and tokenizer are complete; it has no chat "
                           "template, so chat requests get a 400 unless served with --chat-template FILE")
    return CheckResult("model", PASS, f"{path}: config, weights and tokenizer are complete")


def check_weight_shapes(config: EngineConfig) -> CheckResult:
    """Every tensor's name and shape against the model the config (or a GGUF's metadata) describes, as loading
    checks them, from the headers (serve refused such files while doctor passed them)."""
    from pagedserve.models.loader import check_checkpoint_shapes
    from pagedserve.models.validate import ModelValidationError

    model = config.model
    try:
        check_checkpoint_shapes(model.hf_config, model.architecture, model.model, model.max_model_len, model.task)
    except ModelValidationError as exc:
        return CheckResult("weights", FAIL, f"serve would refuse to load it: {exc}")
    return CheckResult("weights", PASS, "every tensor has the name and shape the model's config implies")


def check_draft_model(engine_args: EngineArgs, config: EngineConfig) -> CheckResult:
    """--speculative-config's draft model shares the target's tokenizer, as serve checks it (doctor passed a draft
    serve refused)."""
    from pagedserve.engine.setup import check_draft_of

    name = config.draft_model.served_model_name
    try:
        check_draft_of(engine_args, config)
    except ValueError as exc:
        return CheckResult("draft model", FAIL, str(exc).removeprefix("--speculative-config: "),
                           "give a draft of the target's family (the same tokenizer), or n-gram speculation")
    return CheckResult("draft model", PASS, f"{name} shares the target's tokenizer")


def engine_config(engine_args: EngineArgs, available: probe.AvailableMemory | None = None) -> EngineConfig:
    """The configuration `serve` resolves from these flags, its memory plan included, without the memory
    check that would refuse to start; `available` replaces the probe serve would run (tests)."""
    from pagedserve.engine.setup import create_engine_config

    return create_engine_config(engine_args, available=available, check_memory=False)


def check_memory_plan(engine_args: EngineArgs, available: probe.AvailableMemory | None = None) -> CheckResult:
    """Would `serve` with these flags fit? (engine_config, then memory_plan_result.)"""
    try:
        config = engine_config(engine_args, available)
    except SIZING_ERRORS as exc:
        return _cannot_size(exc)
    return memory_plan_result(config)


def _cannot_size(exc: BaseException) -> CheckResult:
    """A ValueError is what serve would refuse to start with (a setting the model cannot take, e.g. a
    --max-model-len past its trained context): a FAIL; a file doctor could not read, a warning."""
    if isinstance(exc, ValueError):
        return CheckResult("memory plan", FAIL, f"serve would refuse to start: {exc}")
    return CheckResult("memory plan", WARN, f"cannot size the model: {exc}")


def memory_plan_result(config: EngineConfig) -> CheckResult:
    """The plan's verdict, with the settings it was computed for and, where it does not fit, the flags that
    would make it fit."""
    plan = config.memory_plan
    settings = (f"{config.model.dtype}, max_model_len {config.model.max_model_len}, "
                f"max_num_seqs {config.scheduler.max_num_seqs}")
    if config.cache.kv_cache_dtype != "auto":  # auto: the model's dtype, said first
        settings += f", KV cache {config.cache.kv_cache_dtype}"
    parallel = config.parallel
    if parallel.tensor_parallel_size > 1:
        from pagedserve.distributed.binding import format_cores

        settings += (f", tensor parallel {parallel.tensor_parallel_size} (the plan is per rank; cores "
                     f"{' | '.join(format_cores(list(c)) for c in parallel.cpu_binding)}; decode steps run each "
                     "layer's native halves with an all-reduce after each)")
    if plan.fits:
        return CheckResult("memory plan", PASS, f"{settings}: {plan.summary()}")
    fixes = [f"{s.flag} {s.value}" for s in plan.suggestions] or ["free memory or use a smaller model"]
    return CheckResult("memory plan", FAIL, f"{settings}: {plan.summary()}",
                       "any one of: " + ", ".join(fixes))


def check_layer_kernels(config: EngineConfig, isa: str | None, auto_quantization: bool = False) -> CheckResult | None:
    """What each kind of decoder layer will run (the start-up log's lines, predicted from the config by the
    loader's rule, memory/weight_format.py); `isa`: the native kernels' where they load here, else None;
    `auto_quantization`: the quantization is --dtype auto's choice for the file (then the line says why).
    WARN where the native kernels run for this model but part of it falls back to torch ops."""
    from pagedserve.models.registry import model_class

    model = config.model
    cls = model_class(model.architecture, model.task)
    qk_norm = getattr(cls, "qk_norm", None)
    if qk_norm is None:
        return None  # not a decoder of the Llama family (an encoder): no per-layer kernels to tell
    device, flags = config.device.device, probe.cpu_flags()
    native = isa if wants_native_kernels(device, model.dtype, model.reference_kernels) else None
    fmt = expected_weight_format(device, model.dtype, model.quantization, model.reference_kernels,
                                 native is not None, flags)
    spec = cls.decoder_spec(model.hf_config)
    blocks = None  # per layer, the linears that keep a GGUF's blocks
    if model.quantization == FILE_QUANTIZATION and config.parallel.tensor_parallel_size == 1:
        from pagedserve.formats.gguf_hf import GGUFFile

        with GGUFFile(model.model) as checkpoint:
            blocks = [gguf_block_linears(types) for types in checkpoint.layer_types(model.hf_config.num_hidden_layers)]
    layers = expected_layer_kernels(fmt, native, model.hf_config, onednn_may_pack(device, model.dtype, flags),
                                    config.parallel.tensor_parallel_size, logits=model.task == "generate",
                                    activation=spec.activation,
                                    sdpa_prefill=probe.sdpa_prefill(flags, model.dtype, envs.batch_invariant()),
                                    softcapped=capped_prefill_on_torch(
                                        softcapped_attention(model.architecture, model.hf_config),
                                        envs.batch_invariant()), block_linears=blocks)
    kind = "GGUF blocks or int8" if blocks is not None else fmt.linear_kind
    detail = f"{model.dtype}, {kind} linears: " + "; ".join(layers.lines())
    if auto_quantization and model.quantization in (FILE_QUANTIZATION, "int8") and native is not None:
        from pagedserve.platform import native_kernels_class

        detail += "; " + file_quantization_reason(native_kernels_class(), config.speculative is not None,
                                                  config.parallel.tensor_parallel_size)
    if native is None or layers.stack or (layers.experts is not None and replace(layers, experts=None).stack):
        return CheckResult("layers", PASS, detail)  # (mixture-of-experts layers: all native, never in the stack)
    if fmt.linear_kind == "packed" and not fmt.native_bf16_linears:
        fix = f"{model.dtype} linears run on oneDNN here: --dtype bfloat16 or --quantization int8 runs them natively"
    elif layers.activation not in NATIVE_ACTIVATIONS:
        fix = (f"the MLP's {layers.activation} gate runs torch ops (the native kernel and the decode stack have "
               f"{' and '.join(NATIVE_ACTIVATIONS)}); nothing to change")
    elif partial_rotary(model.hf_config):
        fix = "rotary over part of each head (partial_rotary_factor) keeps rotary and the decode stack on torch ops; "
        fix += "nothing to change"
    else:
        fix = ("this model's sizes are not the multiples the native kernels take (memory/weight_format.py): "
               "the parts named torch run torch ops")
    return CheckResult("layers", WARN, detail, fix)


def model_checks(model: str, engine_args: EngineArgs, native_isa: Callable[[], str | None]
                 ) -> list[Callable[[], CheckResult | None]]:
    """The model's checks, in order: files, memory plan, layers (the last two skipped where the files fail;
    `native_isa`: the native kernels' ISA where they load here)."""
    args = replace(engine_args, model=model)
    file_results: list[CheckResult] = []

    def files_failed() -> bool:
        return bool(file_results) and file_results[-1].status == FAIL

    @functools.cache
    def config() -> EngineConfig | Exception:
        try:
            return engine_config(args)
        except SIZING_ERRORS as exc:
            return exc

    def check_files() -> CheckResult:
        file_results.append(check_model(model))
        return file_results[-1]

    def check_shapes() -> CheckResult | None:
        resolved = None if files_failed() else config()
        if resolved is None or isinstance(resolved, Exception):
            return None
        result = check_weight_shapes(resolved)
        if result.status == FAIL:
            file_results.append(result)  # the plan and the layers are moot for weights serve refuses
        return result

    def check_plan() -> CheckResult | None:
        if files_failed():
            return None  # planning needs readable headers
        resolved = config()
        return _cannot_size(resolved) if isinstance(resolved, Exception) else memory_plan_result(resolved)

    def check_draft() -> CheckResult | None:
        resolved = None if files_failed() else config()
        if resolved is None or isinstance(resolved, Exception) or resolved.draft_model is None:
            return None
        return check_draft_model(args, resolved)

    def check_layers() -> CheckResult | None:
        resolved = None if files_failed() else config()
        if resolved is None or isinstance(resolved, Exception):
            return None
        auto = args.quantization is None and args.dtype == "auto" and resolved.model.quantization is not None
        return check_layer_kernels(resolved, native_isa(), auto)

    return [check_files, check_shapes, check_plan, check_draft, check_layers]
