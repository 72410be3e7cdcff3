"""EngineArgs: every engine setting, documented once; CLI flags are generated from these fields."""

from __future__ import annotations

import argparse
import dataclasses
import numbers
import re
from dataclasses import dataclass, field
from typing import Any, ClassVar

from pagedserve.config import CacheConfig, ModelConfig, ParallelConfig, SchedulerConfig
from pagedserve.memory.plan import DEFAULT_MEMORY_FRACTION
from pagedserve.models.fetch import DEFAULT_MODEL
from pagedserve.spec_decode.config import DEFAULT_DISABLE_BY_BATCH_SIZE
from pagedserve.structured.params import DEFAULT_COMPILE_TIMEOUT_S

SUPPORTED_KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")


def setting(help_text: str, **kwargs: Any) -> Any:
    """A documented field: `default` or `default_factory`, and metadata (positional, aliases, choices, hidden,
    flag) for add_field_flag."""
    if "default_factory" in kwargs:
        return field(default_factory=kwargs.pop("default_factory"), metadata={"help": help_text, **kwargs})
    return field(default=kwargs.pop("default", None), metadata={"help": help_text, **kwargs})


class FlagArgs:
    """A dataclass of `setting` fields whose command-line flags are generated from the fields: `--name-of-field`,
    typed and documented by the field. A field with flag=False in its metadata gets no flag; one with
    group=KEY goes into the --help section titled group_titles[KEY]."""

    group_titles: ClassVar[dict[str, str]] = {}

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> Any:
        """Every field's flag; the parser back, as vLLM's add_cli_args returns it."""
        groups = {key: parser.add_argument_group(title) for key, title in cls.group_titles.items()}
        for f in dataclasses.fields(cls):
            if f.metadata.get("flag", True):
                add_field_flag(groups.get(f.metadata.get("group"), parser), f)
        return parser

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace, **others: Any) -> Any:
        """An instance from the parsed flags (`others`: the fields that have none)."""
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in vars(args).items() if k in names}, **others)


_SIZE = re.compile(r"(\d+(?:\.\d+)?)([kKmMgGtT])")


def human_readable_int(value: str, auto: bool = False) -> int:
    """An integer, or vLLM's human-readable form: k/m/g/t are powers of 1000 (`32k` = 32000, decimals allowed),
    K/M/G/T powers of 1024 (`32K` = 32768, whole numbers only)."""
    text = value.strip()
    match = _SIZE.fullmatch(text)
    if match is None:
        try:
            return int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid int value: {value!r} (a number, or e.g. 32k or 32K"
                                             f"{', or auto' if auto else ''})") from None
    number, suffix = match.groups()
    if suffix.islower():
        return int(float(number) * 1000 ** ("kmgt".index(suffix) + 1))
    if "." in number:
        raise argparse.ArgumentTypeError(f"{value!r}: binary suffixes like {suffix} take whole numbers; did you mean "
                                         f"{number}{suffix.lower()}?")
    return int(number) * 1024 ** ("KMGT".index(suffix) + 1)


AUTO_SIZE = -1  # vLLM's "auto" (or -1) for --max-model-len: the longest that the memory holds


def human_readable_int_or_auto(value: str) -> int:
    """human_readable_int, or "auto" / -1 (AUTO_SIZE), as vLLM's --max-model-len takes them."""
    return AUTO_SIZE if value.strip().lower() == "auto" else human_readable_int(value, auto=True)


# The numeric fields' types (a string field may take what its reader converts, dtype=torch.float32; an on/off one
# anything true or false, as vLLM's LLM takes enforce_eager=1).
_KEYWORD_TYPES = {"int": (numbers.Integral,), "int | None": (numbers.Integral, type(None)), "float": (numbers.Real,),
                  "float | None": (numbers.Real, type(None))}


def keyword_aliases(cls: type) -> dict[str, str]:
    """The keyword forms of `cls`'s long flag aliases -> their fields (kv_cache_memory_bytes -> kv_cache_memory)."""
    return {alias[2:].replace("-", "_"): f.name for f in dataclasses.fields(cls)
            for alias in f.metadata.get("aliases", ()) if alias.startswith("--")}


def read_keywords(cls: type, kwargs: dict[str, Any]) -> dict[str, Any]:
    """Keyword arguments for `cls` (a FlagArgs dataclass, as LLM(...) passes them) checked as its flags are: size
    fields given as strings ("1k", "32K", "auto") read as the flags read them, and a value of another type than
    the field's a ValueError naming the keyword (LLM(seed="abc") loaded the model, then failed in torch)."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    aliases = keyword_aliases(cls)
    read = {}  # a flag's other name is its keyword's too (vLLM's kv_cache_memory_bytes: --kv-cache-memory-bytes)
    for name, value in kwargs.items():
        if aliases.get(name, name) in read:
            raise ValueError(f"{name} and {aliases.get(name, name)} name one setting: give one of them")
        read[aliases.get(name, name)] = value
    for name, value in list(read.items()):
        field = fields.get(name)
        if field is None:
            continue  # the dataclass's own TypeError names it
        if field.metadata.get("size") and isinstance(value, str):
            kind = human_readable_int_or_auto if field.metadata.get("auto") else human_readable_int
            try:
                read[name] = value = kind(value)
            except argparse.ArgumentTypeError as exc:
                raise ValueError(f"{name}: {exc}") from None
        allowed = _KEYWORD_TYPES.get(str(field.type))
        if allowed is not None and (isinstance(value, bool) or not isinstance(value, allowed)):
            wanted = " or ".join({"NoneType": "None", "Integral": "an integer"}.get(t.__name__, "a number")
                                 for t in allowed)
            raise ValueError(f"{name} must be {wanted}, got {type(value).__name__} {value!r}")
    return read


def _with_default(help_text: str, default: Any) -> str:
    """The help with its default appended, unless the text already says it or there is none to say."""
    if "(default" in help_text or "default:" in help_text or default is None or default is dataclasses.MISSING:
        return help_text
    if isinstance(default, bool):
        shown = "on" if default else "off"
    elif isinstance(default, (list, tuple)):
        if not default:
            return help_text
        shown = " ".join(str(v) for v in default)
    elif isinstance(default, str) and not default:
        return help_text
    else:
        shown = f"{default:g}" if isinstance(default, float) else str(default)
    note = f"(default: {shown.replace('%', '%%')})"
    return f"{help_text[:-1]} {note}." if help_text.endswith(".") else f"{help_text} {note}"


class DefaultsHelpFormatter(argparse.HelpFormatter):
    """--help with each flag's default, by _with_default's rules (not where the help says it or there is none;
    not for on/off switches), for the commands whose flags are not EngineArgs fields (bench, watch)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if action.nargs == 0 or action.default is argparse.SUPPRESS:
            return text
        return _with_default(text, action.default).strip()


def add_field_flag(parser: argparse.ArgumentParser | argparse._ArgumentGroup, f: dataclasses.Field) -> None:
    """`--name-of-field` (and the field's aliases), typed and documented by the dataclass field: a bool is
    --x/--no-x; choices=(...) in the metadata limits the values; nargs="+" takes a list; size=True takes 32k or
    32K as vLLM does (human_readable_int); hidden=True leaves it out of --help."""
    meta = f.metadata
    flags = ["--" + f.name.replace("_", "-"), *meta.get("aliases", ())]
    help_text = argparse.SUPPRESS if meta.get("hidden") else _with_default(meta["help"], f.default)
    if f.type in ("bool", bool):
        parser.add_argument(*flags, action=argparse.BooleanOptionalAction, default=f.default, help=help_text)
        return
    kind = {"int": int, "int | None": int, "float": float, "float | None": float}.get(str(f.type), str)
    if meta.get("size"):  # vLLM's human-readable sizes: 32k, 32K
        kind = human_readable_int_or_auto if meta.get("auto") else human_readable_int
    extra = {"nargs": meta["nargs"]} if "nargs" in meta else {}
    parser.add_argument(*flags, type=kind, default=f.default, help=help_text, choices=meta.get("choices"), **extra)


# A default is defined once: where a setting is a field of a frozen config (config.py), its EngineArgs
# default is read from there; where the flag says "auto" or None, engine/setup.py resolves it and the
# resolved default lives in the config or module named in the help. tests/unit/test_defaults.py checks it.
@dataclass
class EngineArgs(FlagArgs):
    model: str | None = setting("Model: a Hugging Face directory, a .gguf file, or a known name "
                             f"(default: {DEFAULT_MODEL}).", positional=True)
    served_model_name: str | list[str] | None = setting(
        "Model name in the API (default: the model argument). Several names (vLLM's): requests may use any, "
        "replies carry the first.", nargs="+")
    tokenizer: str | None = setting("Tokenizer directory (default: the model's).")
    dtype: str = setting("Weights and activations dtype: auto, float32, bfloat16, float16/half. auto picks "
                      "the fastest on this device (CPU: bfloat16 weights where pagedserve's native kernels run, AVX2 "
                      "or AVX-512, or the CPU has bf16 dot products; else float32; `pagedserve doctor` says "
                      "which and why). A block-quantized GGUF is served from int8 weights under auto; a dtype named "
                      "here serves its weights widened to that dtype (add --quantization int8 to keep int8).",
                      default="auto")
    max_model_len: int | None = setting("Longest sequence (prompt + output) in tokens, e.g. 4096, 32k (32000) or "
                                     "32K (32768); auto or -1 (vLLM's): the model's context length, or the longest "
                                     "one sequence of which the memory holds (default: the model's context "
                                     "length; an embedding model's sentence-transformers max_seq_length).",
                                     size=True, auto=True)
    disable_sliding_window: bool = setting(
        "vLLM's: cap the context at the model's sliding window (the smallest, where layers differ), within which "
        "every layer attends to the whole sequence; without it a sliding-window model serves its whole context, "
        "its windowed layers attending to their window.", default=False)
    max_num_seqs: int = setting("Most requests running at once.", default=SchedulerConfig.max_num_seqs)
    max_num_batched_tokens: int | None = setting(f"Token budget of one engine step (default: "
                                              f"{SchedulerConfig.max_num_batched_tokens}, at least "
                                              "max_model_len when chunked prefill is off); 8k, 8K as for "
                                              "--max-model-len.", size=True)
    block_size: int = setting("Tokens per KV-cache block.", default=CacheConfig.block_size)
    enable_prefix_caching: bool = setting("Reuse the KV cache of shared prompt prefixes.",
                                       default=CacheConfig.enable_prefix_caching)
    kv_cache_idle_release_s: float = setting(
        "Seconds a server may have nothing to run before it hands the KV cache's resident pages back to the system "
        "(on a CPU): the prefix cache is emptied, and the next request computes its prompt again. The pages of a "
        "block stay resident once written, so without it a light but varied load leaves the whole pool resident. "
        "0: never.", default=CacheConfig.idle_release_s)
    disable_hybrid_kv_cache_manager: bool = setting(
        "Keep every layer's K/V in one pool. By default, where some layers attend within a sliding window and "
        "others to the whole context (Gemma 2/3), the window layers get a pool of their own that holds about a "
        "window per request instead of the whole context (vLLM's hybrid KV cache manager).", default=False)
    enable_chunked_prefill: bool = setting("Split long prompts across steps so decodes keep flowing.",
                                        default=SchedulerConfig.enable_chunked_prefill)
    gpu_memory_utilization: float | None = setting(
        f"Fraction of device memory the engine may use (default {DEFAULT_MEMORY_FRACTION:g}). On a CPU, when given, the fraction of "
        "available RAM the engine may fill, its KV cache taking what the rest leaves (vLLM's GPU meaning), up to "
        "max_num_seqs x max_model_len tokens; "
        "unset, the CPU KV cache follows the shared-box default: max_num_seqs x max_model_len tokens, at most "
        "25%% of the available RAM.")
    kv_cache_memory: int | None = setting("Bytes of KV cache, e.g. 2G (overrides the fraction and the CPU default; "
                                       "on CPU also set by VLLM_CPU_KVCACHE_SPACE in GiB).", size=True,
                                       aliases=("--kv-cache-memory-bytes",))
    num_gpu_blocks_override: int | None = setting("Exact number of KV blocks, one of which is reserved (vLLM's null "
                                                  "block): N holds N - 1 blocks of tokens (testing).")
    kv_cache_dtype: str = setting("KV cache dtype: auto (= model dtype), fp8 (= fp8_e4m3) or fp8_e5m2: 8-bit "
                                "K/V with a scale per token and head, about half the memory.",
                                default=CacheConfig.kv_cache_dtype)
    quantization: str | None = setting("Weight quantization: int8 (weight-only, one scale per output channel).",
                                    default=ModelConfig.quantization, aliases=("-q",))
    tensor_parallel_size: int = setting(
        "Tensor-parallel ranks (vLLM's -tp): N processes on this host, each holding 1/N of every layer "
        "(Megatron split; KV heads replicated where there are fewer than N) and running on its own cores; "
        "one all-reduce after each attention and MLP. Helps where one process cannot use the memory bandwidth "
        "of every NUMA node (one rank per node). See the README.", default=ParallelConfig.tensor_parallel_size,
        aliases=("-tp",))
    cpu_binding: str | None = setting(
        "Cores of each tensor-parallel rank (-tp N), '|'-separated lists: \"0-7|8-15\" (default: "
        "$VLLM_CPU_OMP_THREADS_BIND, as vLLM's); with one rank, the engine's cores (\"0-3\"). Otherwise one NUMA "
        "node per rank where the usable cores span N nodes, else the usable physical cores split evenly (auto); "
        "nobind lets every rank run on every core; one thread per physical core (one CPU of each) unless "
        "--num-threads.")
    tp_all_reduce: str = setting("Testing and benchmarks: the tensor-parallel collectives' path: auto (shared "
                              "memory on one x86 host, else gloo), shm or gloo.", default=ParallelConfig.all_reduce,
                              hidden=True)
    enforce_eager: bool = setting("Accepted for vLLM's command lines and changes nothing: pagedserve never compiles "
                                "model graphs (its native CPU kernels are a library built once) (default: always "
                                "eager).",
                                default=ModelConfig.enforce_eager)
    reference_kernels: bool = setting("Use the plain reference kernels (F.linear) instead of the fast ones "
                                   "(debugging, correctness checks).", default=ModelConfig.reference_kernels)
    generation_config: str = setting(
        "Sampling defaults for requests that leave them out (temperature, top_p, top_k, min_p, repetition_penalty; "
        "max_new_tokens is max_tokens where a chat request gives none), as vLLM: auto (the model's "
        "generation_config.json, its authors' recommendation), vllm (none: temperature 1, no top-p/top-k), or a "
        "folder holding a generation_config.json, whose max_new_tokens caps every request's max_tokens (vLLM's "
        "rule).", default="auto")
    override_generation_config: str | None = setting(
        "Those defaults as a JSON object, over --generation-config's: '{\"temperature\": 0.5}' (names as in "
        "generation_config.json); a max_new_tokens here caps every request's max_tokens (vLLM's rule).")
    max_logprobs: int = setting("The most logprobs (top_logprobs) or prompt_logprobs a request may ask for; -1: "
                                "as many as the vocabulary holds (vLLM's; OpenAI allows 20).",
                                default=ModelConfig.max_logprobs)
    seed: int | None = setting("Seed for unseeded random sampling (None: a different one each start, as vLLM's "
                               "seed=None).", default=ModelConfig.seed)
    device: str = setting("cpu, cuda or auto.", default="auto")
    num_threads: int | None = setting("Torch threads on CPU. Default: one per physical core this process may "
                                      "use, within the cgroup CPU quota: SMT siblings are left out, and on a "
                                      "hybrid CPU the efficiency cores (as torch, llama.cpp and vLLM do).")
    cpu_give_way: bool = setting(
        "On a CPU, run fewer threads while other processes keep this process's CPUs busy (read from /proc/stat "
        "twice a second), and all of them again when they stop: threads that wait for a busy CPU's turn stall "
        "every parallel step (SmolLM2-135M next to a busy process on 2 vCPUs: 0.6 tok/s on 2 threads, 59 on 1). "
        "Off in batch-invariant mode and with --tensor-parallel-size > 1.", default=True)
    task: str = setting("auto, generate or embed. auto: embed for encoders (BERT), decoders saved without an LM "
                     "head, and models with a sentence-transformers pooling module (modules.json); else "
                     "generate.", default="auto")
    runner: str = setting("auto, generate or pooling (vLLM's name; pooling = --task embed).", default="auto")
    convert: str = setting("auto, none or embed (vLLM's name: `--runner pooling --convert embed` serves a "
                           "generative model as an embedder, as --task embed does; classify and reward are not "
                           "supported).", default="auto")
    long_prefill_token_threshold: int = setting(
        "vLLM's: with chunked prefill, a prompt prefills at most this many tokens a step, so that requests arriving "
        "behind a long prompt start beside it instead of waiting for all of it (0: a prompt may take the whole "
        "--max-num-batched-tokens budget).", default=SchedulerConfig.long_prefill_token_threshold)
    max_waiting_requests: int = setting("Requests queued beyond --max-num-seqs: once running plus waiting requests "
                                     "reach --max-num-seqs + this, a new one gets 429 (preempted requests wait too).",
                                     default=SchedulerConfig.max_waiting_requests)
    scheduling_policy: str = setting("fcfs (first come, first served) or priority: requests with a lower "
                                     "`priority` field are scheduled first and preempted last, ties by arrival "
                                     "(vLLM's).", default=SchedulerConfig.policy, choices=("fcfs", "priority"))
    structured_outputs_config: str | None = setting(
        "Structured outputs, as JSON (vLLM's flag): {\"backend\": \"xgrammar\"} (the one backend; \"auto\" "
        "means it), \"disable_any_whitespace\": true for compact JSON, \"compile_timeout_s\": seconds before a "
        f"grammar still compiling gets a 400 (default {DEFAULT_COMPILE_TIMEOUT_S:g}).")
    speculative_config: str | None = setting(
        "Speculative decoding, as JSON (vLLM's flag; LLM(speculative_config=dict) takes the same dict): "
        "{\"method\": \"ngram\", \"num_speculative_tokens\": 5, \"prompt_lookup_max\": 4, "
        "\"prompt_lookup_min\": 2} proposes the tokens that followed the latest earlier occurrence of the "
        "output's last 2-4 tokens in the prompt or output, verified in the next step (outputs unchanged); "
        "\"disable_by_batch_size\": no speculation while more requests run "
        f"(default {DEFAULT_DISABLE_BY_BATCH_SIZE}).")
    fault_injection: str | None = setting("Testing only: faults to raise inside the engine, as "
                                       "POINT:MATCH[:COUNT] rules (pagedserve/engine/faults.py).", hidden=True)
    memory_pressure_meminfo: str | None = setting("Testing only: the meminfo file the server's memory-pressure "
                                               "monitor reads (a simulated MemAvailable).", hidden=True)

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser | argparse._ArgumentGroup,
                     positional_model: bool = False) -> Any:
        """Every engine flag; the parser back, as vLLM's. The model is `--model`, as in vLLM's EngineArgs (a
        script's `LLM(**vars(args))` works), and a script's parser also takes vLLM's other engine flags, as `serve`
        does (engine/vllm_compat.py: --trust-remote-code, --swap-space, ...; LLM checks them) and
        --disable-log-stats. pagedserve's commands also take the model as the positional MODEL
        (`positional_model`), and add the vLLM flags themselves."""
        for f in dataclasses.fields(cls):
            if f.metadata.get("positional"):
                if positional_model:
                    parser.add_argument(f.name, nargs="?", default=f.default, help=f.metadata["help"])
                    parser.add_argument("--model", dest="model_flag", default=None,
                                        help="Same as the positional MODEL.")
                else:
                    parser.add_argument("--model", default=f.default, help=f.metadata["help"])
                continue
            add_field_flag(parser, f)
        if not positional_model:
            from pagedserve.engine import vllm_compat

            parser.add_argument("--disable-log-stats", action="store_true",
                                help="LLM's disable_log_stats: off, LLM.get_metrics() reads the vllm:* series.")
            vllm_compat.add_cli_args(parser)
        return parser

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace, **others: Any) -> "EngineArgs":
        """As FlagArgs', with the model from MODEL or --model; ValueError for a command line whose model is
        ambiguous: both forms naming different models, or none but several --served-model-name values (`serve
        --served-model-name NAME MODEL` takes MODEL as a second name, and vLLM refuses it; the default model would
        be served under the names)."""
        values = vars(args)
        flag, positional = values.get("model_flag"), values.get("model")
        if flag is not None and positional is not None and flag != positional:
            raise ValueError(f"the model is given twice, {positional!r} and --model {flag!r}: give one")
        model = flag if flag is not None else positional
        names = values.get("served_model_name")
        if model is None and isinstance(names, list) and len(names) > 1:
            raise ValueError(f"no model is named, and --served-model-name has {len(names)} values "
                             f"({' '.join(names)}): the model goes first, as in vLLM: `pagedserve serve MODEL "
                             "--served-model-name NAME`")
        return super().from_cli_args(argparse.Namespace(**{**vars(args), "model": model}), **others)

    def create_engine_config(self) -> Any:
        """vLLM's EngineArgs.create_engine_config(): every setting resolved and the memory planned, from headers
        only (no weights read): engine/setup.create_engine_config."""
        from pagedserve.engine.setup import create_engine_config

        return create_engine_config(self)



@dataclass
class RequestLimits(FlagArgs):
    """Per-request bounds the server enforces (HTTP 400 naming the field beyond them), so that no single
    request can occupy the engine for long. Defaults follow the OpenAI API's limits where it has one."""

    max_n: int = setting("Most completions a request may ask for with n (OpenAI's limit: 128).", default=128)
    max_prompts_per_request: int = setting("Most prompts in one /v1/completions request (a list of prompts).",
                                        default=256)
    max_stop_sequences: int = setting("Most stop strings per request (OpenAI's limit is 4; vLLM has none, and "
                                      "evaluation harnesses send more).", default=64)
    max_stop_sequence_chars: int = setting("Longest stop string, in characters.", default=1024)
    max_stop_token_ids: int = setting("Most stop_token_ids per request.", default=64)
    max_logit_bias_entries: int = setting("Most logit_bias entries per request (OpenAI's limit: 300).", default=300)
    max_request_tokens: int = setting("Most tokens one request may ask the engine for: the sum over its "
                                   "completions (n x prompts) of prompt + max_tokens; at least max_model_len "
                                   "is always allowed.", default=131072)
    max_request_id_chars: int = setting("Longest client-chosen request_id.", default=128)

    def check(self) -> None:
        """ValueError naming the flag for a bound below 1."""
        for f in dataclasses.fields(self):
            if getattr(self, f.name) < 1:
                raise ValueError(f"--{f.name.replace('_', '-')} must be >= 1, got {getattr(self, f.name)}")
