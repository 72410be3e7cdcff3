"""The Responses stream's events (serving_responses.py), fed by a fake engine stream: each output item is done
before the next is added (text after a function call is a new message), and a failure mid-stream is an `error`
event and response.failed, as OpenAI sends them, with no chat-style [DONE]."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

from pagedserve.entrypoints.openai.serving_responses import ResponsesServing
from pagedserve.entrypoints.openai.tool_calls import ReasoningDelta, ToolCallDelta, ToolCallReader, read_all
from pagedserve.exceptions import InvalidRequestError


class ScriptedReader(ToolCallReader):
    """Hands out a fixed list of events per feed, as a tool-call reader would."""

    def __init__(self, script: list[list]) -> None:
        super().__init__()
        self.script = iter(script)

    def feed(self, text: str) -> list:
        return next(self.script, [])

    def finish(self) -> list:
        return []


def run(script: list[list], fail_after: int | None = None) -> list[dict]:
    async def outputs():
        for i in range(len(script)):
            if fail_after is not None and i == fail_after:
                raise InvalidRequestError("the grammar allows no token", param="text")
            done = "stop" if i == len(script) - 1 else None
            completion = SimpleNamespace(token_ids=[1], text="x", finish_reason=done)
            yield 0, SimpleNamespace(outputs=[completion], num_cached_tokens=0, prompt_logprobs=None)

    serving = ResponsesServing(SimpleNamespace(tool_call_parser=None, served_model_names=["m"]))

    async def collect() -> list[str]:
        return [line async for line in serving._events({"id": "resp_1", "output": []}, [1, 2], outputs(),
                                                       ScriptedReader(script))]

    lines = asyncio.run(collect())
    return [json.loads(line.split("data: ", 1)[1]) for line in lines]


def test_each_item_is_done_before_the_next_is_added():
    call = ToolCallDelta(0, '{"city": ', "call_1", "get_weather")
    events = run([["Let me check."], [call], [ToolCallDelta(0, '"Paris"}')], ["Done."]])
    kinds = [(e["type"], e.get("output_index")) for e in events]
    assert kinds == [
        ("response.created", None), ("response.in_progress", None),
        ("response.output_item.added", 0), ("response.content_part.added", 0), ("response.output_text.delta", 0),
        ("response.output_text.done", 0), ("response.content_part.done", 0), ("response.output_item.done", 0),
        ("response.output_item.added", 1), ("response.function_call_arguments.delta", 1),
        ("response.function_call_arguments.delta", 1), ("response.function_call_arguments.done", 1),
        ("response.output_item.done", 1),
        ("response.output_item.added", 2), ("response.content_part.added", 2), ("response.output_text.delta", 2),
        ("response.output_text.done", 2), ("response.content_part.done", 2), ("response.output_item.done", 2),
        ("response.completed", None)]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    final = events[-1]["response"]["output"]
    assert [i["type"] for i in final] == ["message", "function_call", "message"]
    assert final[1]["arguments"] == '{"city": "Paris"}' and final[2]["content"][0]["text"] == "Done."


def test_reasoning_is_an_item_of_its_own_before_the_message():
    """--reasoning-parser: the reasoning's deltas make a reasoning item, done before the message is added."""
    events = run([[ReasoningDelta("Let me")], [ReasoningDelta(" think."), "Par"], ["is."]])
    kinds = [(e["type"], e.get("output_index")) for e in events]
    assert kinds == [
        ("response.created", None), ("response.in_progress", None),
        ("response.output_item.added", 0), ("response.reasoning_text.delta", 0), ("response.reasoning_text.delta", 0),
        ("response.reasoning_text.done", 0), ("response.output_item.done", 0),
        ("response.output_item.added", 1), ("response.content_part.added", 1), ("response.output_text.delta", 1),
        ("response.output_text.delta", 1), ("response.output_text.done", 1), ("response.content_part.done", 1),
        ("response.output_item.done", 1), ("response.completed", None)]
    assert events[2]["item"] == {"type": "reasoning", "id": events[2]["item"]["id"], "status": "in_progress",
                                 "summary": [], "content": []}
    assert events[5]["text"] == "Let me think."
    final = events[-1]["response"]["output"]
    assert [(i["type"], i["status"]) for i in final] == [("reasoning", "completed"), ("message", "completed")]
    assert final[0]["content"] == [{"type": "reasoning_text", "text": "Let me think."}]
    assert final[1]["content"][0]["text"] == "Paris."


def test_a_failure_mid_stream_is_an_error_event_and_response_failed():
    events = run([["Hello"], [" there"], ["!"]], fail_after=2)
    assert [e["type"] for e in events][-2:] == ["error", "response.failed"]
    assert events[-2]["message"] == "the grammar allows no token" and events[-2]["param"] == "text"
    failed = events[-1]["response"]
    assert failed["status"] == "failed" and failed["error"]["message"] == "the grammar allows no token"
    assert failed["error"]["code"] == "invalid_prompt"  # one of OpenAI's ResponseError codes (QA-W)
    assert failed["output"][0]["content"][0]["text"] == "Hello there"


def test_reasoning_tokens_are_those_up_to_the_end_of_the_think_block():
    """usage.output_tokens_details.reasoning_tokens: the tokens up to the one that closes the block; a special
    token the detokenizer skips (an EOS under ignore_eos) shifts no position."""
    from pagedserve.entrypoints.openai.reasoning import ReasoningReader

    pieces = ["<think>", "a", "<eos>", "b", "</think>", "c", "d"]

    def decode(ids, skip_special_tokens=True):
        return "".join(pieces[i] for i in ids if not (skip_special_tokens and pieces[i] == "<eos>"))

    async def in_tokenizer_pool(fn, *args):
        return fn(*args)

    serving = ResponsesServing(SimpleNamespace(tool_call_parser=None, served_model_names=["m"],
                                               tokenizer=SimpleNamespace(decode=decode),
                                               in_tokenizer_pool=in_tokenizer_pool))
    ids = list(range(len(pieces)))
    # the block ending the text, then an EOS (QA-R2: all 6 were counted); the block never ending: all of them
    for output, expected in ((ids, 5), (ids[:4], 4), ([5, 6], 0), (ids[:5] + [2], 5), (ids[:3], 3)):
        reader = ReasoningReader(ToolCallReader(), "qwen3", None)
        read_all(reader, decode(output))
        counted = asyncio.run(serving._reasoning_tokens(output, reader, skip_special_tokens=True))
        assert counted == expected, output


def test_an_earlier_reply_s_refusal_part_is_its_text():
    """An assistant item as OpenAI returns it may hold a refusal part: its text goes back to the template, as vLLM
    reads it (a 400 "text only" before, QA-F)."""
    from pagedserve.entrypoints.openai.serving_responses import _messages

    messages = _messages([{"role": "user", "content": "help?"},
                          {"role": "assistant", "content": [{"type": "refusal", "refusal": "I can't."}]}])
    assert messages[1] == {"role": "assistant", "content": "I can't."}
    try:
        _messages([{"role": "assistant", "content": [{"type": "refusal", "text": "x"}]}])
    except InvalidRequestError as exc:
        assert "needs refusal, a string" in exc.message
    else:
        raise AssertionError("a refusal part without its refusal was taken")
