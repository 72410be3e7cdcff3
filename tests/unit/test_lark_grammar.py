"""Lark grammars in `grammar` (structured/lark.py), as vLLM takes them: rewritten to xgrammar's EBNF, accepting what
the Lark grammar accepts; what EBNF cannot say the same way is a 400 naming it."""

from __future__ import annotations

import pytest
import xgrammar as xgr
from xgrammar.testing import _is_grammar_accept_string as accepts

from pagedserve.exceptions import InvalidRequestError
from pagedserve.structured.lark import looks_like_lark
from pagedserve.structured.params import StructuredOutputsParams

LARK = """// an answer, Lark's way
?start: answer
answer: "yes" | 'no' | number   // a comment after a rule
      | "it's" " " word
number.2: DIGIT+
DIGIT: "0".."9"
word: ("a".."z")+ | "//"
"""


def test_a_lark_grammar_is_rewritten_to_the_same_language():
    params = StructuredOutputsParams(grammar=LARK)
    assert params.kind == "grammar" and "::=" in params.grammar
    grammar = xgr.Grammar.from_ebnf(params.grammar)
    for text in ("yes", "no", "2026", "it's fine", "it's //"):
        assert accepts(grammar, text), text
    for text in ("maybe", "it's", "12a", "YES", "it's Fine"):
        assert not accepts(grammar, text), text


def test_only_grammars_without_ebnf_rules_are_read_as_lark():
    assert looks_like_lark('start: "yes" | "no"') and looks_like_lark("a: b\nb: \"x\"")
    assert not looks_like_lark('root ::= "a" | "b"') and not looks_like_lark('root ::= x\nx ::= "a:b"')
    ebnf = 'root ::= "a:" [0-9]'
    assert StructuredOutputsParams(grammar=ebnf).grammar == ebnf  # EBNF passes as given


@pytest.mark.parametrize("grammar, says", [
    ("start: /[a-z]+/", "regular expression"),
    ('%import common.WS\nstart: "a"', "the directive '%import'"),
    ('start: "yes"i', "case-insensitive"),
    ("start: item ~ 3\nitem: \"x\"", "'~' repetition"),
    ('start: "ab".."z"', "needs single characters"),
    ('start: "a\n', "unclosed string"),
])
def test_what_ebnf_cannot_say_is_refused_by_name(grammar, says):
    with pytest.raises(InvalidRequestError, match=says) as info:
        StructuredOutputsParams.from_request({"grammar": grammar})
    assert info.value.param == "structured_outputs"


@pytest.mark.parametrize("grammar, accepted, refused", [
    ('start: "a" ["b"] "c"', ["ac", "abc"], ['a"c', "abbc"]),  # [x] is optional x, not EBNF's character class
    ('start: "yes" -> y | "no" -> n', ["yes", "no"], ["y"]),  # aliases name tree nodes only
    ('start: root "!"\nroot: "ok"', ["ok!"], ["ok"]),  # a rule named root, beside EBNF's own root
    ("start: '\\\"q' | 'it\\'s'", ['"q', "it's"], ['\\"q']),  # escapes inside single quotes
    ('start: "a::=b"', ["a::=b"], []),  # "::=" inside a literal: still Lark
    ('start: "a" |', ["a", ""], ["b"]),  # an empty alternative
    ('start: "x" ( "a" | ) "y"\n  |\n  | "z"', ["xay", "xy", "", "z"], ["x"]),
])
def test_more_of_lark_s_syntax_keeps_its_language(grammar, accepted, refused):
    """Each was found wrong by a QA sweep: `[x]` passed through became a character class (output broke the
    grammar), the others were 400s with xgrammar's parser messages."""
    params = StructuredOutputsParams(grammar=grammar)
    compiled = xgr.Grammar.from_ebnf(params.grammar)
    assert [accepts(compiled, text) for text in accepted] == [True] * len(accepted), params.grammar
    assert [accepts(compiled, text) for text in refused] == [False] * len(refused), params.grammar
