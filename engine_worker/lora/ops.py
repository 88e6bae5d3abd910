"""The batched LoRA pair, punica-style: shrink (``h = x @ A[slot].T``) then expand
(``y += h @ B[slot].T``), each token under its own adapter slot.

A step's tokens come grouped by slot (``LoRAGroups``, built once a step and shared by every
layer), so the reference below runs one matmul pair per adapter present in the step, never a
loop over tokens. B is stored pre-scaled (``scaling * B``, see ``slots``). Kernel sets register
their own pair in ``LORA_OPS`` under their backend's name (the CPU sets: ``csrc/cpu/lora.cpp``,
per token's slot, ``LoRAGroups.token_slots``); a backend without one runs the reference.

B's layout is the pair's: ``[slots, out, R]`` (the reference's, Triton's) or, where
``LoRAOps.b_rank_major``, ``[slots, R, out]`` (the CPU kernels': each rank row contiguous over
the outputs, so the expand is a vector axpy over them). ``slices``: the output sizes of a
fused projection's parts (q, k, v), whose B is block-diagonal (``slots``); a pair may skip
the zero blocks, which add exactly nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class LoRAGroups:
    """One step's tokens by adapter slot: ``(slot, token indices)`` per adapter present
    (indices None: every token of the step); tokens of the base model are in none."""

    num_tokens: int
    groups: tuple[tuple[int, torch.Tensor | None], ...]
    token_slots: torch.Tensor | None = None  # int64 [num_tokens], what per-token kernels read


# (x [T, in], A stack [slots, R, in], groups) -> h [T, R] (zero rows for base tokens)
ShrinkFn = Callable[[torch.Tensor, torch.Tensor, LoRAGroups], torch.Tensor]
# (y [T, out] updated in place, h [T, R], B stack (the pair's layout), groups, slices) -> None
ExpandFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, LoRAGroups, tuple[int, ...]],
                    None]


@dataclass(frozen=True, slots=True)
class LoRAOps:
    name: str
    shrink: ShrinkFn
    expand: ExpandFn
    b_rank_major: bool = False  # B stacks [slots, R, out] rather than [slots, out, R]
    # reads only ``token_slots`` on the device (never ``groups``' host-built indices), with
    # launches fixed by shapes: a CUDA graph may record it over a fixed slots buffer
    graph_ready: bool = False


def shrink_reference(x: torch.Tensor, a: torch.Tensor, groups: LoRAGroups) -> torch.Tensor:
    h = x.new_zeros(x.shape[0], a.shape[1])
    for slot, index in groups.groups:
        if index is None:
            h = x @ a[slot].T
        else:
            h[index] = x[index] @ a[slot].T
    return h


def expand_reference(y: torch.Tensor, h: torch.Tensor, b: torch.Tensor,
                     groups: LoRAGroups, slices: tuple[int, ...] = ()) -> None:
    for slot, index in groups.groups:
        if index is None:
            y += h @ b[slot].T
        else:
            y.index_add_(0, index, h[index] @ b[slot].T)


REFERENCE_OPS = LoRAOps("torch", shrink_reference, expand_reference)


def compiled_cpu_ops(variant_name: str) -> LoRAOps:
    """The pair of a CPU kernel variant (``csrc/cpu/lora.cpp``); the reference where that
    variant cannot load here."""
    from engine_worker.ops import VARIANTS, Unavailable, load

    kernels = load(VARIANTS[variant_name])
    if isinstance(kernels, Unavailable) or not kernels.has("lora_shrink"):
        return REFERENCE_OPS
    return cpu_kernel_ops(f"cpu-{variant_name}", kernels.ops)


def cpu_kernel_ops(name: str, ops) -> LoRAOps:
    """A CPU kernel set's pair (``csrc/cpu/lora.cpp``: B rank-major, slices skipped)."""
    def shrink(x, a, groups: LoRAGroups):
        return ops.lora_shrink(x, a, groups.token_slots)

    def expand(y, h, b, groups: LoRAGroups, slices: tuple[int, ...] = ()):
        if y.stride(-1) != 1:
            expand_reference(y, h, b.transpose(1, 2), groups)
            return
        ops.lora_expand(y, h, b, groups.token_slots, list(slices))
    return LoRAOps(name, shrink, expand, b_rank_major=True)


def kernel_ops(name: str, ops) -> LoRAOps:
    """A LoRAOps over a torch op namespace holding ``lora_shrink`` / ``lora_expand`` with B
    ``[slots, out, R]`` (the Triton pair)."""
    def shrink(x, a, groups: LoRAGroups):
        return ops.lora_shrink(x, a, groups.token_slots)

    def expand(y, h, b, groups: LoRAGroups, slices: tuple[int, ...] = ()):
        if y.stride(-1) == 1:
            ops.lora_expand(y, h, b, groups.token_slots)
            return
        dense = y.contiguous()  # still graph-ready: a copy each way, no host read
        ops.lora_expand(dense, h, b, groups.token_slots)
        y.copy_(dense)
    return LoRAOps(name, shrink, expand, graph_ready=True)


def triton_ops() -> LoRAOps:
    """The Triton pair (``lora.triton_kernels``), for the GPU path."""
    from engine_worker.lora import triton_kernels

    return kernel_ops("triton", triton_kernels)


# backend name -> how to make its LoRA pair; backends not listed run the reference
LORA_OPS: dict[str, Callable[[], LoRAOps]] = {
    "torch": lambda: REFERENCE_OPS,
    "cpu": lambda: compiled_cpu_ops("avx512"),
    "cpu-avx2": lambda: compiled_cpu_ops("avx2"),
    "triton": triton_ops,
}


def lora_ops_for(backend_name: str) -> LoRAOps:
    make = LORA_OPS.get(backend_name)
    return REFERENCE_OPS if make is None else make()
