"""The error a model path that cannot be served raises, from the format readers up to `models/validate.py`."""

from __future__ import annotations

LOCAL_MODEL_HINT = "Pass --model a Hugging Face model directory (with config.json) or a .gguf file"
REDOWNLOAD_HINT = "The download was probably interrupted: delete it and download it again"


class ModelValidationError(ValueError):
    """A model path that cannot be served; the message names the problem and the fix."""
