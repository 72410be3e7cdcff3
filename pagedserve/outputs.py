"""What callers of the engine receive: RequestOutput with one CompletionOutput per sample."""

from __future__ import annotations

from dataclasses import dataclass

# One position's logprobs: token id -> Logprob. The sampled (or prompt) token is always present, and first.
LogprobsDict = dict[int, "Logprob"]


@dataclass
class Logprob:
    logprob: float
    rank: int  # 1 = most likely
    decoded_token: str | None = None


@dataclass
class RequestMetrics:
    """Per-request timings in time.monotonic() seconds, and the parameters /metrics reports (vLLM's
    request_params_* histograms: the observer sees outputs, not the request)."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    n: int = 1
    max_tokens: int | None = None  # the engine's: the request's, or the room its prompt left in max_model_len


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[LogprobsDict] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | None while running
    stop_reason: int | str | None = None  # the stop string or stop token that ended it

    def finished(self) -> bool:
        """vLLM's: a method (RequestOutput.finished is the attribute)."""
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    prompt_logprobs: list[LogprobsDict | None] | None = None
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None
    # vLLM's fields for what pagedserve does not serve (encoder-decoder models, LoRA, disaggregated prefill): None,
    # as vLLM's are for a decoder-only model without them, so scripts that read them run unchanged
    encoder_prompt: str | None = None
    encoder_prompt_token_ids: list[int] | None = None
    lora_request: None = None
    kv_transfer_params: None = None


@dataclass
class EmbeddingOutput:
    """The vector of one embedding request (vLLM's name and field)."""

    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)

    @property
    def data(self):
        """The vector as a float32 torch tensor (vLLM's PoolingOutput.data, what LLM.encode users read)."""
        import torch

        return torch.tensor(self.embedding, dtype=torch.float32)


@dataclass
class PoolingRequestOutput:
    """An embedding request's result, shaped like vLLM's: `output.outputs.embedding` is the vector."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput
    finished: bool = True
    metrics: RequestMetrics | None = None


EmbeddingRequestOutput = PoolingRequestOutput  # vLLM's name for the same thing


def __getattr__(name: str):
    if name in ("ScoringRequestOutput", "ScoringOutput"):  # vLLM has them here; they live with the scoring rule
        import pagedserve.scoring

        return getattr(pagedserve.scoring, name)
    raise AttributeError(name)
