"""The models measured: a random-weight model of Qwen2.5-0.5B's shape, and the real Qwen2.5-Coder GGUF as bf16."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

QWEN_GGUF_NAME = "qwen2.5-coder-0.5b-instruct"

# Qwen2.5-0.5B-Instruct's config.json, architecture fields only.
QWEN05_SHAPE = dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                    num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768,
                    rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True, bos_token_id=151643,
                    eos_token_id=151645, sliding_window=None, use_sliding_window=False)
TINY_SHAPE = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=4096, rope_theta=10000.0, rms_norm_eps=1e-6,
                  tie_word_embeddings=True, bos_token_id=None, eos_token_id=2)


def default_gguf_path() -> Path:
    from pagedserve import envs

    return envs.cache_dir() / QWEN_GGUF_NAME / f"{QWEN_GGUF_NAME}.gguf"


def _is_built(out: Path, stamp: dict[str, Any]) -> bool:
    marker = out / ".compare-complete"
    return marker.is_file() and json.loads(marker.read_text()) == stamp


def _mark_built(out: Path, stamp: dict[str, Any]) -> None:
    (out / ".compare-complete").write_text(json.dumps(stamp))


def make_portable(out: Path) -> None:
    """Let older transformers (the peers' venvs) read the directory as this one does: a top-level rope_theta
    next to transformers 5's rope_parameters, and a tokenizer class that every version knows."""
    config_path, tokenizer_path = out / "config.json", out / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    rope = config.get("rope_parameters") or {}
    if "rope_theta" not in config and "rope_theta" in rope:
        config["rope_theta"] = rope["rope_theta"]
        config_path.write_text(json.dumps(config, indent=2) + "\n")
    if tokenizer_path.is_file():
        tokenizer_config = json.loads(tokenizer_path.read_text())
        if tokenizer_config.get("tokenizer_class") == "TokenizersBackend":
            tokenizer_config["tokenizer_class"] = "PreTrainedTokenizerFast"
            tokenizer_path.write_text(json.dumps(tokenizer_config, indent=2) + "\n")


def save_tokenizer(out: Path, vocab_size: int, gguf: Path | None) -> str:
    """The Qwen GGUF's tokenizer when available and the vocab matches, else a small byte-level BPE."""
    if gguf is not None and gguf.is_file() and vocab_size == QWEN05_SHAPE["vocab_size"]:
        from pagedserve.models.gguf_loader import GGUFCheckpoint

        with GGUFCheckpoint(gguf) as checkpoint:
            checkpoint.build_tokenizer().save_pretrained(str(out))
        return f"Qwen2.5 tokenizer from {gguf.name}"
    from tests.tiny_models import make_tokenizer

    make_tokenizer(out)
    return "tiny byte-level BPE (512 ids; prompts are token ids, so the model's vocab is still used)"


def build_random_model(name: str, shape: dict[str, Any], out: Path, gguf: Path | None, seed: int = 0) -> dict[str, Any]:
    """A Qwen2ForCausalLM with `shape`, random weights (seeded), saved in bf16; reused when already built."""
    stamp = {"shape": shape, "seed": seed, "gguf": str(gguf) if gguf and gguf.is_file() else None}
    info = {"name": name, "path": str(out), "kind": "random"}
    if _is_built(out, stamp):
        make_portable(out)
        return {**info, **json.loads((out / ".compare-info").read_text())}
    import torch
    import transformers

    out.mkdir(parents=True, exist_ok=True)
    config = transformers.Qwen2Config(**shape)
    torch.manual_seed(seed)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        model = transformers.Qwen2ForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)
    model = model.to(torch.bfloat16)
    num_params = sum(p.numel() for p in model.parameters())
    model.save_pretrained(out)
    del model
    tokenizer = save_tokenizer(out, shape["vocab_size"], gguf)
    details = {"num_params": num_params, "tokenizer": tokenizer,
               "description": f"Qwen2 shape {shape['num_hidden_layers']} layers x {shape['hidden_size']}, "
                              f"random weights (seed {seed}), bf16"}
    (out / ".compare-info").write_text(json.dumps(details))
    make_portable(out)
    _mark_built(out, stamp)
    return {**info, **details}


def build_real_model(gguf: Path, out: Path) -> dict[str, Any]:
    """The packaged Qwen2.5-Coder-0.5B-Instruct GGUF, dequantized once into a bf16 Hugging Face directory."""
    from collections import Counter

    from pagedserve.models.gguf_loader import GGUFCheckpoint

    stamp = {"gguf": str(gguf), "size": gguf.stat().st_size}
    with GGUFCheckpoint(gguf) as checkpoint:
        specs = checkpoint.tensor_specs()
    qtypes = Counter(spec.qtype.name for spec in specs)
    if not _is_built(out, stamp):
        import torch

        from benchmarks.gguf_to_hf import save_as_hf_dir

        save_as_hf_dir(gguf, out, dtype=torch.bfloat16)
        _mark_built(out, stamp)
    make_portable(out)
    stored = ", ".join(f"{count} {name}" for name, count in qtypes.most_common())
    return {"name": "qwen2.5-coder-0.5b-instruct", "path": str(out), "kind": "real",
            "num_params": sum(spec.num_elements for spec in specs),
            "tokenizer": "Qwen2.5 tokenizer from the GGUF",
            "description": f"real weights: {gguf.name} (tensors stored as {stored}; untied output matrix) "
                           "dequantized to bf16"}
