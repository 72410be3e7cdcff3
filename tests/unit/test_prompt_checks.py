"""engine/prompt_checks.py: the one set of prompt checks the engine and the HTTP layer share (no torch)."""

from __future__ import annotations

import pytest

from pagedserve.engine.prompt_checks import (check_generation_prompt, check_pooling_prompt, check_token_ids,
                                             generation_max_tokens)
from pagedserve.exceptions import InvalidRequestError


def _error(fn, *args, **kwargs) -> InvalidRequestError:
    with pytest.raises(InvalidRequestError) as info:
        fn(*args, **kwargs)
    return info.value


def test_generation_prompt_rules():
    assert _error(check_generation_prompt, [], 16, 100).param == "prompt"
    check_generation_prompt([1] * 15, 16, 100)  # room for one output token
    long = _error(check_generation_prompt, [1] * 16, 16, 100)  # the prompt alone leaves no room: its field
    assert long.param == "prompt" and "maximum context length is 16 tokens" in str(long)
    assert "the prompt is 16 tokens long" in str(long)
    chat = _error(generation_max_tokens, 20, 5, 16, "max_tokens", "messages")
    assert chat.param == "messages" and "the messages are 20 tokens long" in str(chat)
    bad = _error(check_generation_prompt, [1, 100], 16, 100)
    assert (bad.param, str(bad)) == ("prompt", "prompt: token id 100 is out of range [0, 100)")


def test_max_tokens_is_asked_or_what_the_context_leaves():
    assert generation_max_tokens(10, None, 16) == 6
    assert generation_max_tokens(10, 6, 16) == 6
    over = _error(generation_max_tokens, 10, 7, 16, "max_completion_tokens")
    assert over.param == "max_completion_tokens"
    assert str(over) == ("This model's maximum context length is 16 tokens. However, you requested 17 tokens (10 in "
                         "the prompt, 7 for the completion). Please reduce the prompt or max_completion_tokens.")
    assert _error(generation_max_tokens, 10, 0, 16).param == "max_tokens"


def test_pooling_prompt_and_token_id_labels():
    check_pooling_prompt([1] * 16, 16, 100)  # an embedding needs no room for output
    long = _error(check_pooling_prompt, [1] * 17, 16, 100, label="input 2")
    assert long.param == "input" and "However, input 2 has 17 tokens." in str(long)
    assert str(_error(check_pooling_prompt, [100], 16, 100, label="input 0")).startswith("input 0: token id 100")
    assert str(_error(check_token_ids, [-1], 100, "tokens", label="")) == "token id -1 is out of range [0, 100)"
    assert _error(check_token_ids, [5, 200], 100, "logit_bias").param == "logit_bias"
