"""The memory plan as the engine runs it: `pagedserve plan --json` against hand-computed numbers, refusal before
any weight is read, KV sizing from the plan, the model config built without transformers' model classes, and
the GGUF fast paths (torch dequantization equal to gguf-py's, one header parse per start-up)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QType
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import dequantize

from pagedserve.cli.main import main
from pagedserve.engine.arg_utils import AUTO_SIZE, EngineArgs
from pagedserve.engine.setup import (PLAIN_CONFIG_DEFAULTS, check_engine_args, create_engine_config,
                                     hf_config_from_checkpoint)
from pagedserve.formats import gguf as gguf_format
from pagedserve.memory.checkpoint import read_checkpoint_info
from pagedserve.memory.plan import GIB, HOST_BYTES_PER_KV_BLOCK, InsufficientMemoryError
from pagedserve.memory.probe import AvailableMemory
from pagedserve.memory.sizes import (CPU_RUNTIME_BASE_BYTES, GRAMMAR_CACHE_BYTES, STRUCTURED_OUTPUTS_BASE_BYTES,
                                     STRUCTURED_OUTPUTS_BYTES_PER_TOKEN, TOKENIZER_BYTES_PER_TOKEN)
from pagedserve.models import gguf_dequant, gguf_loader, gguf_tokenizer
from tests.models.gguf_utils import tiny_model, write_test_gguf


def fake_host(tmp_path: Path, available_kib: int) -> list[str]:
    """Hidden `plan` flags pointing the probes at a fake /proc/meminfo and a cgroup tree without limits."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    meminfo = tmp_path / "meminfo"
    meminfo.write_text(f"MemTotal: {4 * available_kib} kB\nMemFree: {available_kib} kB\n"
                       f"MemAvailable: {available_kib} kB\nCached: 0 kB\n")
    (tmp_path / "cgroup").mkdir()
    return ["--meminfo", str(meminfo), "--cgroup-root", str(tmp_path / "cgroup")]


def plan_json(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, dict]:
    code = main(["plan", *argv, "--device", "cpu", "--json"])  # the host rules (on a GPU the fraction rule)
    return code, json.loads(capsys.readouterr().out)


def test_plan_json_equals_the_hand_computed_plan(tiny_model_dir, tmp_path, capsys) -> None:
    model = tiny_model_dir("llama")  # vocab 512, hidden 64, inter 128, 2 layers, 4 heads, 2 KV heads, untied
    code, data = plan_json(capsys, model, "--dtype", "float32", "--max-model-len", "64", "--max-num-seqs", "4",
                           "--max-num-batched-tokens", "32", "--gpu-memory-utilization", "0.5",
                           *fake_host(tmp_path, available_kib=1 << 20))
    assert code == 0 and data["fits"] is True
    # Parameters: embed + lm_head 2 x 512 x 64 = 65536; per layer q, o 2 x 64 x 64 + k, v 2 x 64 x 32 +
    # mlp 3 x 64 x 128 + 2 norms x 64 = 36992; final norm 64 -> 139584 parameters x 4 B.
    assert data["weight_bytes"] == data["shape"]["weight_bytes"] == 139584 * 4 == 558336
    assert data["kv_bytes_per_token"] == 2 * 2 * 2 * 16 * 4 == 512
    assert data["block_bytes"] == 16 * 512
    act = data["activations"]
    assert (act["hidden"], act["attention"], act["mlp"]) == (2 * 32 * 64 * 4, 32 * 12 * 16 * 4, 3 * 32 * 128 * 4)
    # One gather of max(M, T) positions; one SDPA call's 32 x 64 query x key pairs (a bool mask and its fp32
    # copy; torch's SDPA does not materialise the scores); the decode slot table 16 B x 4 rows x 64.
    assert act["gathered_kv"] == 2 * 64 * 2 * 16 * 4 and act["scores"] == 32 * 64 * (1 + 4)
    assert act["decode_slots"] == 16 * 4 * 64 and act["logits"] == 2 * 4 * 512 * 4
    assert data["activation_bytes"] == 16384 + 24576 + 49152 + 16384 + 10240 + 4096 + 16384 == 137216
    # Overhead: runtime + tokenizer x vocab + structured outputs (xgrammar) + rotary cos/sin 2 x 64 x 16 x 4 +
    # block table 4 seqs x 4 x 8.
    structured = STRUCTURED_OUTPUTS_BASE_BYTES + GRAMMAR_CACHE_BYTES + STRUCTURED_OUTPUTS_BYTES_PER_TOKEN * 512
    overhead = CPU_RUNTIME_BASE_BYTES + TOKENIZER_BYTES_PER_TOKEN * 512 + structured + 8192 + 128
    assert data["overhead_bytes"] == overhead
    # Budget: 0.5 x 1 GiB (--gpu-memory-utilization given: vLLM's rule); the rest would hold thousands of
    # blocks, but 4 sequences x 4 blocks is all the workload can use.
    assert data["budget_bytes"] == GIB // 2
    assert (data["kv_rule"], data["num_kv_blocks"], data["kv_sizing"]) == ("utilization", 16, "workload")
    assert data["kv_sizing_text"] == "--gpu-memory-utilization 0.50: the workload, max_num_seqs 4 x max_model_len 64"
    assert data["kv_pool_bytes"] == 16 * 8192
    assert data["kv_bookkeeping_bytes"] == 16 * HOST_BYTES_PER_KV_BLOCK
    assert data["total_bytes"] == 558336 + 137216 + overhead + 16 * 8192 + 16 * HOST_BYTES_PER_KV_BLOCK
    assert data["steady_bytes"] == 558336 + overhead + 16 * HOST_BYTES_PER_KV_BLOCK
    assert data["settings"]["num_kv_blocks_allocated"] == 17  # + the null block
    assert data["request"]["available"]["bound_by"] == "MemAvailable"


def test_plan_refuses_with_the_shortfall_and_what_would_fit(tiny_model_dir, tmp_path, capsys) -> None:
    model = tiny_model_dir("llama")
    # 300 MiB available, 90 % usable: less than the runtime alone.
    code, data = plan_json(capsys, model, "--max-model-len", "64", *fake_host(tmp_path, 300 * 1024))
    assert code == 1 and data["fits"] is False
    assert data["shortfall_bytes"] == data["total_bytes"] - data["budget_bytes"] > 0
    assert "short by" in data["summary"]
    code = main(["plan", model, "--max-model-len", "64", "--device", "cpu", *fake_host(tmp_path / "again", 300 * 1024)])
    out = capsys.readouterr().out
    assert code == 1 and "DOES NOT FIT" in out and "no single flag change fits" in out


def test_plan_json_reports_a_refusal_as_json(tiny_model_dir, capsys) -> None:
    code = main(["plan", tiny_model_dir("llama"), "--max-model-len", "99999", "--json"])
    refusal = json.loads(capsys.readouterr().out)
    assert code == 2 and "99999" in refusal["error"]


def test_a_pool_of_num_gpu_blocks_override_is_named_and_resized_by_that_flag(tiny_model_dir, tmp_path, capsys) -> None:
    """The override sizes the pool whatever --kv-cache-memory says: the plan says so, and what would fit is a smaller
    override (it suggested --kv-cache-memory, which changes nothing beside it)."""
    model = tiny_model_dir("llama")
    host = fake_host(tmp_path, 2 * 1024 * 1024)
    code = main(["plan", model, "--max-model-len", "64", "--device", "cpu", "--num-gpu-blocks-override", "20", *host])
    assert code == 0 and "explicit (--num-gpu-blocks-override 20)" in capsys.readouterr().out
    code, data = plan_json(capsys, model, "--max-model-len", "64", "--num-gpu-blocks-override", "100000000", *host)
    assert code == 1 and [s["flag"] for s in data["suggestions"]][:1] == ["--num-gpu-blocks-override"]
    assert "--kv-cache-memory" not in [s["flag"] for s in data["suggestions"]]
    fitting = data["suggestions"][0]["value"]
    assert main(["plan", model, "--max-model-len", "64", "--device", "cpu", "--num-gpu-blocks-override", fitting,
                 *host]) == 0
    assert "FITS" in capsys.readouterr().out.upper()


def test_a_tensor_parallel_plan_gives_the_host_s_total(tiny_model_dir, tmp_path, capsys) -> None:
    """The table is one rank's; `plan -tp 2` said nothing of the whole (a QA sweep read 0.75 GiB for a server that
    held two such ranks)."""
    model = tiny_model_dir("llama")
    host = fake_host(tmp_path, 8 * 1024 * 1024)
    code, data = plan_json(capsys, model, "--max-model-len", "64", "-tp", "2", *host)
    assert code == 0 and data["settings"]["tensor_parallel_size"] == 2
    assert main(["plan", model, "--max-model-len", "64", "--device", "cpu", "-tp", "2", *host]) == 0
    last = capsys.readouterr().out.splitlines()[-1]
    assert last == (f"all 2 ranks: {2 * data['total_bytes'] / 2**30:.2f} GiB worst case, "
                    f"{2 * data['steady_bytes'] / 2**30:.2f} GiB steady (the plan above is each rank's)"), last


def test_plan_imports_no_torch_and_agrees_with_the_loaded_kernels(tiny_model_dir, tmp_path) -> None:
    """`pagedserve plan` (default flags: device, dtype and a GGUF's quantization auto) runs without importing
    torch or building the kernels, and on this host, where the kernels load, its plan is the one the engine
    computes after loading them (dtype and quantization from cpu_kernels())."""
    import subprocess
    import sys

    import pagedserve
    from pagedserve.memory import probe

    models = [tiny_model_dir("qwen2", "bfloat16"),  # tied embeddings: the packed head's copy depends on the kernels
              str(write_test_gguf(tiny_model("qwen2"), tmp_path / "q8.gguf", QType.Q8_0))]  # int8 by default
    for index, model in enumerate(models):
        host = fake_host(tmp_path / f"host{index}", available_kib=1 << 22)
        code = ("import json, sys\nfrom pagedserve.cli.main import main\n"
                f"code = main(['plan', {model!r}, '--device', 'cpu', '--json', *{host!r}])\n"
                "print(json.dumps({'code': code, 'torch': 'torch' in sys.modules,"
                " 'kernels': 'pagedserve.kernels' in sys.modules}))")
        run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                             cwd=Path(pagedserve.__file__).parents[1])
        assert run.returncode == 0, run.stderr
        plan_text, _, last = run.stdout.rstrip().rpartition("\n")
        assert json.loads(last) == {"code": 0, "torch": False, "kernels": False}
        data = json.loads(plan_text)
        available = probe.available_memory(host[1], host[3])  # the fake host, as `plan` reads it
        config = create_engine_config(EngineArgs(model=model, device="cpu"), available=available, check_memory=False)
        assert (data["settings"]["dtype"], data["request"]["quantization"]) == (config.model.dtype,
                                                                                config.model.quantization)
        assert {k: v for k, v in data.items() if k != "settings"} == config.memory_plan.to_dict()


def test_the_plans_weight_format_is_the_weight_formats(tiny_model_dir) -> None:
    """The plan's weight format (engine/memory_plan.py, from the CPU's flags, memory/weight_format.py's rule)
    is KernelBackend.choose's linear kind and native bf16 linears for every device, dtype, quantization and
    reference setting."""
    from dataclasses import replace

    from pagedserve import envs
    from pagedserve.engine.memory_plan import _weight_format
    from pagedserve.kernels import cpu_kernels
    from pagedserve.layers.backend import KernelBackend
    from pagedserve.memory import weight_format
    from pagedserve.memory.probe import cpu_flags

    expected_native = weight_format.native_kernels_expected(cpu_flags(), envs.cpu_kernels_enabled())
    if expected_native and cpu_kernels() is None:
        pytest.skip("the kernels failed to build here (the plan assumes they build)")
    assert expected_native == (cpu_kernels() is not None)
    model = engine_config(tiny_model_dir("llama")).model
    for device in ("cpu", "cuda"):
        for dtype in (torch.bfloat16, torch.float32, torch.float16):
            for quantization in (None, "int8"):
                for reference in (False, True):
                    backend = KernelBackend.choose(device, dtype, quantization, reference)
                    planned = _weight_format(replace(model, dtype=str(dtype).removeprefix("torch."),
                                                      quantization=quantization, reference_kernels=reference),
                                              device)
                    assert (backend.linear_kind, backend.native_bf16_linears) == (
                        planned.linear_kind, planned.native_bf16_linears), (device, dtype, quantization, reference)
    assert KernelBackend.choose("cpu", torch.bfloat16).native_bf16_linears == expected_native
    for choose in (lambda: KernelBackend.choose("cpu", torch.bfloat16, "int4"),
                   lambda: _weight_format(replace(model, quantization="int4"), "cpu")):
        with pytest.raises(ValueError, match="quantization 'int4' is not supported"):
            choose()


@pytest.mark.parametrize("kind", ["safetensors", "gguf"])
def test_engine_refuses_before_reading_any_weight(tiny_model_dir, tmp_path, monkeypatch, kind: str) -> None:
    from pagedserve.entrypoints.llm import LLM
    from pagedserve.formats.gguf_hf import GGUFFile
    from pagedserve.models import loader, safetensors_mmap

    def must_not_load(*args, **kwargs):
        raise AssertionError("weights were read although the plan does not fit")

    for module, name in ((loader, "iter_checkpoint"), (loader, "load_model"), (safetensors_mmap, "iter_safetensors"),
                         (GGUFFile, "stored"), (gguf_loader.GGUFCheckpoint, "iter_tensors")):
        monkeypatch.setattr(module, name, must_not_load)
    model = tiny_model_dir("llama")
    if kind == "gguf":
        model = write_test_gguf(tiny_model("llama"), tmp_path / "m.gguf")
    with pytest.raises(InsufficientMemoryError) as info:
        LLM(str(model), max_model_len=64, gpu_memory_utilization=0.0001)
    assert info.value.plan.shortfall_bytes > 0 and "short by" in str(info.value)


def engine_config(model: str, available_bytes: int = 8 * GIB, **kwargs):
    available = AvailableMemory(available_bytes, "MemAvailable", "test")
    return create_engine_config(EngineArgs(model=model, dtype="float32", device="cpu", **kwargs), available=available)


def test_kv_pool_is_sized_by_the_plan(tiny_model_dir) -> None:
    model = tiny_model_dir("llama", max_position_embeddings=8192)  # room for the long case below
    capped = engine_config(model, max_model_len=64, max_num_seqs=4)
    assert (capped.memory_plan.kv_rule, capped.memory_plan.kv_sizing) == ("shared-box", "workload")
    assert capped.cache.num_blocks == 4 * 4 + 1
    # A budget that leaves room for 20 blocks beyond weights, activations and overhead (64 sequences could
    # use 256 blocks): the pool takes the room, each block paying for its bookkeeping too.
    plan = engine_config(model, max_model_len=64, max_num_seqs=64).memory_plan
    fixed = plan.weight_bytes + plan.activation_bytes + plan.overhead_bytes
    room = 20 * (plan.block_bytes + HOST_BYTES_PER_KV_BLOCK) + 100
    roomy = engine_config(model, available_bytes=int((fixed + room) / 0.9) + 2, max_model_len=64,
                          max_num_seqs=64)
    assert (roomy.memory_plan.kv_rule, roomy.memory_plan.kv_sizing) == ("shared-box", "budget")
    assert roomy.cache.num_blocks == 20 + 1
    # On a CPU the shared-box default holds at most 25 % of the available memory (1.5 GiB here: 384 MiB of
    # blocks with their bookkeeping, less than 256 x 8192 tokens would need, 1.06 GiB); --gpu-memory-utilization
    # given means vLLM's rule: what the budget leaves.
    long = dict(available_bytes=3 * GIB // 2, max_model_len=8192, max_num_seqs=256)
    shared = engine_config(model, **long)
    per_block = plan.block_bytes + HOST_BYTES_PER_KV_BLOCK
    assert (shared.memory_plan.kv_sizing, shared.cache.num_blocks) == ("share", 3 * GIB // 8 // per_block + 1)
    given = engine_config(model, gpu_memory_utilization=0.9, **long).memory_plan
    fixed = given.weight_bytes + given.activation_bytes + given.overhead_bytes
    assert (given.kv_rule, given.kv_sizing) == ("utilization", "budget")
    budget_blocks = (int(0.9 * 3 * GIB // 2) - fixed) // per_block
    assert given.num_kv_blocks == budget_blocks > shared.memory_plan.num_kv_blocks
    # --kv-cache-memory (or VLLM_CPU_KVCACHE_SPACE) asks for bytes: whole blocks of it.
    explicit = engine_config(model, max_model_len=64, kv_cache_memory=10 * plan.block_bytes + 5)
    assert explicit.memory_plan.kv_rule == "explicit" and explicit.cache.num_blocks == 10 + 1
    # The test override wins, even below one full sequence.
    override = engine_config(model, max_model_len=64, num_gpu_blocks_override=3)
    assert override.cache.num_blocks == 3 and override.memory_plan.fits
    # Never below one max_model_len sequence: refuse rather than start a server that cannot serve one.
    with pytest.raises(InsufficientMemoryError, match="fewer than one max_model_len=64 sequence"):
        engine_config(model, max_model_len=64, kv_cache_memory=2 * plan.block_bytes)
    # Never more than the box has: a pool that does not fit the budget is refused, not swapped.
    with pytest.raises(InsufficientMemoryError, match="short by"):
        engine_config(model, max_model_len=64, kv_cache_memory=16 * GIB)


def test_max_model_len_past_the_trained_context_is_refused_unless_allowed(tiny_model_dir, monkeypatch,
                                                                          caplog) -> None:
    """As vLLM: a --max-model-len past max_position_embeddings (512 here) is refused, naming the limit and the
    variable that allows it; with the variable set it is taken, with a warning. A rope scaling factor raises the
    limit as vLLM derives it."""
    model = tiny_model_dir("llama")
    monkeypatch.delenv("PAGEDSERVE_ALLOW_LONG_MAX_MODEL_LEN", raising=False)
    monkeypatch.delenv("VLLM_ALLOW_LONG_MAX_MODEL_LEN", raising=False)
    assert engine_config(model, max_model_len=512).model.max_model_len == 512
    with pytest.raises(ValueError, match="more than the 512 positions .* --max-model-len 512 or less, or set "
                                         "PAGEDSERVE_ALLOW_LONG_MAX_MODEL_LEN=1"):
        engine_config(model, max_model_len=513)
    for name in ("PAGEDSERVE_ALLOW_LONG_MAX_MODEL_LEN", "VLLM_ALLOW_LONG_MAX_MODEL_LEN"):
        monkeypatch.setenv(name, "1")
        assert engine_config(model, max_model_len=1024).model.max_model_len == 1024
        assert "more than the 512 positions" in caplog.text
        monkeypatch.delenv(name)
    from pagedserve.engine.setup import trained_context_length

    class Config:
        max_position_embeddings = 32768
        rope_scaling = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
    assert trained_context_length(Config()) == 131072
    Config.rope_scaling = {"rope_type": "llama3", "factor": 8.0}  # already in max_position_embeddings
    assert trained_context_length(Config()) == 32768


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_plain_config_reads_like_transformers(tiny_model_dir, tmp_path, arch: str) -> None:
    from transformers import AutoConfig

    from pagedserve.layers.rotary import rope_parameters
    from pagedserve.models.llama import head_dim_of

    def seen_by_the_model(cfg) -> dict:
        names = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                 "num_key_value_heads", "rms_norm_eps", "hidden_act", "tie_word_embeddings",
                 "max_position_embeddings", "architectures")
        values = {name: getattr(cfg, name, None) for name in names}
        values["attention_bias"] = bool(getattr(cfg, "attention_bias", False))
        return {**values, "head_dim": head_dim_of(cfg), "rope": rope_parameters(cfg)}

    for path in (tiny_model_dir(arch), write_test_gguf(tiny_model(arch), tmp_path / f"{arch}.gguf")):
        info = read_checkpoint_info(path)
        plain = hf_config_from_checkpoint(info)
        assert type(plain).__name__ == "PlainDecoderConfig"  # the fast path was taken
        if info.is_gguf:
            config = dict(info.config)
            full = AutoConfig.for_model(config.pop("model_type"), **config)
        else:
            full = AutoConfig.from_pretrained(path)
        assert seen_by_the_model(plain) == seen_by_the_model(full)
    # The defaults filled in for keys a config.json may omit are transformers' own.
    defaults = AutoConfig.for_model(arch)
    for key, value in PLAIN_CONFIG_DEFAULTS.items():
        assert getattr(defaults, key, False) == value, key


def test_rope_scaling_and_other_models_use_transformers_configs(tmp_path) -> None:
    path = write_test_gguf(tiny_model("llama", rope_scaling={"rope_type": "linear", "factor": 2.0}),
                           tmp_path / "linear.gguf")
    assert type(hf_config_from_checkpoint(read_checkpoint_info(path))).__name__ == "LlamaConfig"


# Where each format keeps its fp16 scales (d, and m or dmin), in bytes from the block's start.
FP16_FIELDS = {QType.Q8_0: (0,), QType.Q4_0: (0,), QType.Q5_0: (0,), QType.Q4_1: (0, 2), QType.Q5_1: (0, 2),
               QType.Q4_K: (0, 2), QType.Q5_K: (0, 2), QType.Q6_K: (208,)}


@pytest.mark.parametrize("qtype", list(FP16_FIELDS), ids=lambda q: q.name)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_torch_dequantization_equals_gguf_py(qtype: QType, dtype: torch.dtype, monkeypatch) -> None:
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(int(qtype))
    rows, blocks_per_row = 37, 3
    blocks = rng.integers(0, 256, size=(rows, blocks_per_row, type_size), dtype=np.uint8)
    # Finite fp16 scales of every sign and magnitude, subnormals included (random bytes could be NaN).
    for offset in FP16_FIELDS[qtype]:
        scales = rng.standard_normal((rows, blocks_per_row)) * 10.0 ** rng.integers(-7, 3, (rows, blocks_per_row))
        blocks[..., offset:offset + 2] = scales.astype(np.float16)[..., None].view(np.uint8)
    stored = blocks.reshape(rows, blocks_per_row * type_size)
    monkeypatch.setattr(gguf_dequant, "_DEQUANT_CHUNK_VALUES", 16 * 32)  # several chunks and a partial one
    got = gguf_dequant.dequantize_to_torch(stored, qtype, dtype)
    expected = torch.from_numpy(dequantize(stored, qtype)).to(dtype)
    assert got.shape == (rows, blocks_per_row * block_size) and got.dtype == dtype
    assert torch.equal(got, expected)


def test_gguf_header_is_parsed_once_per_start(tmp_path, monkeypatch) -> None:
    from pagedserve.entrypoints.llm import LLM

    path = write_test_gguf(tiny_model("llama"), tmp_path / "q.gguf", QType.Q8_0)
    parsed: list[Path] = []
    real = gguf_format.read_gguf_header

    def counting(path, **kwargs):
        parsed.append(Path(path))
        return real(path, **kwargs)

    monkeypatch.setattr(gguf_format, "read_gguf_header", counting)
    llm = LLM(str(path), dtype="float32", max_model_len=64)
    assert parsed == [path]  # config + plan, tokenizer and weights share one parse
    assert not gguf_format._header_cache  # and it is dropped once the weights are in
    assert llm.engine.config.memory_plan.weight_bytes == sum(p.numel() * 4 for p in tiny_model("llama").parameters())


def test_gguf_tokenizer_without_the_deep_copy_equals_the_documented_one(tmp_path) -> None:
    from transformers import PreTrainedTokenizerFast

    from tests.models.real_models import packaged_model

    path = packaged_model("smollm2-135m-instruct")
    metadata = gguf_format.read_gguf_header(path).metadata
    fast = gguf_tokenizer.build_tokenizer_from_metadata(metadata).to_transformers()  # transformers', no copy
    backend = gguf_tokenizer._backend_tokenizer(metadata, "test")
    kwargs = {"clean_up_tokenization_spaces": False, "model_max_length": fast.model_max_length,
              "bos_token": fast.bos_token, "eos_token": fast.eos_token, "unk_token": fast.unk_token,
              "pad_token": fast.pad_token}
    reference = PreTrainedTokenizerFast(tokenizer_object=backend, **kwargs)
    assert type(fast) is PreTrainedTokenizerFast and fast.backend_tokenizer is not backend
    assert len(fast) == len(reference) and fast.added_tokens_decoder == reference.added_tokens_decoder
    assert fast.all_special_ids == reference.all_special_ids and fast.eos_token_id == reference.eos_token_id
    for text in ["Hello world! 12345 你好 😀\n\n  spaces", "<|im_start|>user\nWhat is 2+2?<|im_end|>\n"]:
        assert fast.encode(text) == reference.encode(text)
        assert fast.decode(fast.encode(text)) == reference.decode(reference.encode(text))
    fast.save_pretrained(tmp_path)  # still a complete, serializable transformers tokenizer
    assert PreTrainedTokenizerFast.from_pretrained(tmp_path).encode("Hello world") == reference.encode("Hello world")


def test_plan_takes_a_serve_command_line_unchanged(tiny_model_dir, tmp_path, capsys) -> None:
    model = tiny_model_dir("llama")
    host = fake_host(tmp_path, 1 << 22)
    _, plain = plan_json(capsys, model, "--max-model-len", "64", *host)
    code, pasted = plan_json(capsys, model, "--max-model-len", "64", "--port", "8001", "--api-key", "k",
                             "--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--trust-remote-code",
                             "--swap-space", "4", *host)
    assert code == 0 and pasted == plain  # the server's own flags change no figure
    assert main(["plan", model, "-pp", "2", *host]) == 2  # what serve refuses, plan refuses
    assert "--pipeline-parallel-size 2: pipeline parallelism is not supported" in capsys.readouterr().err


@pytest.mark.parametrize("value", ["auto", "-1"])
def test_max_model_len_auto_is_the_longest_sequence_the_memory_holds(tiny_model_dir, tmp_path, capsys,
                                                                    value) -> None:
    """vLLM's --max-model-len auto (or -1): the model's context where one sequence of it fits, else the longest
    that fits (the refusal's own --max-model-len suggestion), where the model's context alone is refused."""
    model = tiny_model_dir("llama", max_position_embeddings=1 << 21)
    host = fake_host(tmp_path / "small", 1024 * 1024)  # 1 GiB: less than one 2M-token sequence's K/V
    code, refused = plan_json(capsys, model, "--max-num-seqs", "1", *host)
    suggested = next(int(s["value"]) for s in refused["suggestions"] if s["flag"] == "--max-model-len")
    assert code == 1 and suggested < 1 << 21
    code, auto = plan_json(capsys, model, "--max-num-seqs", "1", "--max-model-len", value, *host)
    assert code == 0 and auto["fits"] and auto["request"]["max_model_len"] == suggested
    code, roomy = plan_json(capsys, model, "--max-num-seqs", "1", "--max-model-len", value,
                            *fake_host(tmp_path / "large", 16 * 1024 * 1024))
    assert code == 0 and roomy["request"]["max_model_len"] == 1 << 21
    args = EngineArgs(model=model, max_num_seqs=1, max_model_len="auto", device="cpu")
    for asked in ("auto", AUTO_SIZE):  # serve, doctor and run-batch check the flags first: they refused -1
        check_engine_args(EngineArgs(model=model, max_model_len=asked))
    config = create_engine_config(args, available=AvailableMemory(1 << 30, "MemAvailable", "a test"))
    assert config.model.max_model_len == config.scheduler.max_model_len == suggested
    # a pool asked for by its blocks: what they hold (4 of 16 tokens besides the null block), though it "fits"
    code, small = plan_json(capsys, model, "--max-model-len", value, "--num-gpu-blocks-override", "5", *host)
    assert code == 0 and small["request"]["max_model_len"] == 64


def test_an_asked_pool_smaller_than_one_sequence_is_said(tiny_model_dir, caplog) -> None:
    """vLLM refuses to start when the KV cache holds less than one max_model_len sequence; an asked pool (testing)
    starts, and the log says what a longer request gets and what --max-model-len fits (a QA sweep: `plan` said
    "fits" without a word)."""
    args = EngineArgs(model=tiny_model_dir("llama"), max_model_len=128, num_gpu_blocks_override=3, device="cpu")
    with caplog.at_level("WARNING", logger="pagedserve.engine.memory_plan"):
        create_engine_config(args, available=AvailableMemory(1 << 30, "MemAvailable", "a test"))
    assert "holds 32 tokens, fewer than one 128-token sequence" in caplog.text
    assert "--max-model-len 32 or less fits it" in caplog.text
