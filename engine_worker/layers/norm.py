"""RMSNorm (Zhang & Sennrich, 2019), computed in fp32 as the reference implementations do."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # x: [num_tokens, hidden_size]
    dtype = x.dtype
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float,
                 kernel: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor] = rms_norm
                 ) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps
        self.kernel = kernel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernel(x, self.weight, self.eps)
