"""Sliding-window attention is refused at load unless the window covers max_model_len (no torch)."""

from __future__ import annotations

import pytest

from pagedserve.models.validate import ModelValidationError, check_sliding_window, sliding_window_in_use

MISTRAL_V01 = {"model_type": "mistral", "sliding_window": 4096, "num_hidden_layers": 32}
QWEN25 = {"model_type": "qwen2", "sliding_window": 32768, "use_sliding_window": False, "max_window_layers": 21,
          "num_hidden_layers": 24}


@pytest.mark.parametrize("config,expected", [
    (MISTRAL_V01, 4096),
    ({**MISTRAL_V01, "sliding_window": None}, None),  # Mistral v0.2+: no window
    (QWEN25, None),  # Qwen2.5 ships a sliding_window that use_sliding_window leaves off
    ({**QWEN25, "use_sliding_window": True}, 32768),
    ({**QWEN25, "use_sliding_window": True, "max_window_layers": 24}, None),  # no layer past max_window_layers
    ({"model_type": "llama"}, None),
    ({**MISTRAL_V01, "layer_types": ["full_attention"] * 2}, None),
    ({**MISTRAL_V01, "layer_types": ["full_attention", "sliding_attention"]}, 4096),
])
def test_which_configs_use_a_window(config, expected):
    in_use = sliding_window_in_use(config)
    assert (in_use[0] if in_use else None) == expected


def test_window_shorter_than_max_model_len_is_refused_naming_field_and_fix():
    with pytest.raises(ModelValidationError) as info:
        check_sliding_window(MISTRAL_V01, max_model_len=32768)
    message = str(info.value)
    assert "sliding_window = 4096" in message and "--max-model-len 4096" in message
    with pytest.raises(ModelValidationError, match="use_sliding_window"):
        check_sliding_window({**QWEN25, "use_sliding_window": True}, max_model_len=32769)


def test_window_covering_max_model_len_is_served():
    check_sliding_window(MISTRAL_V01, max_model_len=4096)
    check_sliding_window({**QWEN25, "use_sliding_window": True}, max_model_len=32768)
    check_sliding_window(QWEN25, max_model_len=10**6)
