"""The ``triton`` backend: Triton paged attention (``attention/triton_backend.py``) for the
whole varlen step, with the reference ops for the rest of the layer (cuBLAS matmuls through
``F.linear`` on a GPU). The default on CUDA. On a CPU it runs only under Triton's interpreter
(``TRITON_INTERPRET=1``), which is how the tests check it without a GPU."""

from __future__ import annotations

import dataclasses

import torch

from engine_worker.backends.base import Backend
from engine_worker.backends.reference import REFERENCE


def unavailable_reason(device: torch.device) -> str | None:
    from engine_worker.attention.triton_backend import interpreting

    try:
        import triton  # noqa: F401
    except ImportError as e:
        return f"triton is not installed ({e})"
    if device.type != "cuda" and not interpreting():
        return f"Triton kernels need a CUDA GPU (or TRITON_INTERPRET=1), the device is {device}"
    return None


def _attention():
    from engine_worker.attention.triton_backend import TritonAttentionBackend

    return TritonAttentionBackend()


class _LazyTritonAttention:
    """Imports triton only when the backend is used (a CPU-only install may lack it)."""

    name = "triton"

    def __init__(self) -> None:
        self._impl = None

    def forward(self, q, k, v, kv_cache, meta, scale):
        if self._impl is None:
            self._impl = _attention()
        return self._impl.forward(q, k, v, kv_cache, meta, scale)


TRITON = dataclasses.replace(REFERENCE, name="triton",
                             description="Triton paged attention, reference ops elsewhere",
                             attention=_LazyTritonAttention(),
                             unavailable_reason=unavailable_reason)


def with_attention(backend: Backend, attention_backend: str) -> Backend:
    """``backend`` with another attention implementation (``--attention-backend``); the fused
    layer stack, which has its own attention inside, is then off."""
    attention = {"torch": REFERENCE.attention, "triton": TRITON.attention}[attention_backend]
    return dataclasses.replace(backend, attention=attention, llama_layers=lambda stack: None,
                               description=f"{backend.description}, {attention_backend} "
                                           "attention")
