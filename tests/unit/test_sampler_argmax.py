"""argmax_rows (the sampler's greedy pick) against torch's argmax: the same index on ties and with NaN."""

from __future__ import annotations

import pytest
import torch

from pagedserve.layers.sampler import argmax_rows


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_argmax_rows_picks_what_argmax_picks(dtype):
    generator = torch.Generator().manual_seed(0)
    for width in (1, 7, 1000, 4099):
        x = torch.randint(-3, 4, (9, width), generator=generator).to(dtype)  # many ties per row
        x[1] = 2.0  # a row of one value: the first index
        if width > 5:
            x[2, 5] = float("nan")  # NaN counts as the maximum, as in argmax
            x[3, width - 1] = float("inf")
        assert torch.equal(argmax_rows(x), x.argmax(dim=-1)), width
    assert argmax_rows(torch.tensor([[0.0, 3.0, 3.0]])).tolist() == [1]
