"""Structured outputs and the engine: the accepted JSON-schema keywords are enforced by xgrammar (and the
refused ones are those it ignores), constrained requests through LLM.generate, mixed batches, preemption."""

from __future__ import annotations

import json
import re
import threading
import time

import pytest
import xgrammar as xgr
from xgrammar.testing import _is_grammar_accept_string as accepts

from pagedserve.structured.compiler import NUM_COMPILE_WORKERS, json_schema_grammar
from pagedserve.structured.schema import check_json_schema

ENFORCED = [  # (schema, an instance it must reject, one it must accept)
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}, '{}', '{"a": 1}'),
    ({"type": "integer", "minimum": 0, "maximum": 10}, "11", "10"),
    ({"type": "number", "exclusiveMinimum": 0}, "0", "0.5"),
    ({"type": "integer", "multipleOf": 3}, "4", "6"),
    ({"type": "string", "maxLength": 3}, '"abcd"', '"abc"'),
    ({"type": "string", "minLength": 2}, '"a"', '"ab"'),
    ({"type": "string", "maxLength": 3}, '"a\tb"', '"a b"'),  # no raw control characters (not JSON)
    ({"type": "string", "pattern": "^[a-z]{3}$"}, '"abcd"', '"abc"'),
    ({"type": "string", "format": "date"}, '"tomorrow"', '"2026-12-01"'),
    ({"enum": ["a", 1]}, '"b"', "1"),
    ({"const": "x"}, '"y"', '"x"'),
    ({"type": "array", "items": {"type": "integer"}, "minItems": 1, "maxItems": 2}, "[1, 2, 3]", "[1, 2]"),
    ({"type": "array", "prefixItems": [{"type": "integer"}], "items": False}, "[1, 2]", "[1]"),
    ({"anyOf": [{"type": "integer"}, {"type": "null"}]}, '"a"', "null"),
    ({"allOf": [{"type": "integer"}]}, '"a"', "1"),
    ({"type": "object", "properties": {"a": {"$ref": "#/$defs/A"}}, "required": ["a"],
      "$defs": {"A": {"type": "boolean"}}}, '{"a": 1}', '{"a": true}'),
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "additionalProperties": False},
     '{"b": 1}', '{"a": 1}'),
]


@pytest.mark.parametrize("schema, bad, good", ENFORCED)
def test_accepted_keywords_are_enforced_by_xgrammar(schema, bad, good):
    check_json_schema(schema, "response_format")  # accepted by us ...
    grammar = json_schema_grammar(schema, any_whitespace=True)
    assert accepts(grammar, good)
    assert not accepts(grammar, bad)  # ... and enforced by the grammar


@pytest.mark.parametrize("pattern", ['[a-z"]+', '[^"]+', "[^\\n]+", "[^\\\\]+", ".+"])
def test_character_classes_never_write_what_json_escapes(pattern):
    """Why a pattern's classes pass the literal check: xgrammar keeps quotes, backslashes and control characters
    out of them (and of "."), so the string stays valid JSON."""
    schema = {"type": "string", "pattern": pattern}
    check_json_schema(schema, "response_format")
    grammar = json_schema_grammar(schema, any_whitespace=True)
    assert accepts(grammar, '"ab"')
    for bad in ['"a"b"', '"a\\"b"', '"a\nb"', '"a\\nb"', '"a\\\\b"']:
        assert not accepts(grammar, bad), bad


def test_bounded_strings_refuse_control_characters_and_quotes(tiny_model_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir("llama"))
    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=512))
    grammar = compiler.compile_grammar(json_schema_grammar({"type": "string", "maxLength": 3}))

    def complete(data: bytes) -> bool:
        matcher = xgr.GrammarMatcher(grammar)
        return matcher.accept_string(data) and matcher.is_completed()

    for good in ['"abc"', '"é中😀"', '""', '"a b"']:
        assert complete(good.encode()), good
    for bad in [b'"a\x01"', b'"a\tb"', b'"a"b"', b'"abcd"']:
        assert not complete(bad), bad


def _well_formed_after(data: bytes) -> bool:
    """Some continuation makes `data` well-formed UTF-8 (Python's strict decoder as the reference)."""
    import itertools

    for n in range(4):
        for tail in itertools.product([0x80, 0x8F, 0x90, 0x9F, 0xA0, 0xBF], repeat=n):
            try:
                (data + bytes(tail)).decode("utf-8")
                return True
            except UnicodeDecodeError:
                pass
    return False


def test_utf8_guard_allows_exactly_the_well_formed_continuations():
    """xgrammar takes overlong forms and surrogates after E0/ED/F0/F4 (each decodes to several U+FFFD): the
    guard must forbid exactly the tokens that leave no well-formed continuation, from every state."""
    import random

    from pagedserve.structured.utf8 import ERROR, START, Utf8Guard

    rng = random.Random(0)
    tokens = [bytes([b]) for b in range(256)] + ["é".encode(), "😀".encode(), "中文".encode(), b"abc"]
    tokens += [bytes(rng.randrange(256) for _ in range(rng.randrange(1, 6))) for _ in range(2000)]
    guard = Utf8Guard(tokens, len(tokens) + 3)  # ids past the list write nothing
    for prefix in [b"", b"\xe0", b"\xed", b"\xf0", b"\xf4", b"\xc3", b"\xe1\x80", b"\xf0\x9f", b"\xf0\x9f\x98"]:
        state = START
        for byte in prefix:
            state = guard.advance(state, byte)  # tokens 0-255 are the single bytes
        assert state != ERROR
        for index, token in enumerate(tokens):
            assert (guard.end_state[state, index] != ERROR) == _well_formed_after(prefix + token), (prefix, token)
        assert guard.end_state[state, len(tokens)] == state
    assert guard.end_state[START, 0xF0] != ERROR and guard.end_state[guard.advance(START, 0xF0), 0x8A] == ERROR


@pytest.mark.parametrize("schema, bad", [
    ({"not": {"type": "string"}}, '"a"'),
    ({"type": "array", "uniqueItems": True, "items": {"type": "integer"}}, "[1, 1]"),
    ({"allOf": [{"type": "integer"}, {"minimum": 5}]}, "3"),
    ({"type": "number", "multipleOf": 0.5}, "0.3"),
])
def test_refused_keywords_are_the_ones_xgrammar_ignores(schema, bad):
    """If xgrammar starts enforcing one of these, this fails: then it can move to the accepted list."""
    assert accepts(xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=True), bad)


# ---- through the engine ---------------------------------------------------------------------------------
import jsonschema  # noqa: E402

from pagedserve import LLM, SamplingParams  # noqa: E402
from pagedserve.exceptions import InvalidRequestError  # noqa: E402
from pagedserve.structured import StructuredOutputsParams  # noqa: E402

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "tags", "pet"],
          "properties": {"name": {"type": "string", "minLength": 1, "maxLength": 8},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
                         "pet": {"anyOf": [{"type": "null"},
                                           {"type": "object", "required": ["kind"], "additionalProperties": False,
                                            "properties": {"kind": {"enum": ["cat", "dog"]}}}]}}}


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    return LLM(tiny_model_dir("llama"), max_model_len=512, dtype="float32")


def constrained(spec: StructuredOutputsParams, **kwargs) -> SamplingParams:
    return SamplingParams(**{"temperature": 1.0, "max_tokens": 300, **kwargs}, structured_outputs=spec)


def test_random_sampling_always_matches_the_schema(llm):
    spec = StructuredOutputsParams(json=PERSON)
    outputs = llm.generate(["The quick brown fox"] * 12, [constrained(spec, seed=i) for i in range(12)])
    for output in outputs:
        completion = output.outputs[0]
        assert completion.finish_reason == "stop", completion.text
        jsonschema.validate(json.loads(completion.text), PERSON)
    assert len({o.outputs[0].text for o in outputs}) > 1  # really sampled, not one fixed answer


def test_regex_choice_grammar_and_json_object(llm):
    specs = [StructuredOutputsParams(regex=r"[0-9]{3}-[a-z]{2}"), StructuredOutputsParams(choice=["yes", "no"]),
             StructuredOutputsParams(grammar='root ::= "(" [0-9]+ ")"'),
             StructuredOutputsParams(json_object=True)]
    outputs = llm.generate(["x"] * 4, [constrained(s, seed=3, max_tokens=40, temperature=0.0 if s.json_object else 1.0)
                                       for s in specs])
    texts = [o.outputs[0].text for o in outputs]

    assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", texts[0])
    assert texts[1] in ("yes", "no")
    assert re.fullmatch(r"\([0-9]+\)", texts[2])
    assert texts[3].lstrip().startswith("{")  # a JSON object (cut by max_tokens or complete)
    if outputs[3].outputs[0].finish_reason == "stop":
        assert isinstance(json.loads(texts[3]), dict)


def test_mixed_batch_leaves_free_requests_unchanged(llm):
    """Free requests batched with constrained ones give exactly what they give alone (greedy)."""
    free = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    alone = [o.outputs[0].token_ids for o in llm.generate(["Paris is", "def square"], free)]
    spec = StructuredOutputsParams(json=PERSON)
    mixed = llm.generate(["Paris is", "The fox", "def square", "Emoji"],
                         [free, constrained(spec, seed=1), free, constrained(spec, temperature=0.0)])
    assert [mixed[0].outputs[0].token_ids, mixed[2].outputs[0].token_ids] == alone
    for output in (mixed[1], mixed[3]):
        jsonschema.validate(json.loads(output.outputs[0].text), PERSON)


def test_n_seeds_logprobs_and_penalties_respect_the_grammar(llm):
    spec = StructuredOutputsParams(choice=["alpha", "beta", "gamma"])
    params = constrained(spec, n=6, seed=7, logprobs=2, presence_penalty=1.5, logit_bias={5: 50.0})
    first, again = llm.generate("Hello", params)[0], llm.generate("Hello", params)[0]
    assert all(c.text in ("alpha", "beta", "gamma") for c in first.outputs)
    assert [c.text for c in first.outputs] == [c.text for c in again.outputs]  # seeded: deterministic
    assert all(len(c.logprobs) == len(c.token_ids) for c in first.outputs)


def test_preemption_keeps_the_grammar_state(tiny_model_dir):
    """With a KV pool too small for all requests, some are preempted and recomputed mid-generation: their
    outputs are the same as without preemption and still match the schema."""
    spec = StructuredOutputsParams(json=PERSON, disable_any_whitespace=True)
    prompts = [f"The quick brown fox {i}" for i in range(6)]
    params = [constrained(spec, temperature=0.0, max_tokens=200) for _ in prompts]
    roomy = LLM(tiny_model_dir("llama"), max_model_len=512, dtype="float32")
    expected = [o.outputs[0].text for o in roomy.generate(prompts, params)]
    tight = LLM(tiny_model_dir("llama"), max_model_len=512, dtype="float32", num_gpu_blocks_override=40,
                block_size=8)
    got = [o.outputs[0].text for o in tight.generate(prompts, params)]
    assert tight.engine.scheduler.num_preemptions_total > 0
    assert got == expected
    for text in got:
        jsonschema.validate(json.loads(text), PERSON)
        assert text == json.dumps(json.loads(text), ensure_ascii=False)  # no whitespace beyond ", " and ": "


def test_bad_grammars_are_invalid_requests(llm):
    with pytest.raises(InvalidRequestError, match="regex cannot be compiled"):
        llm.generate("x", constrained(StructuredOutputsParams(regex="(ab")))
    with pytest.raises(InvalidRequestError, match="'not'"):
        llm.generate("x", constrained(StructuredOutputsParams(json={"not": {"type": "string"}})))
    with pytest.raises(InvalidRequestError, match="Rule \"foo\" is not defined"):
        llm.generate("x", constrained(StructuredOutputsParams(grammar="root ::= foo")))
    assert llm.generate("x", SamplingParams(max_tokens=2))[0].outputs[0].token_ids  # the engine goes on


def test_a_grammar_that_dead_ends_fails_instead_of_passing_its_cut_text_as_complete(llm):
    """After "a" this grammar allows no token (an empty character class): the request fails with a 400 naming
    it (it ended "stop" with the text "a", which breaks the grammar); the engine goes on, no blocks left."""
    spec = StructuredOutputsParams(grammar='root ::= "a" [^\\x00-\\U0010FFFF]')
    with pytest.raises(InvalidRequestError, match="allows no token after the 1 tokens generated so far"):
        llm.generate("x", constrained(spec, temperature=0.0))
    assert not llm.engine.has_unfinished_requests() and llm.engine.scheduler.kv.usage == 0
    assert llm.generate("x", SamplingParams(max_tokens=2))[0].outputs[0].token_ids


def test_a_request_waits_for_its_grammar_without_kv_blocks(llm):
    """A grammar still compiling holds its request outside the scheduler (no blocks); the others run."""
    engine = llm.engine
    spec = StructuredOutputsParams(regex=r"slow[0-9]{2}")
    gate = __import__("threading").Event()
    for _ in range(NUM_COMPILE_WORKERS):  # every worker is busy: the grammar must queue
        engine.grammar_compiler._executor.submit(gate.wait)
    engine.add_request("waiting", "x", constrained(spec, max_tokens=10))
    engine.add_request("free", "y", SamplingParams(max_tokens=3, ignore_eos=True))
    finished = {}
    for _ in range(5):
        finished.update((o.request_id, o) for o in engine.step() if o.finished)
    assert "free" in finished and "waiting" not in finished
    assert len(engine.grammar_admission) == 1 and "waiting" not in engine.scheduler.requests
    gate.set()
    while engine.has_unfinished_requests():
        finished.update((o.request_id, o) for o in engine.step() if o.finished)
    assert finished["waiting"].outputs[0].text.startswith("slow")


def test_compile_time_limit_and_abort_while_waiting(tiny_model_dir):
    """A grammar still compiling after compile_timeout_s fails its request with a 400-type error; a request
    aborted while its grammar compiles leaves nothing behind; the engine serves the others throughout."""
    llm = LLM(tiny_model_dir("llama"), max_model_len=256, dtype="float32",
              structured_outputs_config='{"backend": "xgrammar", "compile_timeout_s": 0.3}')
    engine = llm.engine
    gate = threading.Event()
    for _ in range(NUM_COMPILE_WORKERS):  # every worker is taken (by jobs no time limit applies to): nothing compiles
        engine.grammar_compiler._executor.submit(gate.wait)
    try:
        with pytest.raises(InvalidRequestError, match="took longer than 0.3 s"):
            llm.generate("x", constrained(StructuredOutputsParams(regex="[a-c]{4}")))
        engine.add_request("aborted", "x", constrained(StructuredOutputsParams(regex="[d-f]{4}")))
        assert len(engine.grammar_admission) == 1
        engine.abort_request(["aborted"])
        assert len(engine.grammar_admission) == 0 and not engine.has_unfinished_requests()
        assert llm.generate("y", SamplingParams(max_tokens=3, ignore_eos=True))[0].outputs[0].token_ids
    finally:
        gate.set()
    assert engine.take_failed() == {}
    assert re.fullmatch("[d-f]{4}", llm.generate("x", constrained(StructuredOutputsParams(regex="[d-f]{4}")))[0]
                        .outputs[0].text)


def test_offline_chat_passes_tools_and_tool_calls_to_the_template(llm):
    """LLM.chat(tools=...) as vLLM's; an assistant's tool-call arguments reach the template as an object."""
    tokenizer = llm.get_tokenizer()
    original = tokenizer.chat_template
    tokenizer.chat_template = ("{% for t in tools %}[{{ t.function.name }}]{% endfor %}{% for m in messages %}"
                               "{% for c in m.tool_calls or [] %}{{ c.function.arguments.city }}{% endfor %}"
                               "{{ m.content or '' }}{% endfor %}")
    try:
        conversation = [{"role": "user", "content": "hi"},
                        {"role": "assistant", "content": None, "tool_calls": [
                            {"id": "call_1", "type": "function",
                             "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]}]
        tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
        ids = llm.apply_chat_template(conversation, chat_template_kwargs={"tools": tools})
        assert tokenizer.decode(ids) == "[get_weather]hiOslo"
        output = llm.chat(conversation, SamplingParams(max_tokens=2, ignore_eos=True), tools=tools)[0]
        assert output.prompt_token_ids == ids
    finally:
        tokenizer.chat_template = original


def slow_compiles(monkeypatch) -> tuple[threading.Event, list[str]]:
    """Regexes starting with "slow" compile only once the returned event is set (or after 30 s); the list records
    every regex compiled."""
    from pagedserve.structured import compiler as compiler_module

    release = threading.Event()
    real = compiler_module._compile_kind
    compiled: list[str] = []

    def slow_for_some(compiler, params):
        compiled.append(params.regex)
        if params.regex.startswith("slow"):
            release.wait(30)
        return real(compiler, params)

    monkeypatch.setattr(compiler_module, "_compile_kind", slow_for_some)
    return release, compiled


def test_grammars_past_the_time_limit_hold_up_no_other(tiny_model_dir, monkeypatch):
    """As many grammars as there are workers compile for far longer than compile_timeout_s (a 60,000-value enum
    compiled for minutes): each fails at the limit, the next grammars compile at once on fresh threads, and the
    same slow grammar asked again fails from the cache without compiling again, until its compile, run on in the
    background, returns: from then on it is served from the cache (a busy box made it slow, and a grammar
    refused until a restart is what QA saw)."""
    from pagedserve.engine.setup import load_tokenizer
    from pagedserve.structured.compiler import GrammarCompiler

    release, compiled = slow_compiles(monkeypatch)
    grammars = GrammarCompiler(load_tokenizer(tiny_model_dir("llama")), 512, compile_timeout_s=0.5)
    try:
        slow = [grammars.submit(StructuredOutputsParams(regex=f"slow{i}+")) for i in range(NUM_COMPILE_WORKERS)]
        quick = [grammars.submit(StructuredOutputsParams(regex=f"[a-c]{{{n}}}")) for n in (1, 2, 3)]
        for future in quick:
            assert future.result(timeout=20) is not None
        for future in slow:
            with pytest.raises(InvalidRequestError, match="took longer than 0.5 s"):
                future.result(timeout=5)
        again = grammars.submit(StructuredOutputsParams(regex="slow0+"))
        assert again.done() and compiled.count("slow0+") == 1
        release.set()
        deadline = time.monotonic() + 20
        while grammars._executor.num_abandoned and time.monotonic() < deadline:
            time.sleep(0.01)
        for i in range(NUM_COMPILE_WORKERS):
            late = grammars.submit(StructuredOutputsParams(regex=f"slow{i}+"))
            assert late.done() and late.result() is not None and compiled.count(f"slow{i}+") == 1
    finally:
        release.set()


def test_a_grammar_late_and_larger_than_the_cache_is_refused_without_compiling_again(tiny_model_dir, monkeypatch):
    """Compiled past the time limit and larger than the whole grammar cache (a 60,000-value enum: ~90 s on 2 cores),
    a grammar is never ready in time: each retry compiled it again for minutes on a worker and got the same 400
    telling it to retry later (QA-F). After the second such compile it is refused at once, naming the fix; a
    grammar compiled in time is served even when too large to keep."""
    from pagedserve.engine.setup import load_tokenizer
    from pagedserve.structured.compiler import GrammarCompiler

    release, compiled = slow_compiles(monkeypatch)
    from pagedserve.structured import compiler as compiler_module

    monkeypatch.setattr(compiler_module, "GRAMMAR_CACHE_BYTES", 1)  # every grammar is larger than the cache
    grammars = GrammarCompiler(load_tokenizer(tiny_model_dir("llama")), 512, compile_timeout_s=0.5)
    try:
        for times in (1, 2):  # once may have been a busy moment of the box: it is compiled again
            release.clear()
            with pytest.raises(InvalidRequestError, match="took longer than 0.5 s"):
                grammars.submit(StructuredOutputsParams(regex="slow+")).result(timeout=5)
            release.set()
            deadline = time.monotonic() + 20
            while grammars._executor.num_abandoned and time.monotonic() < deadline:
                time.sleep(0.01)
            assert compiled.count("slow+") == times
        with pytest.raises(InvalidRequestError, match="never ready in time: simplify the schema") as info:
            grammars.submit(StructuredOutputsParams(regex="slow+", param="response_format"))
        assert info.value.param == "response_format" and compiled.count("slow+") == 2
        assert grammars.submit(StructuredOutputsParams(regex="[a-c]{2}")).result(timeout=20) is not None
    finally:
        release.set()


def test_the_grammar_cache_is_bounded_by_bytes(tiny_model_dir, monkeypatch):
    """Compiled grammars are kept up to GRAMMAR_CACHE_BYTES, least recently used dropped first, and one larger
    than the whole budget is not kept: a client sending 100,000-value choices grew the server by 230 MB a request
    for up to 256 of them (QA-U)."""
    from pagedserve.engine.setup import load_tokenizer
    from pagedserve.structured import compiler as compiler_module
    from pagedserve.structured.compiler import GrammarCompiler

    grammars = GrammarCompiler(load_tokenizer(tiny_model_dir("llama")), 512)
    choice = lambda i, n=20: StructuredOutputsParams(choice=[f"v{i}x{j}" for j in range(n)])  # noqa: E731

    def compile_and_count(params):  # the bytes are counted by the Future's callback, just after its result
        size = grammars.compile(params).xgrammar.memory_size_bytes
        deadline = time.monotonic() + 10
        while params.key in grammars._cache and params.key not in grammars._sizes and time.monotonic() < deadline:
            time.sleep(0.001)
        return size

    one = compile_and_count(choice(0))
    assert one > 0 and grammars.cached_bytes == one
    budget = 3 * one + one // 2
    monkeypatch.setattr(compiler_module, "GRAMMAR_CACHE_BYTES", budget)
    for i in range(1, 6):
        compile_and_count(choice(i))
        assert 0 < grammars.cached_bytes <= budget
    assert choice(5).key in grammars._cache and grammars.submit(choice(5)).done()  # the latest ones are kept
    assert choice(0).key not in grammars._cache  # the oldest was dropped: compiled again when asked again
    big = choice(99, n=2000)
    assert compile_and_count(big) > budget
    assert big.key not in grammars._cache and grammars.cached_bytes <= budget
    assert choice(5).key in grammars._cache  # the one too large for the budget did not flush the others


def test_an_idle_engine_holds_no_finished_request_grammar(llm, monkeypatch):
    """Going idle, the runner drops the finished requests' state at once, so a grammar the cache does not keep is
    freed and counted for the idle trim (QA-G: the last constrained request's state, with its 100+ MiB compiled
    grammar, stayed until the next step, which an idle server may not run for hours)."""
    from pagedserve.structured import compiler as compiler_module

    monkeypatch.setattr(compiler_module, "GRAMMAR_CACHE_BYTES", 0)  # no grammar is kept by the cache
    engine = llm.llm_engine
    freed: list[int] = []  # the bytes of each compiled grammar freed (the step's after_step takes the total)
    monkeypatch.setattr(engine.grammar_compiler, "_count_freed", freed.append)
    llm.generate(["Pick one:"], constrained(StructuredOutputsParams(choice=["idle-a", "idle-b"]), max_tokens=8))
    assert not engine.has_unfinished_requests() and not engine.runner.states
    assert len(freed) == 1 and freed[0] > 0


def test_structural_tags_as_vllm_takes_them(llm):
    """xgrammar's structural tag (vLLM's structural_tag, or response_format {"type": "structural_tag", ...}): a
    format that forces a tagged call, and the older structures-with-triggers form, whose text is free until a
    trigger; a tag without its parts is a 400 naming it."""
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
              "additionalProperties": False}
    # (a regex inside: xgrammar's JSON inside a structural tag allows any whitespace, which a random model writes)
    forced = {"type": "structural_tag", "format": {"type": "sequence", "elements": [
        {"type": "const_string", "value": "<f>"}, {"type": "regex", "pattern": r'\{"a": [0-9]{1,3}\}'},
        {"type": "const_string", "value": "</f>"}]}}
    triggered = {"type": "structural_tag", "structures": [{"begin": "<f>", "schema": schema, "end": "</f>"}],
                 "triggers": ["<f>"]}
    specs = [StructuredOutputsParams(structural_tag=json.dumps(forced)),
             StructuredOutputsParams.from_response_format(forced),
             StructuredOutputsParams(structural_tag=triggered)]
    outputs = llm.generate(["x"] * 3, [constrained(s, seed=i, max_tokens=60) for i, s in enumerate(specs)])
    for output in outputs[:2]:
        text = output.outputs[0].text
        assert output.outputs[0].finish_reason == "stop" and text.startswith("<f>") and text.endswith("</f>"), text
        jsonschema.validate(json.loads(text[3:-4]), schema)
    for call in re.findall(r"<f>(.*?)</f>", outputs[2].outputs[0].text, flags=re.S):  # free text around calls
        jsonschema.validate(json.loads(call), schema)
    with pytest.raises(ValueError, match="structural tag cannot be compiled: a structural tag's structures each "
                                         "need begin, schema and end"):
        llm.generate("x", constrained(StructuredOutputsParams(structural_tag={"structures": [{"begin": "<f>"}],
                                                                              "triggers": ["<f>"]})))
    with pytest.raises(ValueError, match="the structural tag is not valid JSON"):
        StructuredOutputsParams(structural_tag="{not json")


def test_grammars_freed_while_idle_are_trimmed(llm, monkeypatch):
    """A compile given up at its time limit returns while the server is idle, and a grammar too large for the cache
    is freed then: the idle tick trims the heap for it (it waited for the next step, QA-G)."""
    engine = llm.llm_engine
    memory = engine.resident_memory
    assert memory is not None and not engine.has_unfinished_requests()
    trims = memory.num_trims
    engine.idle()
    assert memory.num_trims == trims  # nothing freed: no trim
    engine.grammar_compiler._count_freed(64 << 20)  # a 64 MiB grammar's end, as its finalizer counts it
    engine.idle()
    assert memory.num_trims == trims + 1 and engine.grammar_compiler.take_freed_bytes() == 0


def test_special_draft_ids_end_the_valid_drafts_without_asking_xgrammar(tiny_model_dir, capfd):
    """A draft model proposes padding ids past the tokenizer's vocabulary (the tiny tokenizer has 453 tokens, the
    model 512 rows): they end the valid drafts as a refused token does, and xgrammar, which writes a warning to
    stderr for each special id offered to a matcher ("cannot accept special token id"), is not asked (QA-AB: one
    line per such draft on a busy server)."""
    from pagedserve.engine.setup import load_tokenizer
    from pagedserve.structured.compiler import GrammarCompiler
    from pagedserve.structured.matcher import RequestGrammar

    tokenizer = load_tokenizer(tiny_model_dir("llama"))
    compiled = GrammarCompiler(tokenizer, 512).compile(StructuredOutputsParams(regex="[a-z ]+"))
    assert 454 in compiled.special_ids and tokenizer.eos_token_id not in compiled.special_ids
    grammar = RequestGrammar(compiled, [tokenizer.eos_token_id])
    letters = tokenizer.encode("hello there", add_special_tokens=False)
    capfd.readouterr()
    assert grammar.num_valid_drafts(letters + [454] + letters) == len(letters)
    assert grammar.num_valid_drafts([454]) == 0
    assert "special token" not in capfd.readouterr().err
    assert all(grammar.accept(t) for t in letters)  # the drafts moved nothing: the grammar is where it was
