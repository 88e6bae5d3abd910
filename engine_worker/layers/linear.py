"""Linear layers whose matmul is picked once per engine (see ``layers.kernels``)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

LinearFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]


class Linear(nn.Linear):
    """``nn.Linear`` (same parameters, same checkpoint names) with a chosen matmul."""

    def __init__(self, in_features: int, out_features: int, bias: bool,
                 kernel: LinearFn = F.linear) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.kernel = kernel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernel(x, self.weight, self.bias)
