"""The server's periodic stats line (metrics.StatsLog): rates over the window since the last line, written while
there is work, once more when it goes idle, then not at all."""

from __future__ import annotations

from types import SimpleNamespace

from pagedserve.metrics import StatsLog


def stats(running=0, waiting=0, kv=0.0, queries=0, hits=0, spec=None):
    return SimpleNamespace(num_running=running, num_waiting=waiting, kv_cache_usage=kv, prefix_cache_queries=queries,
                           prefix_cache_hits=hits, spec_decode=spec)


def test_rates_over_the_window_then_one_idle_line_then_silence():
    log = StatsLog(now=100.0)
    assert log.line(110.0) is None  # nothing happened yet
    log.add_step(stats(running=2, waiting=1, kv=0.125, queries=40, hits=10), prompt_tokens=400, generation_tokens=2)
    log.add_step(stats(running=2, kv=0.25, spec=SimpleNamespace(num_draft_tokens=8, num_accepted_tokens=6)),
                 prompt_tokens=0, generation_tokens=98)
    assert log.line(120.0) == ("Engine 000: Avg prompt throughput: 40.0 tokens/s, Avg generation throughput: 10.0 tokens/s, "
                               "Running: 2 reqs, Waiting: 0 reqs, KV cache usage: 25.0%, Prefix cache hit rate: 25.0%, "
                               "Draft acceptance rate: 75.0%")
    log.add_step(stats(), prompt_tokens=0, generation_tokens=5)  # the last tokens; the batch is empty now
    after = log.line(125.0)
    assert after.startswith("Engine 000: Avg prompt throughput: 0.0 tokens/s, Avg generation throughput: 1.0 "
                            "tokens/s, Running: 0 reqs") and after.endswith("Prefix cache hit rate: 0.0%")  # as vLLM
    assert log.line(130.0).startswith("Engine 000: Avg prompt throughput: 0.0 tokens/s, Avg generation throughput: "
                                      "0.0")  # idle
    assert log.line(140.0) is None and log.line(150.0) is None
