"""Runners for the embed task. Same protocol as ModelRunner: execute(SchedulerOutput) -> ModelRunnerOutput,
with `pooled` (request_id -> vector) filled for every request whose prompt finished this step.

- DecoderPoolingRunner: Llama/Qwen as embedders. The prompt runs through the paged KV cache exactly as
  a prefill does (causal attention, chunked prefill allowed: the pooler merges chunks), then the final
  hidden states are pooled instead of sampled. The scheduler frees the blocks when the request ends.
- EncoderRunner: BERT. Bidirectional attention needs the whole prompt at once, so the engine turns
  chunked prefill off for encoders and sizes the step budget to hold the longest prompt; there is
  no KV cache (the scheduler's blocks are bookkeeping only).
"""

from __future__ import annotations

import torch

from pagedserve.config import EngineConfig
from pagedserve.core.sched_output import ModelRunnerOutput, SchedulerOutput
from pagedserve.layers.linear import warm_up_rows
from pagedserve.layers.pooler import ChunkSpan, Pooler
from pagedserve.models.bert import encoder_metadata
from pagedserve.models.loader import ProgressFn, load_model
from pagedserve.platform import torch_dtype
from pagedserve.worker.model_runner import ModelRunner


class DecoderPoolingRunner(ModelRunner):
    """A decoder loaded without its LM head (config.model.task == "embed"); pools instead of sampling."""

    def __init__(self, config: EngineConfig, hf_config, progress: ProgressFn | None = None) -> None:
        assert config.model.task == "embed" and config.model.pooler is not None
        super().__init__(config, hf_config, progress)
        self.pooler = Pooler(config.model.pooler)

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        self.pooler.drop(sched.finished_request_ids)
        self._update_states(sched)
        if sched.is_empty:
            return ModelRunnerOutput()
        batch = self._prepare(sched)
        hidden = self.model(batch.input_ids, batch.positions, self.kv_caches, batch.meta)  # [T, H]
        spans = [ChunkSpan(request_id, first, num, start, sched.needs_sample[request_id])
                 for request_id, (first, num, start) in batch.spans.items()]
        return ModelRunnerOutput(pooled=self.pooler(hidden, spans))


class EncoderRunner:
    """A bidirectional encoder (BertModel): each request's whole prompt in one step, no KV cache."""

    def __init__(self, config: EngineConfig, hf_config, progress: ProgressFn | None = None) -> None:
        assert config.model.pooler is not None and not config.scheduler.enable_chunked_prefill
        self.config = config
        self.device = config.device.device
        self.dtype = torch_dtype(config.model.dtype)
        self.model = load_model(hf_config, config.model.architecture, config.model.model, self.dtype, self.device,
                                config.model.max_model_len, progress, quantization=config.model.quantization,
                                reference_kernels=config.model.reference_kernels, task="embed")
        self.pooler = Pooler(config.model.pooler)

    def allocate_kv_cache(self) -> None:
        """Nothing to allocate: an encoder keeps no K/V between steps."""

    @property
    def kv_caches(self) -> list:
        """No KV pool: an encoder's attention reads only the step's own tokens."""
        return []

    def release_kv_pages(self, block_ids: list[int], block_size: int, window_block_ids: list[int] = ()) -> int:
        """No KV pool, so no pages to release."""
        return 0

    def check_health(self) -> None:
        """Nothing to check: the model runs in this process."""

    def warm_up_rows(self) -> int:
        return warm_up_rows(self.model)

    def kernel_report(self) -> list[str]:
        return []  # the encoder's layers run torch ops only

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        if sched.is_empty:
            return ModelRunnerOutput()
        num_computed = {new.request_id: new.num_computed_tokens for new in sched.new_requests}
        token_ids: list[int] = []
        positions: list[int] = []
        spans: list[ChunkSpan] = []
        # Shortest first, so that attention groups sequences of similar length (models/bert.py).
        for request_id, num in sorted(sched.num_scheduled_tokens.items(), key=lambda item: item[1]):
            if num_computed.get(request_id) != 0 or not sched.needs_sample[request_id]:
                raise RuntimeError(f"request {request_id}: an encoder needs the whole prompt in one step, "
                                   "but the scheduler split it (chunked prefill must be off for encoders)")
            spans.append(ChunkSpan(request_id, len(token_ids), num, 0, True))
            token_ids.extend(sched.scheduled_token_ids[request_id])
            positions.extend(range(num))
        meta = encoder_metadata([s.num for s in spans], self.device)
        input_ids = torch.tensor(token_ids, dtype=torch.int64, device=self.device)
        hidden = self.model(input_ids, torch.tensor(positions, dtype=torch.int64, device=self.device), meta)
        return ModelRunnerOutput(pooled=self.pooler(hidden, spans))


def make_pooling_runner(config: EngineConfig, hf_config, progress: ProgressFn | None = None
                        ) -> DecoderPoolingRunner | EncoderRunner:
    from pagedserve.models.pooling_config import is_encoder

    if is_encoder(config.model.architecture):
        return EncoderRunner(config, hf_config, progress)
    return DecoderPoolingRunner(config, hf_config, progress)
