"""Building models without random initialisation: their weights come from the checkpoint."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from torch import nn

# The torch layers whose constructors initialise their parameters (reset_parameters).
_LAYERS = (nn.Linear, nn.Embedding, nn.LayerNorm)


@contextlib.contextmanager
def skip_init() -> Iterator[None]:
    """Construct torch layers without initialising their parameters. Besides the wasted work, initialising on the
    meta device goes through torch's reference ops, which import torch._dynamo and, with it, triton where it is
    installed: ~1 s of start-up and 65 MiB resident (an embedding model's BERT layers took that path)."""
    saved = {cls: cls.reset_parameters for cls in _LAYERS}
    for cls in saved:
        cls.reset_parameters = lambda self: None
    try:
        yield
    finally:
        for cls, method in saved.items():
            cls.reset_parameters = method
