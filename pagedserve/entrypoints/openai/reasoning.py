"""Reasoning parsers (`--reasoning-parser`, as vLLM's): a thinking model's reasoning read out of its output into the
reply's `reasoning` field (and `reasoning_content`, its older name that DeepSeek's API and many clients read), the
rest left as the reply's content, where the tool-call parser reads it.

Both parsers read the `<think>` ... `</think>` block these models write:
- qwen3 (Qwen3, QwQ-style templates, Qwen3.5): the output is reasoning up to `</think>` when it opens with `<think>`,
  when the prompt's generation prompt already opened the block (Qwen3-Thinking-2507 and Qwen3.5 templates end
  with `<think>`), or when the assistant message a continue_final_message request continues left one open;
  otherwise it is all content (`enable_thinking: false` closes the block in the prompt; a model that does not
  think writes no tags).
- deepseek_r1 (DeepSeek-R1 and its distills): the output is reasoning up to `</think>` whether or not it opens with
  `<think>` (R1 leaves the opening tag out), unless the prompt closed the block (a continued message's).
An output that ends inside the block (max_tokens reached while thinking) is all reasoning, with no content.

Requests that a grammar constrains (response_format, structured_outputs, tool_choice "required" or a named
function) think first, as vLLM's: the grammar applies from the token after `</think>` (structured/gate.py), where
the tags are single tokens of the vocabulary (Qwen3's, QwQ's, R1's), and at once where the prompt closed the block.
With any other vocabulary the grammar writes the whole output, which is read as content.
"""

from __future__ import annotations

from pagedserve.entrypoints.openai.tool_calls import ReasoningDelta, ToolCallDelta, ToolCallReader, partial_suffix
from pagedserve.structured.params import ReasoningGate

PARSERS = ("deepseek_r1", "qwen3")
START, END = "<think>", "</think>"
REASONING_PROMPT_TAIL = 16  # a prompt's last tokens read for a think block its generation prompt opened


OPEN, CLOSED = "open", "closed"  # prompt_block's answers


def prompt_block(prompt_tail: str, continued: str | None = None) -> str | None:
    """What a rendered prompt leaves the output of a think block: OPEN where its generation prompt ends with
    `<think>` (the tail, its last few tokens as text: the last `<think>` after the last `</think>`, with nothing but
    white space after it) or the assistant message it continues (`continued`, continue_final_message) holds a
    `<think>` not closed after it (a reasoning begun by the client: "<think>\nOkay, the user"); CLOSED where the
    generation prompt ends with a closed block (`enable_thinking: false` writes `<think>\n\n</think>`) or the
    continued message holds one (the reasoning is over: vLLM's rule too); else None."""
    start, end = prompt_tail.rfind(START), prompt_tail.rfind(END)
    last_start, last_end = (-1, -1) if continued is None else (continued.rfind(START), continued.rfind(END))
    if (start >= 0 and start > end and not prompt_tail[start + len(START):].strip()) or last_start > last_end:
        return OPEN
    if (end >= 0 and end > start and not prompt_tail[end + len(END):].strip()) or last_end >= 0:
        return CLOSED
    return None


class ReasoningReader(ToolCallReader):
    """Splits a generation's text into reasoning and content, and hands the content to `inner` (the tool-call
    reader). Fed piece by piece or at once, the events add up to the same reasoning and content: tags split over
    pieces are held until they are whole."""

    passes_text_through = False  # a tag's first characters are held until the next piece tells what they are

    def __init__(self, inner: ToolCallReader, parser: str, block: str | None) -> None:
        """`block`: prompt_block's answer for the prompt."""
        super().__init__()
        self.inner = inner
        # where the output does not open with <think>: R1 leaves the tag out, unless the prompt closed the block
        self.open_by_default = block == OPEN or (parser == "deepseek_r1" and block != CLOSED)
        self.state = "start"  # start: undecided (white space or part of <think> so far); reasoning; content
        self.held = ""
        self.fed = 0  # characters of the text so far
        self.content_start: int | None = None  # where the content began in the text (the block's end)

    @property
    def reasoning_chars(self) -> int:
        """How many of the text's first characters were the think block (its tags too): all of them so far while
        it is open; 0 where the text was content from the start."""
        return self.fed if self.content_start is None else self.content_start

    @property
    def reasoning_unended(self) -> bool:
        """The text so far is all think block: no content has begun."""
        return self.content_start is None and self.fed > 0

    @property
    def num_calls(self) -> int:  # read by the stream for its finish_reason
        return self.inner.num_calls

    @num_calls.setter
    def num_calls(self, value: int) -> None:  # the base class's initial 0: the inner reader counts
        pass

    def feed(self, text: str) -> list[str | ToolCallDelta | ReasoningDelta]:
        self.fed += len(text)
        if self.state == "content":
            return self.inner.feed(text)
        self.held += text
        events: list[str | ToolCallDelta | ReasoningDelta] = []
        if self.state == "start":
            lead = self.held.lstrip()
            if lead.startswith(START):
                self.held, self.state = lead[len(START):], "reasoning"
            elif START.startswith(lead):
                return events  # white space, or the tag's first characters: not yet known
            else:
                self.state = "reasoning" if self.open_by_default else "content"
                if self.state == "content":
                    held, self.held, self.content_start = self.held, "", 0
                    return self.inner.feed(held)
        end = self.held.find(END)
        if end >= 0:
            reasoning, rest = self.held[:end], self.held[end + len(END):]
            self.held, self.state, self.content_start = "", "content", self.fed - len(rest)
            if reasoning:
                events.append(ReasoningDelta(reasoning))
            return events + self.inner.feed(rest)
        keep = partial_suffix(self.held, END)
        reasoning, self.held = self.held[:len(self.held) - keep], self.held[len(self.held) - keep:]
        if reasoning:
            events.append(ReasoningDelta(reasoning))
        return events

    def finish(self) -> list[str | ToolCallDelta | ReasoningDelta]:
        events: list[str | ToolCallDelta | ReasoningDelta] = []
        held, self.held = self.held, ""
        if self.state == "start" and not self.open_by_default:
            self.state, self.content_start = "content", 0
            events += self.inner.feed(held)
        elif self.state != "content" and held:
            events.append(ReasoningDelta(held))  # the output ended inside the block: all of it reasoning
        return events + self.inner.finish()


def think_tag_ids(tokenizer) -> tuple[int, int] | None:
    """The ids of `<think>` and `</think>` where each is one token of the vocabulary, else None."""
    ids = [tokenizer.encode(tag, add_special_tokens=False) for tag in (START, END)]
    if all(len(i) == 1 for i in ids) and [tokenizer.decode(i) for i in ids] == [START, END]:
        return ids[0][0], ids[1][0]
    return None


def grammar_gate(parser: str | None, tags: tuple[int, int] | None, block: str | None) -> ReasoningGate | None:
    """Where a constrained request's grammar begins: after the think block (None: from the first token, where there
    is no parser, the tags are not single tokens, or the prompt closed the block)."""
    if parser is None or tags is None or block == CLOSED:
        return None
    return ReasoningGate(*tags, opened=block == OPEN or parser == "deepseek_r1")


def with_reasoning(reader: ToolCallReader, parser: str | None, block: str | None,
                   constrained: bool) -> ToolCallReader:
    """`reader` behind the reasoning parser, or `reader` itself (no parser; or a request whose grammar writes the
    whole output)."""
    if parser is None or constrained:
        return reader
    return ReasoningReader(reader, parser, block)
