"""A caller that stops taking a request's outputs (a streaming client that stopped reading) must not make the
server hold them without bound (QA-U: RSS grew ~28 KB a token for as long as the request generated): the engine
ends a request whose caller took nothing for STALLED_S while MAX_UNREAD_OUTPUTS waited; a caller that is only slow
is never ended; a merged stream of several prompts passes the stall back to each request's own stream."""

from __future__ import annotations

import asyncio
import time

import pytest

from pagedserve.engine import async_engine
from pagedserve.engine.async_engine import AsyncEngine
from pagedserve.entrypoints.llm import LLM
from pagedserve.entrypoints.openai.serving import _merge
from pagedserve.exceptions import RequestFailedError
from pagedserve.sampling_params import RequestOutputKind, SamplingParams


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    llm = LLM(tiny_model_dir("llama"), max_model_len=512, num_threads=1)
    engine = AsyncEngine(llm.engine)
    yield engine
    engine.shutdown()


def params() -> SamplingParams:
    return SamplingParams(max_tokens=300, ignore_eos=True, output_kind=RequestOutputKind.DELTA)


def test_a_request_whose_caller_stopped_taking_is_ended_and_a_slow_one_is_not(engine, monkeypatch):
    monkeypatch.setattr(async_engine, "MAX_UNREAD_OUTPUTS", 4)
    monkeypatch.setattr(async_engine, "STALLED_S", 0.3)
    step = engine.engine.step

    def paced():  # a step of a real model's pace: the request still generates once the caller is stalled
        time.sleep(0.005)
        return step()

    monkeypatch.setattr(engine.engine, "step", paced)

    async def stalled() -> tuple[int, BaseException | None]:
        stream = engine.generate("stalled", "a b", params())
        taken = 1
        await stream.__anext__()
        await asyncio.sleep(3)  # reads nothing: the outputs pile up, then the request is ended
        try:
            async for _ in stream:
                taken += 1
        except RequestFailedError as exc:
            return taken, exc
        return taken, None

    taken, error = asyncio.run(stalled())
    assert isinstance(error, RequestFailedError) and "read none of this request's output" in str(error), error
    assert taken < 300  # ended early: the outputs that waited, then the error
    deadline = time.monotonic() + 10
    while engine.engine.has_unfinished_requests() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not engine.engine.has_unfinished_requests()  # aborted: its KV blocks are free

    monkeypatch.setattr(async_engine, "STALLED_S", 2.0)  # a slow reader's gaps are far below it

    async def slow() -> int:
        tokens = 0
        async for output in engine.generate("slow", "a b", SamplingParams(max_tokens=40, ignore_eos=True)):
            tokens = len(output.outputs[0].token_ids)
            await asyncio.sleep(0.02)  # behind the engine, but taking all the time
        return tokens

    assert asyncio.run(slow()) == 40


def test_a_merged_stream_holds_its_pumps_when_nobody_takes():
    produced = [0, 0]

    async def source(index: int):
        for i in range(1000):
            produced[index] += 1
            yield i

    async def run() -> None:
        merged = _merge([source(0), source(1)])
        await merged.__anext__()
        await asyncio.sleep(0.2)  # nothing taken: the pumps wait on the bounded queue, not drain the sources
        assert sum(produced) <= 8, produced
        rest = [item async for item in merged]
        assert len(rest) == 1999 and sum(produced) == 2000

    asyncio.run(run())
