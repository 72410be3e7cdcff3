"""A grammar that begins after the think block (structured/gate.py): the gate's phases read token by token and
over speculative drafts, and the engine's outputs on a tiny model whose vocabulary has `<think>` and `</think>` as
single tokens (the server's side, with --reasoning-parser, is tests/server/test_reasoning_grammar.py's)."""

from __future__ import annotations

import re

import pytest
import torch

from pagedserve import LLM, SamplingParams
from pagedserve.structured.params import ReasoningGate, StructuredOutputsParams
from tests.tiny_models import with_think_tags

CHOICE = StructuredOutputsParams(choice=["yes", "no"])


@pytest.fixture(scope="module")
def think_model(tiny_model_dir, tmp_path_factory) -> str:
    return str(with_think_tags(tiny_model_dir("qwen2"), tmp_path_factory.mktemp("think")))


@pytest.fixture(scope="module")
def tags(think_model) -> tuple[int, int]:
    from pagedserve.engine.setup import load_tokenizer

    tokenizer = load_tokenizer(think_model)
    start, end = (tokenizer.encode(t, add_special_tokens=False) for t in ("<think>", "</think>"))
    assert len(start) == len(end) == 1
    return start[0], end[0]


# ---- the gate over token ids --------------------------------------------------------------------------------
def gated(think_model, tags, opened: bool):
    from pagedserve.engine.setup import load_tokenizer
    from pagedserve.structured.compiler import GrammarCompiler
    from pagedserve.structured.gate import GatedGrammar
    from pagedserve.structured.matcher import RequestGrammar

    tokenizer = load_tokenizer(think_model)
    compiled = GrammarCompiler(tokenizer, 512).compile(StructuredOutputsParams(regex="[a-z]+"))
    return GatedGrammar(RequestGrammar(compiled, [tokenizer.eos_token_id]), ReasoningGate(*tags, opened)), tokenizer


def mask_of(view) -> torch.Tensor | None:
    import xgrammar as xgr

    if view is None:
        return None
    bitmask = xgr.allocate_token_bitmask(1, 512)
    view.fill(bitmask, 0)
    return bitmask[0].clone()


@pytest.mark.parametrize("opened", [False, True])
def test_drafts_read_as_the_tokens_one_at_a_time(think_model, tags, opened):
    """At every point of an output (think block, then the grammar's text, then EOS), for every run of drafts
    after it: the valid drafts and each verification row's mask are what accepting the tokens one by one gives;
    the drafts move nothing."""
    start, end = tags
    _, tokenizer = gated(think_model, tags, opened)
    words = tokenizer.encode("abc def", add_special_tokens=False)  # a space: not in [a-z]+, fine inside the block
    letters = tokenizer.encode("hello", add_special_tokens=False)
    output = ([] if opened else [start]) + words + [end] + letters + [tokenizer.eos_token_id]
    for point in range(len(output)):  # (after the EOS the request has ended: no row to mask)
        for length in range(0, len(output) - point + 1):
            drafts = output[point:point + length]
            grammar, _ = gated(think_model, tags, opened)
            assert all(grammar.accept(t) for t in output[:point])
            valid = grammar.num_valid_drafts(drafts)
            masks = [mask_of(grammar.at(drafts[:i])) for i in range(valid + 1)]
            stepped, _ = gated(think_model, tags, opened)
            assert all(stepped.accept(t) for t in output[:point])
            expected_masks, expected_valid = [mask_of(stepped.at([]))], 0
            for token_id in drafts:
                if not stepped.accept(token_id) or stepped.is_terminated:
                    break
                expected_valid += 1
                expected_masks.append(mask_of(stepped.at([])))
            assert valid == expected_valid, (point, drafts)
            for got, want in zip(masks, expected_masks):
                assert (got is None and want is None) or torch.equal(got, want), (point, drafts)
            assert all(grammar.accept(t) for t in output[point:])  # the drafts left the gate where it was
            assert grammar.is_terminated


def test_phases(think_model, tags):
    start, end = tags
    grammar, tokenizer = gated(think_model, tags, opened=False)
    first = mask_of(grammar.at([]))
    bit = lambda mask, token_id: bool((int(mask[token_id >> 5]) >> (token_id & 31)) & 1)  # noqa: E731
    assert bit(first, start) and not bit(first, end)  # the grammar's tokens and the opening tag
    assert bit(first, tokenizer.encode("h", add_special_tokens=False)[0])
    assert grammar.accept(start) and grammar.at([]) is None  # inside the block: not masked
    space = tokenizer.encode(" ", add_special_tokens=False)[0]
    assert grammar.accept(space) and grammar.accept(end)
    assert not bit(mask_of(grammar.at([])), start)  # after it: the grammar alone
    assert not grammar.accept(space)  # the grammar refuses what the block took

    opened, _ = gated(think_model, tags, opened=True)
    assert opened.at([]) is None and opened.accept(start) and opened.at([]) is None
    no_block, _ = gated(think_model, tags, opened=False)
    assert no_block.accept(tokenizer.encode("h", add_special_tokens=False)[0])  # the grammar from the first token
    assert not no_block.accept(start)


# ---- the engine ----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def llm(think_model):
    return LLM(think_model, max_model_len=512, dtype="float32")


def params(gate: ReasoningGate | None, **kwargs) -> SamplingParams:
    return SamplingParams(**{"temperature": 0.0, "max_tokens": 24, **kwargs}, structured_outputs=CHOICE,
                          reasoning_gate=gate)


def test_the_grammar_begins_after_the_block(llm, tags):
    start, end = tags
    bias = {start: 50.0, end: 100.0}  # the block's tags win wherever they are allowed
    texts = [o.outputs[0].text for o in llm.generate(["The quick brown fox"] * 4, [
        params(None, logit_bias=bias),  # no gate: the grammar from the first token
        params(ReasoningGate(start, end, opened=False), logit_bias=bias),  # the model opens a block, then closes it
        params(ReasoningGate(start, end, opened=True), logit_bias={end: 100.0}),  # the prompt opened it
        params(ReasoningGate(start, end, opened=False), logit_bias={start: -100.0})])]  # no block: grammar first
    assert texts[0] in ("yes", "no")
    assert re.fullmatch("<think></think>(yes|no)", texts[1]), texts[1]
    assert re.fullmatch("</think>(yes|no)", texts[2]), texts[2]
    assert texts[3] in ("yes", "no")


def test_nothing_is_masked_inside_the_block(llm, tags):
    """A block never closed: the output is the model's own, as without a grammar (vLLM's too)."""
    start, end = tags
    prompts = ["The quick brown fox", "def square(x):"]
    free = [o.outputs[0].token_ids for o in llm.generate(prompts, SamplingParams(
        temperature=0.0, max_tokens=24, ignore_eos=True, logit_bias={end: -100.0}))]
    gated_out = [o.outputs[0].token_ids for o in llm.generate(prompts, params(
        ReasoningGate(start, end, opened=True), ignore_eos=True, logit_bias={end: -100.0}))]
    assert gated_out == free


def test_reasoning_then_grammar_with_speculation_and_preemption(think_model, tags):
    """The block ends where the model's biased `</think>` first wins inside its free text (a bias found so that
    it does for some prompts a few tokens in): the reasoning is the free output up to there, then the grammar;
    n-gram speculation and a pool small enough to preempt give the same tokens."""
    start, end = tags
    plain = LLM(think_model, max_model_len=512, dtype="float32")
    prompts = [f"The quick brown fox {i} jumps over the lazy dog {i}" for i in range(6)] + ["Hello", "def f():"]

    def free_output(bias: float) -> list[list[int]]:
        sampling = SamplingParams(temperature=0.0, max_tokens=40, logit_bias={end: bias})
        return [o.outputs[0].token_ids for o in plain.generate(prompts, sampling)]

    def late_ends(outputs: list[list[int]]) -> int:
        return sum(end in ids and ids.index(end) >= 3 for ids in outputs)

    bias = next(b / 4 for b in range(40) if late_ends(free_output(b / 4)) >= 2)
    free = free_output(bias)
    sampling = params(ReasoningGate(start, end, opened=True), max_tokens=40, logit_bias={end: bias})
    expected = [o.outputs[0].token_ids for o in plain.generate(prompts, sampling)]
    tokenizer = plain.get_tokenizer()
    for ids, free_ids in zip(expected, free):
        cut = free_ids.index(end) + 1 if end in free_ids else len(free_ids)
        assert ids[:cut] == free_ids[:cut]  # the reasoning as the model writes it
        if end in free_ids:
            assert tokenizer.decode(ids[cut:], skip_special_tokens=True) in ("yes", "no")
    speculative = LLM(think_model, max_model_len=512, dtype="float32", speculative_config={
        "method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1})
    assert [o.outputs[0].token_ids for o in speculative.generate(prompts, sampling)] == expected
    assert speculative.engine.scheduler.proposer.totals.num_draft_tokens > 0
    tight = LLM(think_model, max_model_len=512, dtype="float32", num_gpu_blocks_override=12, block_size=16)
    assert [o.outputs[0].token_ids for o in tight.generate(prompts, sampling)] == expected
    assert tight.engine.scheduler.num_preemptions_total > 0


def test_llm_with_a_reasoning_parser_gates_constrained_requests(think_model, tags):
    """LLM(reasoning_parser=...) as vLLM's: the texts are not split, but a constrained request's grammar waits
    for the block its prompt opened (a template's generation prompt, a raw prompt ending in `<think>`, a continued
    assistant message), and where none was opened the first token is `<think>` or the grammar's."""
    start, end = tags
    llm = LLM(think_model, max_model_len=512, dtype="float32", reasoning_parser="qwen3")
    bias = {end: 100.0}  # wherever it is allowed, the block ends at once
    sampling = SamplingParams(temperature=0.0, max_tokens=24, structured_outputs=CHOICE, logit_bias=bias)
    question = [{"role": "user", "content": "Is the fox quick?"}]
    texts = [o.outputs[0].text for o in llm.chat([question, question], sampling,
                                                 chat_template_kwargs={"think": True})]
    assert all(re.fullmatch("</think>(yes|no)", t) for t in texts), texts
    continued = llm.chat([*question, {"role": "assistant", "content": "<think>\nThe fox"}], sampling,
                         add_generation_prompt=False, continue_final_message=True)[0].outputs[0].text
    assert re.fullmatch("</think>(yes|no)", continued), continued
    raw = llm.generate(["Question: is the fox quick? <think>\n", "Question: is the fox quick?"], sampling)
    assert re.fullmatch("</think>(yes|no)", raw[0].outputs[0].text), raw[0].outputs[0].text
    assert raw[1].outputs[0].text in ("yes", "no")  # no block opened: `</think>` is not allowed first
    closed = llm.generate("Question: is the fox quick? <think>\n\n</think>\n\n", SamplingParams(
        temperature=0.0, max_tokens=24, structured_outputs=CHOICE, logit_bias={start: 50.0, end: 100.0}))
    assert closed[0].outputs[0].text in ("yes", "no")  # the prompt closed the block: no second one
    free = llm.generate("Question: is the fox quick?", SamplingParams(temperature=0.0, max_tokens=8, logit_bias=bias))
    assert free[0].outputs[0].token_ids[0] == end  # (an unconstrained request is not touched)
    with pytest.raises(ValueError, match="reasoning_parser='granite': not one of deepseek_r1, qwen3"):
        LLM(think_model, reasoning_parser="granite")
