"""--generation-config / --override-generation-config (engine/setup.py's default_sampling): the sampling defaults a
request that leaves them out takes, read from generation_config.json as vLLM reads them."""

from __future__ import annotations

import json

import pytest

from pagedserve.engine.setup import default_sampling, parse_generation_overrides
from pagedserve.entrypoints.openai.protocol import ChatCompletionRequest

QWEN = {"bos_token_id": 151643, "do_sample": True, "eos_token_id": [151645, 151643], "pad_token_id": 151643,
        "repetition_penalty": 1.05, "temperature": 0.7, "top_p": 0.8, "top_k": 20, "max_new_tokens": 2048}


@pytest.fixture
def model_dir(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps(QWEN))
    return str(tmp_path)


def test_auto_takes_the_model_s_sampling_fields_and_nothing_else(model_dir, tmp_path):
    assert default_sampling(model_dir) == {"repetition_penalty": 1.05, "temperature": 0.7, "top_p": 0.8, "top_k": 20,
                                           "max_tokens": 2048}
    assert default_sampling(model_dir, "vllm") == {}
    assert default_sampling(str(tmp_path / "model.gguf")) == {}  # a GGUF file: no generation_config.json
    other = tmp_path / "other"
    other.mkdir()
    (other / "generation_config.json").write_text('{"temperature": 0.3}')
    assert default_sampling(model_dir, str(other)) == {"temperature": 0.3}  # a folder's, instead of the model's
    assert default_sampling(model_dir, "auto", {"temperature": 0.0})["temperature"] == 0.0  # overrides win


def test_max_new_tokens_caps_every_request_where_vllm_makes_it_a_cap(model_dir, tmp_path):
    """vLLM's override_max_tokens: the model's own max_new_tokens (auto) is only a default; a --generation-config
    folder's, or --override-generation-config's, caps every request's max_tokens."""
    from pagedserve.engine.arg_utils import EngineArgs
    from pagedserve.engine.setup import generation_max_tokens_cap

    def cap(source: str = "auto", overrides: str | None = None) -> int | None:
        args = EngineArgs(model=model_dir, generation_config=source, override_generation_config=overrides)
        return generation_max_tokens_cap(args, default_sampling(model_dir, source, parse_generation_overrides(overrides)))

    assert cap() is None and cap("vllm") is None
    assert cap(model_dir) == 2048  # the same file, given as a folder
    assert cap("auto", '{"max_new_tokens": 5}') == 5 and cap("vllm", '{"max_new_tokens": 6}') == 6
    assert cap("auto", '{"temperature": 0.5}') is None
    assert cap(model_dir, '{"max_new_tokens": 7}') == 7


@pytest.mark.parametrize("text", ['{"temperature": 0.1,', "[1, 2]"])
def test_a_damaged_generation_config_is_refused_naming_it(tmp_path, text):
    """Read as none, its defaults and extra EOS ids were dropped without a word (vLLM falls back quietly too)."""
    from pagedserve.engine.setup import generation_config_eos_ids
    from pagedserve.formats.errors import ModelValidationError

    (tmp_path / "generation_config.json").write_text(text)
    for read in (lambda: default_sampling(str(tmp_path)), lambda: generation_config_eos_ids(str(tmp_path), 2)):
        with pytest.raises(ModelValidationError, match="generation_config.json .*delete it to serve without"):
            read()
    assert default_sampling(str(tmp_path), "vllm") == {}  # --generation-config vllm does not read it


def test_overrides_are_checked_by_name_and_value():
    assert parse_generation_overrides(None) == {} and parse_generation_overrides('{"top_k": 5}') == {"top_k": 5}
    for text, message in (("[1]", "must be a JSON object"), ("{", "must be a JSON object"),
                          ('{"do_sample": false}', "do_sample cannot be set there")):
        with pytest.raises(ValueError, match=message):
            parse_generation_overrides(text)
    with pytest.raises(ValueError, match="temperature must be"):
        default_sampling("", "vllm", {"temperature": -1})
    with pytest.raises(ValueError, match="max_new_tokens must be >= 1"):  # the name the user wrote
        default_sampling("", "vllm", {"max_new_tokens": 0})


def test_a_request_s_own_values_win_over_the_defaults():
    defaults = {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05}
    left_out = ChatCompletionRequest(messages=[{"role": "user", "content": "x"}]).sampling_params(8, None, None, defaults)
    assert (left_out.temperature, left_out.top_p, left_out.top_k, left_out.repetition_penalty) == (0.7, 0.8, 20, 1.05)
    given = ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], temperature=0, top_p=1.0, top_k=0,
                                  repetition_penalty=1.0).sampling_params(8, None, None, defaults)
    assert (given.temperature, given.top_p, given.top_k, given.repetition_penalty) == (0, 1.0, 0, 1.0)
    neutral = ChatCompletionRequest(messages=[{"role": "user", "content": "x"}]).sampling_params(8, None)
    assert (neutral.temperature, neutral.top_p, neutral.top_k, neutral.repetition_penalty) == (1.0, 1.0, 0, 1.0)
