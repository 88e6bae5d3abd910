"""Model weights in a dtype, as the engine's loader leaves them."""

from __future__ import annotations

import torch


def weights_to(module: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """The parameters in ``dtype``; buffers (the RoPE tables) stay fp32, as the loader keeps
    them. ``module.to(dtype)`` would round the tables too: the per-layer path then takes the
    reference RoPE over bf16 tables and the one-call stack the kernel over their fp32
    widening, and the two differ from layer 0's keys on."""
    with torch.no_grad():
        for p in module.parameters():
            p.data = p.data.to(dtype)
    return module
