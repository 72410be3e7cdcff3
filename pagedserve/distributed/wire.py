"""What rank 0 sends the other ranks each step: tensors as numpy arrays inside the same dataclasses.

A pickled numpy array costs a memcpy; a pickled torch tensor goes through torch.save (~30 us each). bfloat16
has no numpy dtype, so it travels as its int16 bits.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import torch


@dataclasses.dataclass
class WireTensor:
    array: np.ndarray
    dtype: str  # torch dtype name

    def to_torch(self, device: str) -> torch.Tensor:
        tensor = torch.from_numpy(self.array)
        if self.dtype == "bfloat16":
            tensor = tensor.view(torch.bfloat16)
        return tensor.to(device)


def to_wire(value: Any) -> Any:
    """Tensors (also inside dataclasses, lists and tuples) -> WireTensor; everything else as it is."""
    if isinstance(value, torch.Tensor):
        host = value.detach().cpu().contiguous()
        name = str(host.dtype).removeprefix("torch.")
        array = host.view(torch.int16).numpy() if host.dtype == torch.bfloat16 else host.numpy()
        return WireTensor(array, name)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return type(value)(**{f.name: to_wire(getattr(value, f.name)) for f in dataclasses.fields(value) if f.init})
    if isinstance(value, (list, tuple)):
        return type(value)(to_wire(v) for v in value)
    return value


def from_wire(value: Any, device: str) -> Any:
    """The inverse of to_wire, tensors on `device`."""
    if isinstance(value, WireTensor):
        return value.to_torch(device)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        for f in dataclasses.fields(value):
            if f.init:
                setattr(value, f.name, from_wire(getattr(value, f.name), device))
        return value
    if isinstance(value, (list, tuple)):
        return type(value)(from_wire(v, device) for v in value)
    return value
