"""Linear layers whose matmul comes from the engine's backend (see ``engine_worker.backends``).

A backend may pre-pack a weight into its own layout once the checkpoint is loaded (oneDNN's
blocked format on CPUs); the packed form is kept beside the plain weight, which stays the
checkpoint tensor, and both are exported as ``LinearWeights`` for fused implementations.
"""

from __future__ import annotations

import torch
from torch import nn

from engine_worker.backends.base import LinearFn, LinearWeights, PackFn


class Linear(nn.Linear):
    """``nn.Linear`` (same parameters, same checkpoint names) with the backend's matmul."""

    def __init__(self, in_features: int, out_features: int, bias: bool,
                 kernel: LinearFn, pack: PackFn) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.kernel = kernel
        self.pack_fn = pack
        self.packed = None

    def pack(self) -> None:
        """After the weights are loaded: let the backend lay them out its way, once."""
        self.packed = self.pack_fn(self.weight)

    def export(self) -> LinearWeights:
        """The loaded (and packed) weights as data, for a backend's fused implementations."""
        return LinearWeights(self.weight, self.bias, self.packed)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernel(x, self.weight, self.bias, self.packed)
