"""Linear layers whose matmul is picked once per engine (see ``layers.kernels``).

A kernel may pre-pack a weight into its own layout once the checkpoint is loaded (oneDNN's
blocked format on CPUs); the packed form is kept beside the plain weight, which stays the
checkpoint tensor.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

# (x, weight, bias, packed weight or None) -> x @ weight.T + bias
LinearFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None, Any], torch.Tensor]
PackFn = Callable[[torch.Tensor], Any]


def torch_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                 packed: Any = None) -> torch.Tensor:
    return F.linear(x, weight, bias)


def no_packing(weight: torch.Tensor) -> None:
    return None


class Linear(nn.Linear):
    """``nn.Linear`` (same parameters, same checkpoint names) with a chosen matmul."""

    def __init__(self, in_features: int, out_features: int, bias: bool,
                 kernel: LinearFn = torch_linear, pack: PackFn = no_packing) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.kernel = kernel
        self.pack_fn = pack
        self.packed = None

    def pack(self) -> None:
        """After the weights are loaded: let the kernel lay them out its way, once."""
        self.packed = self.pack_fn(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernel(x, self.weight, self.bias, self.packed)
