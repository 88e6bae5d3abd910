"""Linear layers whose matmul is picked once per engine.

``torch`` is ``F.linear``. ``cpu`` sends few-row inputs (decode at small batch, where a linear
layer is a stream over its weights) to the bf16 kernel in ``csrc/cpu/linear.cpp`` and the rest
to ``F.linear`` (oneDNN), which wins once there are enough rows to reuse each weight load.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

LinearFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]

SKINNY_MAX_ROWS = 8


def cpu_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    # x: [num_tokens, in_features] -> [num_tokens, out_features]
    if x.shape[0] <= SKINNY_MAX_ROWS and x.dtype == torch.bfloat16 and x.shape[1] % 32 == 0:
        return torch.ops.quire.skinny_linear(x, weight, bias)
    return F.linear(x, weight, bias)


LINEAR_KERNELS: dict[str, LinearFn] = {"torch": F.linear, "cpu": cpu_linear}


class Linear(nn.Linear):
    """``nn.Linear`` (same parameters, same checkpoint names) with a chosen matmul."""

    def __init__(self, in_features: int, out_features: int, bias: bool,
                 kernel: LinearFn = F.linear) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.kernel = kernel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernel(x, self.weight, self.bias)
