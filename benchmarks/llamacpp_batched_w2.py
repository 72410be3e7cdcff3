"""llama.cpp's W2 with its sequences batched: 32 prompts of 128 random tokens, 64 greedy tokens each,
every sequence in the same llama_decode call at each step (what llama-batched-bench and llama-server's
parallel slots do), through llama-cpp-python's low-level API. The peer script in ../shared/peers runs W2
one request at a time; this is the fair batched counterpart for the "W2 >= 1.3x llama.cpp" target.

Run with the peer's interpreter (../shared/peers/llama-cpp/run.sh installs it):

    /tmp/llama-cpp-peer/venv/bin/python benchmarks/llamacpp_batched_w2.py MODEL.gguf [--repeats 2]

Prints `RESULT [{"out_tok_s", "total_tok_s", "prefill_s", "decode_tok_s"}, ...]` (one per timed repeat,
after one warm-up run). Rates count output tokens over the whole call, prefill included, as compare.py
does for pagedserve; decode_tok_s is the rate after the prefill (llama-batched-bench's S_TG).
"""

from __future__ import annotations

import argparse
import json
import random
import time

import llama_cpp as L
import numpy as np

SEQUENCES, PROMPT_LEN, OUTPUT_LEN, BATCH = 32, 128, 64, 512


class BatchedRunner:
    def __init__(self, path: str, threads: int) -> None:
        L.llama_backend_init()
        self.model = L.llama_model_load_from_file(path.encode(), L.llama_model_default_params())
        if not self.model:
            raise SystemExit(f"could not load {path}")
        self.vocab_size = L.llama_vocab_n_tokens(L.llama_model_get_vocab(self.model))
        params = L.llama_context_default_params()
        params.n_ctx = SEQUENCES * (PROMPT_LEN + OUTPUT_LEN)
        params.n_batch = params.n_ubatch = BATCH
        params.n_seq_max = SEQUENCES
        params.n_threads = params.n_threads_batch = threads
        params.kv_unified = True  # one KV buffer shared by the sequences, as llama-server's slots
        self.ctx = L.llama_init_from_model(self.model, params)
        self.batch = L.llama_batch_init(BATCH, 0, 1)

    def _decode(self, entries: list[tuple[int, int, int, bool]]) -> list[int]:
        """entries: (token, position, sequence, wants logits) -> greedy next token of each that wants them."""
        batch = self.batch
        batch.n_tokens = len(entries)
        for i, (token, position, sequence, wants) in enumerate(entries):
            batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = token, position, 1, wants
            batch.seq_id[i][0] = sequence
        if L.llama_decode(self.ctx, batch) != 0:
            raise RuntimeError("llama_decode failed")
        return [int(np.ctypeslib.as_array(L.llama_get_logits_ith(self.ctx, i), shape=(self.vocab_size,)).argmax())
                for i, entry in enumerate(entries) if entry[3]]

    def run(self, seed: int) -> dict[str, float]:
        rng = random.Random(seed)
        prompts = [[rng.randint(100, 30000) for _ in range(PROMPT_LEN)] for _ in range(SEQUENCES)]
        L.llama_memory_clear(L.llama_get_memory(self.ctx), True)
        start = time.perf_counter()
        entries = [(token, position, sequence, position == PROMPT_LEN - 1)
                   for sequence, prompt in enumerate(prompts) for position, token in enumerate(prompt)]
        last: list[int] = []
        for offset in range(0, len(entries), BATCH):  # the prompts, BATCH tokens per call
            last += self._decode(entries[offset:offset + BATCH])
        prefill_s = time.perf_counter() - start
        for step in range(OUTPUT_LEN - 1):  # every sequence's next token in one call
            last = self._decode([(last[s], PROMPT_LEN + step, s, True) for s in range(SEQUENCES)])
        total_s = time.perf_counter() - start
        output = SEQUENCES * OUTPUT_LEN
        return {"out_tok_s": output / total_s, "total_tok_s": (output + SEQUENCES * PROMPT_LEN) / total_s,
                "prefill_s": prefill_s, "decode_tok_s": (output - SEQUENCES) / (total_s - prefill_s)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("gguf")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    runner = BatchedRunner(args.gguf, args.threads)
    runner.run(seed=0)  # warm-up
    print("RESULT " + json.dumps([runner.run(seed=r + 1) for r in range(args.repeats)]), flush=True)


if __name__ == "__main__":
    main()
