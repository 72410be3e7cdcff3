"""The engine runs the thread count engine/cpu_share.py says before each step, and where it may not change it, it
does not watch at all."""

from __future__ import annotations

import torch

from pagedserve import LLM, SamplingParams
from pagedserve.engine.cpu_share import CpuShare, CpuTimes

GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
PROMPTS = ["the quick brown fox", "one two three four five six"]


class BusyBox:
    """A fake machine on which each reading is 0.5 s after the last, a neighbour busy on `neighbours` CPUs."""

    def __init__(self, neighbours: float) -> None:
        self.neighbours, self.wall = neighbours, 0.0

    def read(self) -> CpuTimes:
        self.wall += 0.5
        return CpuTimes(self.wall, (self.neighbours + 1.0) * self.wall, 1.0 * self.wall)


def test_steps_run_on_the_threads_cpu_share_gives_and_tokens_stay_the_same(tiny_model_dir):
    model = tiny_model_dir("llama")
    previous = torch.get_num_threads()
    llm = LLM(model, num_threads=2, max_model_len=256)
    assert llm.engine.cpu_share is not None and llm.engine.cpu_share.configured == 2
    quiet = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]
    seen = []
    execute = llm.engine.runner.execute

    def recording(sched_out):
        seen.append(torch.get_num_threads())
        return execute(sched_out)

    llm.engine.runner.execute = recording
    box = BusyBox(neighbours=1.0)  # one of the 2 CPUs busy with another process
    llm.engine.cpu_share = CpuShare(box.read, cpus=2, threads=2, clock=lambda: box.wall + 0.5)  # always due
    busy = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]
    assert seen[0] == 2 and set(seen[1:]) == {1}  # the second reading agreed with the first: one thread
    assert busy == quiet
    box.neighbours = 0.0  # the neighbour stopped
    seen.clear()
    llm.generate(PROMPTS, GREEDY)
    assert seen[0] == 1 and seen[-1] == 2
    # While a server idles, its engine keeps reading the CPUs: a neighbour that came meanwhile is given way to
    # from the first step after the pause.
    box.neighbours = 1.0
    for _ in range(2):
        llm.engine.idle()
    assert llm.engine.cpu_threads == 1
    seen.clear()
    llm.generate(PROMPTS, GREEDY)
    assert set(seen) == {1}
    del llm
    torch.set_num_threads(previous)


def test_no_watch_when_turned_off_or_batch_invariant(tiny_model_dir, monkeypatch):
    model = tiny_model_dir("llama")
    previous = torch.get_num_threads()
    assert LLM(model, num_threads=2, max_model_len=256, cpu_give_way=False).engine.cpu_share is None
    assert LLM(model, num_threads=1, max_model_len=256).engine.cpu_share is None  # nothing to give
    monkeypatch.setenv("PAGEDSERVE_BATCH_INVARIANT", "1")
    assert LLM(model, num_threads=2, max_model_len=256).engine.cpu_share is None
    torch.set_num_threads(previous)
