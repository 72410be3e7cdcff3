"""Export a GGUF file as a Hugging Face model directory (config.json, model.safetensors, tokenizer files),
dequantized through pagedserve's own GGUF loader.

Not part of the server: peers that read only Hugging Face directories get the same weights from it
(compare.py), and the tests compare pagedserve with transformers on them.

    python benchmarks/gguf_to_hf.py MODEL.gguf OUT_DIR [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))  # pagedserve from this checkout

from pagedserve.models.gguf_loader import GGUFCheckpoint  # noqa: E402


# Names the loader gives a model's tensors that transformers reads only under the original checkpoint's names: its
# conversion of per-expert matrices into fused ones knows Mixtral by block_sparse_moe.experts.N.w1/w3/w2 (gate, up,
# down), not by the Qwen-MoE names the loader uses for every mixture of experts.
HF_NAMES = {"mixtral": ((re.compile(r"\.mlp\.experts\.(\d+)\.gate_proj\."), r".block_sparse_moe.experts.\1.w1."),
                        (re.compile(r"\.mlp\.experts\.(\d+)\.up_proj\."), r".block_sparse_moe.experts.\1.w3."),
                        (re.compile(r"\.mlp\.experts\.(\d+)\.down_proj\."), r".block_sparse_moe.experts.\1.w2."),
                        (re.compile(r"\.mlp\.gate\."), ".block_sparse_moe.gate."))}


def hf_name(model_type: str, name: str) -> str:
    """The name transformers loads the loader's tensor `name` by, for a model of `model_type`."""
    for pattern, replacement in HF_NAMES.get(model_type, ()):
        name = pattern.sub(replacement, name)
    return name


def save_as_hf_dir(gguf_path: str | Path, out_dir: str | Path, dtype: torch.dtype = torch.float32) -> Path:
    """Write config.json, model.safetensors (dequantized to `dtype`) and tokenizer files to `out_dir`.

    The result loads with transformers' AutoModelForCausalLM / AutoTokenizer.from_pretrained(out_dir).
    """
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    with GGUFCheckpoint(gguf_path) as checkpoint:
        config = checkpoint.hf_config()
        config["torch_dtype"] = str(dtype).removeprefix("torch.")
        state_dict = {hf_name(config["model_type"], name): tensor for name, tensor in checkpoint.iter_tensors(dtype)}
        tokenizer = checkpoint.build_tokenizer()
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    save_file(state_dict, str(out / "model.safetensors"), metadata={"format": "pt"})
    tokenizer.save_pretrained(str(out))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("gguf", type=Path)
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    args = parser.parse_args()
    print(save_as_hf_dir(args.gguf, args.out_dir, getattr(torch, args.dtype)))


if __name__ == "__main__":
    main()
