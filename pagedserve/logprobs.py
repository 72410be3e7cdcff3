"""vLLM's `vllm.logprobs` import path for the logprob types (they live in pagedserve/outputs.py)."""

from __future__ import annotations

from pagedserve.outputs import Logprob, LogprobsDict

PromptLogprobs = list[LogprobsDict | None]  # vLLM's names for a prompt's and a sample's logprobs
SampleLogprobs = list[LogprobsDict]

__all__ = ["Logprob", "PromptLogprobs", "SampleLogprobs"]
