"""Reasoning parsers (--reasoning-parser): the think block read out of a generation's text, whole or streamed."""

from __future__ import annotations

import json

import pytest

from pagedserve.entrypoints.openai.chat_format import chat_delta
from pagedserve.entrypoints.openai.reasoning import CLOSED, OPEN, ReasoningReader, prompt_block, with_reasoning
from pagedserve.entrypoints.openai.tool_calls import (HermesReader, ReadResult, ReasoningDelta, ToolCallReader,
                                                      read_all)

CASES = [  # (parser, prompt opened the block, output, reasoning, content)
    ("qwen3", False, "<think>\nLet me see.\n</think>\n\nParis.", "\nLet me see.\n", "\n\nParis."),
    ("qwen3", False, "\n<think>a</think>b", "a", "b"),  # white space before the tag is dropped with it
    ("qwen3", False, "Paris.", None, "Paris."),  # no tag: a model that does not think
    ("qwen3", False, "The tag <think> later is text", None, "The tag <think> later is text"),
    ("qwen3", False, "", None, ""),
    ("qwen3", False, "<thi", None, "<thi"),  # a tag's beginning that never completed: text
    ("qwen3", True, "Let me see.</think>Paris.", "Let me see.", "Paris."),  # Qwen3.5 / Thinking-2507 templates
    ("qwen3", True, "<think>x</think>y", "x", "y"),  # a model that opens the block again: the tag is dropped
    ("qwen3", True, "still thinking when max_tokens came", "still thinking when max_tokens came", ""),
    ("qwen3", False, "<think>cut short", "cut short", ""),
    ("qwen3", False, "<think></think>Paris.", None, "Paris."),  # an empty block: no reasoning
    ("deepseek_r1", False, "Okay, so.</think>\n\n42", "Okay, so.", "\n\n42"),  # R1 leaves <think> out
    ("deepseek_r1", False, "<think>Okay</think>42", "Okay", "42"),
    ("deepseek_r1", False, "no end tag at all", "no end tag at all", ""),
    ("deepseek_r1", False, "a</think>b</think>c", "a", "b</think>c"),  # only the first end tag ends the block
    ("qwen3", False, "<think>1 < 2 and </thin is not </think>done", "1 < 2 and </thin is not ", "done"),
]


def read(parser: str, opened: bool, pieces: list[str], inner: ToolCallReader | None = None) -> ReadResult:
    reader = ReasoningReader(inner or ToolCallReader(), parser, OPEN if opened else None)
    result = ReadResult()
    for piece in pieces:
        result.add(reader.feed(piece))
    result.add(reader.finish())
    if inner is None:  # the block's characters, tags and all: where the content begins (for reasoning_tokens)
        assert reader.reasoning_chars == len("".join(pieces)) - len(result.content)
    return result


@pytest.mark.parametrize("parser,opened,output,reasoning,content", CASES)
def test_the_think_block_is_read_out_of_the_text(parser, opened, output, reasoning, content):
    result = read(parser, opened, [output])
    assert (result.reasoning, result.content) == (reasoning, content)


@pytest.mark.parametrize("parser,opened,output,reasoning,content", CASES)
def test_streamed_pieces_add_up_to_the_whole_text_at_every_split(parser, opened, output, reasoning, content):
    """A tag split between tokens (Qwen's tags are one token each, other tokenizers' several) reads the same."""
    for cut in range(len(output) + 1):
        for cut2 in range(cut, len(output) + 1):
            result = read(parser, opened, [output[:cut], output[cut:cut2], output[cut2:]])
            assert (result.reasoning, result.content) == (reasoning, content), (cut, cut2)
    result = read(parser, opened, list(output))  # a character at a time
    assert (result.reasoning, result.content) == (reasoning, content)


def test_tool_calls_are_read_from_the_content_after_the_reasoning():
    call = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
    output = f"<think>The user wants a sum. <tool_call> is how I call.</think>\n\n{call}"
    for pieces in ([output], list(output)):
        result = read("qwen3", False, pieces, HermesReader(["add"]))
        assert result.reasoning == "The user wants a sum. <tool_call> is how I call."
        assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in result.calls] == [
            ("add", {"a": 1, "b": 2})]
    reader = ReasoningReader(HermesReader(["add"]), "qwen3", None)
    read_all(reader, output)
    assert reader.num_calls == 1  # what a stream's finish_reason reads


def test_no_parser_or_a_grammar_leaves_the_reader_as_it_is():
    inner = ToolCallReader()
    assert with_reasoning(inner, None, OPEN, constrained=False) is inner
    assert with_reasoning(inner, "qwen3", OPEN, constrained=True) is inner  # the grammar writes every token
    assert isinstance(with_reasoning(inner, "qwen3", None, constrained=False), ReasoningReader)


@pytest.mark.parametrize("tail,block", [
    ("<|im_start|>assistant\n<think>\n", OPEN),  # Qwen3-Thinking-2507 / Qwen3.5
    ("<|im_start|>assistant\n<think>\n\n</think>\n\n", CLOSED),  # enable_thinking false
    ("<|im_start|>assistant\n", None),
    ("<｜Assistant｜><think>\n", OPEN),  # DeepSeek-R1's newer templates
    ("<think> a question about </think> tags <think>x", None),  # text after the tag: not a block left open
    ("a question about </think> tags", None),  # nor one closed
    ("", None),
])
def test_what_a_generation_prompt_leaves_of_the_block(tail, block):
    assert prompt_block(tail) == block


@pytest.mark.parametrize("continued,block", [
    ("<think>\nTwo plus", OPEN),  # the client began the reasoning (QA: it all went to content, </think> too)
    ("<think>\nTwo plus two is four.</think>\n\nThe", CLOSED),  # the reasoning is over (QA-G: a second block)
    ("<think>\nOkay</think>", CLOSED),
    ("The answer", None),
    ("What does <think> mean? <think>", OPEN),
])
def test_what_a_continued_assistant_message_leaves_of_the_block(continued, block):
    assert prompt_block("<|im_start|>assistant\n" + continued, continued) == block
    assert prompt_block("a user's <think> in a question<|im_end|>\n<|im_start|>assistant\n") is None


def test_a_closed_block_in_the_prompt_leaves_r1_s_output_content():
    """deepseek_r1 reads an output without `<think>` as reasoning, but not after a prompt that closed the block."""
    for block, expected in ((None, ("Okay", "42")), (CLOSED, (None, "Okay</think>42"))):
        result = read_all(ReasoningReader(ToolCallReader(), "deepseek_r1", block), "Okay</think>42")
        assert (result.reasoning or None, result.content) == expected, block


def test_a_chunk_of_reasoning_carries_no_content_field():
    assert chat_delta([ReasoningDelta("hm")]) == {"reasoning": "hm", "reasoning_content": "hm"}
    assert chat_delta([ReasoningDelta("hm"), "Paris"]) == {"reasoning": "hm", "reasoning_content": "hm",
                                                           "content": "Paris"}
    assert chat_delta([]) == {"content": ""}


def reasoning_item(text: str) -> dict:
    return {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": text}]}


def test_a_responses_reasoning_item_sent_back_is_the_reasoning_of_its_assistant_turn():
    """A reply's output items sent back as the next request's input (the Responses API without storage): the
    reasoning item was a 400 (QA)."""
    from pagedserve.entrypoints.openai.serving_responses import _messages

    user = {"role": "user", "content": "2+2?"}
    reply = {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "4"}]}
    call = {"type": "function_call", "call_id": "call_1", "name": "add", "arguments": "{}"}
    assert _messages([user, reasoning_item("Two and two."), reply, {"role": "user", "content": "5+5?"}]) == [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4", "reasoning_content": "Two and two."},
        {"role": "user", "content": "5+5?"}]
    assert _messages([user, reasoning_item("a"), reasoning_item("b"), call])[1] == {
        "role": "assistant", "content": None, "reasoning_content": "a\nb",
        "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "add", "arguments": "{}"}}]}
    # a reply that was all reasoning (cut at max_output_tokens): an assistant turn of its own
    assert _messages([user, reasoning_item("Hm"), user])[1] == {"role": "assistant", "content": "",
                                                                 "reasoning_content": "Hm"}
    assert _messages([user, reasoning_item("Hm")])[-1]["reasoning_content"] == "Hm"
    summary_only = {"type": "reasoning", "summary": [{"type": "summary_text", "text": "S"}]}  # OpenAI's models'
    assert _messages([user, summary_only, reply])[1]["reasoning_content"] == "S"
    assert _messages([user, {"type": "reasoning", "summary": [], "encrypted_content": "gAAA"}, reply])[1] == {
        "role": "assistant", "content": "4"}  # no text: nothing to replay
    with pytest.raises(Exception, match="reasoning item's content must be a list"):
        _messages([user, {"type": "reasoning", "content": [{"type": "output_text", "text": "x"}]}])
