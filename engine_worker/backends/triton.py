"""The ``triton`` backend: Triton paged attention (``attention/triton_backend.py``) for the
whole varlen step, AWQ / GPTQ 4-bit weights through the Triton int4 kernel
(``backends/triton_int4.py``), with the reference ops for the rest of the layer (cuBLAS
matmuls through ``F.linear`` on a GPU). The default on CUDA. On a CPU it runs only under
Triton's interpreter (``TRITON_INTERPRET=1``), which is how the tests check it without a GPU."""

from __future__ import annotations

import dataclasses

import torch

from engine_worker.backends.base import Backend
from engine_worker.backends import triton_int4
from engine_worker.backends.reference import REFERENCE
from engine_worker.ops import Unavailable
from engine_worker.weights.int4_layouts import INT4_GROUPS_TYPE


def triton_unavailable_reason(device: torch.device) -> str | None:
    from engine_worker.attention.triton_backend import interpreting

    try:
        import triton  # noqa: F401
    except ImportError as e:
        return f"triton is not installed ({e})"
    if device.type != "cuda" and not interpreting():
        return f"Triton kernels need a CUDA GPU (or TRITON_INTERPRET=1), the device is {device}"
    return None


DESCRIPTION = "Triton paged attention and int4 linear layers, reference ops elsewhere"


def _attention():
    # imported only once the backend is chosen: a CPU-only install may lack triton
    from engine_worker.attention.triton_backend import TritonAttentionBackend

    return TritonAttentionBackend()


def resolve_triton(device: torch.device) -> Backend | Unavailable:
    """The registry's entry: the backend, where Triton runs on ``device``."""
    reason = triton_unavailable_reason(device)
    if reason is not None:
        return Unavailable(reason)
    return dataclasses.replace(REFERENCE, name="triton", description=DESCRIPTION,
                               attention=_attention(), linear=triton_int4.linear,
                               pack_weight=triton_int4.pack_weight,
                               quantized_types=frozenset({INT4_GROUPS_TYPE}))


def with_attention(backend: Backend, attention_backend: str) -> Backend:
    """``backend`` with another attention implementation (``--attention-backend``); the fused
    layer stacks, which have their own attention inside, are then off."""
    attention = REFERENCE.attention if attention_backend == "torch" else _attention()
    return dataclasses.replace(backend, attention=attention, fused_stacks={},
                               description=f"{backend.description}, {attention_backend} "
                                           "attention")
