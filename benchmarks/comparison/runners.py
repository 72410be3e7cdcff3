"""What a worker process runs: pagedserve's LLM.generate, or transformers' generate / generate_batch."""

from __future__ import annotations

import time
from typing import Any


class PagedserveRunner:
    def __init__(self, model: str, threads: int, max_model_len: int, quantization: str | None = None) -> None:
        from pagedserve import LLM

        self.llm = LLM(model, dtype="bfloat16", max_model_len=max_model_len, num_threads=threads, seed=0,
                       quantization=quantization)

    def run(self, prompts: list[list[int]], output_len: int, mode: str) -> dict[str, Any]:
        from pagedserve.benchmarks.throughput import ThroughputBenchConfig, time_generate

        run = time_generate(self.llm, prompts, [output_len] * len(prompts), ThroughputBenchConfig())
        return {"elapsed_s": run.elapsed_s, "num_requests": run.num_requests,
                "num_prompt_tokens": run.num_prompt_tokens, "num_output_tokens": run.num_output_tokens,
                "num_early_stops": run.num_early_stops, "num_cached_prompt_tokens": run.num_cached_prompt_tokens}


class HFRunner:
    def __init__(self, model: str, threads: int, max_model_len: int) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        torch.set_num_threads(threads)
        self.torch = torch
        self.model = AutoModelForCausalLM.from_pretrained(model, dtype=torch.bfloat16).eval()
        self.model.generation_config.eos_token_id = None  # EOS ignored: exactly max_new_tokens
        self.pad_id = 0
        self.max_model_len = max_model_len

    def run(self, prompts: list[list[int]], output_len: int, mode: str) -> dict[str, Any]:
        if mode == "hf-cb":
            return self._run_cb(prompts, output_len)
        from transformers import GenerationConfig

        config = GenerationConfig(max_new_tokens=output_len, min_new_tokens=output_len, do_sample=False,
                                  eos_token_id=None, pad_token_id=self.pad_id)
        input_ids = self.torch.tensor(prompts)  # equal lengths: no padding
        start = time.perf_counter()
        with self.torch.inference_mode():
            output = self.model.generate(input_ids, attention_mask=self.torch.ones_like(input_ids),
                                         generation_config=config)
        elapsed = time.perf_counter() - start
        generated = output[:, input_ids.shape[1]:]
        return {"elapsed_s": elapsed, "num_requests": len(prompts), "num_prompt_tokens": int(input_ids.numel()),
                "num_output_tokens": int(generated.numel()),
                "num_early_stops": sum(1 for row in generated if row.numel() < output_len)}

    def _run_cb(self, prompts: list[list[int]], output_len: int) -> dict[str, Any]:
        from transformers import GenerationConfig
        from transformers.generation.configuration_utils import ContinuousBatchingConfig

        config = GenerationConfig(max_new_tokens=output_len, do_sample=False, eos_token_id=None,
                                  pad_token_id=self.pad_id)
        # Sized explicitly: on CPU the automatic sizing (meant for GPU memory) takes 10-20 s per call.
        tokens = max(len(p) for p in prompts) + output_len
        cb_config = ContinuousBatchingConfig(num_blocks=len(prompts) * (-(-tokens // 256)) + 4,
                                             max_batch_tokens=2048)
        start = time.perf_counter()
        results = self.model.generate_batch(prompts, generation_config=config, continuous_batching_config=cb_config)
        elapsed = time.perf_counter() - start
        outputs = list(results.values())
        failed = [o for o in outputs if getattr(o, "error", None)]
        if len(outputs) != len(prompts) or failed:
            raise RuntimeError(f"generate_batch returned {len(outputs)} results for {len(prompts)} prompts, "
                               f"{len(failed)} with errors: {failed[0].error if failed else ''}")
        counts = [len(o.generated_tokens) for o in outputs]
        return {"elapsed_s": elapsed, "num_requests": len(prompts),
                "num_prompt_tokens": sum(len(o.prompt_ids) for o in outputs), "num_output_tokens": sum(counts),
                "num_early_stops": sum(1 for c in counts if c < output_len)}
