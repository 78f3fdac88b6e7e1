"""How a tensor travels: fp32 as it is, or bf16 as its 16-bit pattern (half the bytes). Pure numpy/torch, no Flower.

Library code, called by `frugaltune.federated.client_app` and `server_app` when they build and read the ArrayRecords
of a round (param `federated.transmit_dtype`); unit-tested in tests/unit/test_federated.py.

numpy has no bfloat16, and Flower's Array carries numpy's .npy bytes, so a bf16 tensor travels as a uint16 array
holding its bit pattern (torch's `view`, no arithmetic) and is viewed back as bf16 on arrival. The dtype says which:
a trainable tensor is never uint16, so a uint16 array on the wire is always a bf16 pattern, and the receiver needs no
flag of its own. Rounding to bf16 keeps 8 significant bits (relative error <= 2^-9): for adapters it is the
precision a bf16 run trains in anyway.
"""

from __future__ import annotations

from typing import Literal

import numpy as np
import torch

TransmitDtype = Literal["fp32", "bf16"]


def encode(tensor: torch.Tensor, dtype: TransmitDtype = "fp32") -> np.ndarray:
    """The numpy array that goes on the wire for `tensor`."""
    tensor = tensor.detach().cpu()
    if dtype == "fp32":
        return tensor.float().numpy()
    if dtype == "bf16":
        return tensor.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    raise ValueError(f"federated.transmit_dtype: {dtype!r} is not fp32 or bf16")


def decode(array: np.ndarray) -> torch.Tensor:
    """The fp32 tensor a received array stands for (a uint16 array is a bf16 bit pattern)."""
    if array.dtype == np.uint16:
        return torch.from_numpy(array.view(np.int16).copy()).view(torch.bfloat16).float()
    return torch.from_numpy(array.copy())


def round_trip(tensors: dict[str, torch.Tensor], dtype: TransmitDtype) -> dict[str, torch.Tensor]:
    """What the receiver of `tensors` sent as `dtype` holds: the server keeps this as its global, so that its A
    (FFA) and its evaluation are exactly the clients' starting point."""
    return {name: decode(encode(tensor, dtype)) for name, tensor in tensors.items()}
