"""The workloads (W1 single stream, W2 batch, W3 start-up), the systems measured, and the prompts."""

from __future__ import annotations

import json
import random
import zlib
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Workload:
    name: str
    num_prompts: int
    input_len: int
    output_len: int
    description: str


FULL_WORKLOADS = (Workload("W1", 1, 32, 128, "single stream: 1 x 32-token prompt -> 128 new tokens"),
                  Workload("W2", 32, 128, 64, "batch: 32 x 128-token prompts -> 64 new tokens each"))
QUICK_WORKLOADS = (Workload("W1", 1, 8, 16, "single stream: 1 x 8-token prompt -> 16 new tokens"),
                   Workload("W2", 4, 16, 8, "batch: 4 x 16-token prompts -> 8 new tokens each"))
W3_PROMPT_LEN = 32

SYSTEMS = {
    "pagedserve": "pagedserve LLM.generate (in-process)",
    "hf-generate": "transformers generate()",
    "hf-cb": "transformers generate_batch() (continuous batching)",
    "pagedserve-serve": "pagedserve serve (HTTP, first streamed token)",
    "pagedserve-int8": "pagedserve LLM.generate with --quantization int8 (W1 only)",
}


def prompt_pool(model_dir: str) -> list[int]:
    """Ordinary token ids: the tokenizer's base vocabulary (below the model's vocab and 150000), minus
    special and added tokens; the same pool for every system."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    vocab_size = json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"]
    excluded = set(tokenizer.all_special_ids) | set(tokenizer.get_added_vocab().values())
    limit = min(vocab_size, len(tokenizer), 150000)
    pool = [token_id for token_id in range(limit) if token_id not in excluded]
    if vocab_size >= 100000:
        pool = [token_id for token_id in pool if token_id >= 1000]  # as in the vLLM peer's prompts
    return pool


def prompt_rng(seed: int, label: str, repeat: int) -> random.Random:
    """A generator that depends only on its arguments (str hashes differ between processes; crc32 does not)."""
    return random.Random(zlib.crc32(f"{seed}/{label}/{repeat}".encode()))


def make_prompts(pool: list[int], workload: Workload, rng: random.Random) -> list[list[int]]:
    return [rng.choices(pool, k=workload.input_len) for _ in range(workload.num_prompts)]
