"""The offline LLM API when the engine fails a request: the call raises RequestFailedError naming it, and the
engine is left empty and usable for the next call."""

from __future__ import annotations

import pytest

from pagedserve.entrypoints.llm import LLM
from pagedserve.exceptions import RequestFailedError
from pagedserve.sampling_params import SamplingParams


def test_failed_model_step_raises_and_the_next_call_works(tiny_model_dir):
    llm = LLM(tiny_model_dir("llama"), dtype="float32", max_model_len=128, fault_injection="step:*:1")
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    with pytest.raises(RequestFailedError, match="model step failed: InjectedFault"):
        llm.generate(["hello", "world"], params)
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.scheduler.kv.usage == 0  # the failed step's blocks were freed
    outputs = llm.generate(["hello", "world"], params)
    assert [len(o.outputs[0].token_ids) for o in outputs] == [4, 4]
