"""What the engine needs of a model runner; worker/model_runner.py (generation) and worker/pooling_runner.py
(embeddings) implement it. The engine calls nothing else, so a runner for another device or a sharded model
only has to provide these."""

from __future__ import annotations

from typing import Protocol

from pagedserve.core.sched_output import ModelRunnerOutput, SchedulerOutput


class Runner(Protocol):
    def allocate_kv_cache(self) -> None:
        """Create the KV pools for config.cache.num_blocks blocks (memory is touched only as they fill)."""

    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step: the scheduled tokens through the model, then sampling (or pooling)."""

    def release_kv_pages(self, block_ids: list[int], block_size: int, window_block_ids: list[int] = ()) -> int:
        """Give the whole pages of these free blocks back to the system in every K/V pool the scheduler's block
        ids index (the model's and a draft model's, on every tensor-parallel rank; memory/pressure.py asks under
        memory pressure), `window_block_ids` in the sliding-window layers' pools where they have their own
        (core/kv_cache_manager.py); they read back as zeros. Returns the bytes released (0 for a runner without
        KV)."""

    def check_health(self) -> None:
        """Raise once the runner can run no more steps (a tensor-parallel rank died); a runner in this process
        only returns."""

    def warm_up_rows(self) -> int:
        """Rows the warm-up's first step must hold for every layer to run each of its paths (0: any will do);
        layers/linear.py's warm_up_rows."""

    def kernel_report(self) -> list[str]:
        """What the model's layers run, one line per kind of layer (the start-up log's and the dashboard's)."""
