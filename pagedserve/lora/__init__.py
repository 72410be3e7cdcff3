"""vLLM's `vllm.lora` package, so that code importing LoRARequest runs up to the clear refusal."""
