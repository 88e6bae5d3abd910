"""The batched LoRA pair, punica-style: shrink (``h = x @ A[slot].T``) then expand
(``y += h @ B[slot].T``), each token under its own adapter slot.

A step's tokens come grouped by slot (``LoRAGroups``, built once a step and shared by every
layer), so the reference below runs one matmul pair per adapter present in the step, never a
loop over tokens. B is stored pre-scaled (``scaling * B``, see ``slots``). Kernel sets register
their own pair in ``LORA_OPS`` under their backend's name; a backend without one runs the
reference (it is exact, and only a few adapters' rows are ever multiplied at once).
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


# (x [T, in], A stack [slots, R, in], groups) -> h [T, R] (zero rows for base tokens)
ShrinkFn = Callable[[torch.Tensor, torch.Tensor, LoRAGroups], torch.Tensor]
# (y [T, out] updated in place, h [T, R], B stack [slots, out, R], groups) -> None
ExpandFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, LoRAGroups], None]


@dataclass(frozen=True, slots=True)
class LoRAOps:
    name: str
    shrink: ShrinkFn
    expand: ExpandFn


def shrink_reference(x: torch.Tensor, a: torch.Tensor, groups: LoRAGroups) -> torch.Tensor:
    h = x.new_zeros(x.shape[0], a.shape[1])
    for slot, index in groups.groups:
        if index is None:
            h = x @ a[slot].T
        else:
            h[index] = x[index] @ a[slot].T
    return h


def expand_reference(y: torch.Tensor, h: torch.Tensor, b: torch.Tensor,
                     groups: LoRAGroups) -> None:
    for slot, index in groups.groups:
        if index is None:
            y += h @ b[slot].T
        else:
            y.index_add_(0, index, h[index] @ b[slot].T)


REFERENCE_OPS = LoRAOps("torch", shrink_reference, expand_reference)

# backend name -> its LoRA pair; backends not listed run the reference
LORA_OPS: dict[str, LoRAOps] = {"torch": REFERENCE_OPS}


def lora_ops_for(backend_name: str) -> LoRAOps:
    return LORA_OPS.get(backend_name, REFERENCE_OPS)
