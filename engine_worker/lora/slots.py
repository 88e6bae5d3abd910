"""``max_loras`` adapters in stacked device buffers, and one step's view of them.

Per layer and per fused projection of the model (``qkv_proj`` = q, k, v; ``gate_up_proj`` =
gate, up; ``o_proj``; ``down_proj``) two buffers hold every slot's weights::

    A [num_slots, num_slices * max_rank, in_features]
    B [num_slots, out_features, num_slices * max_rank]   (slice i's rows read only its columns)
      or, for a pair whose B is rank-major (``LoRAOps.b_rank_major``: the CPU kernels), its
      transpose [num_slots, num_slices * max_rank, out_features]

so one shrink and one expand per adapter cover a whole fused projection. Slot 0 is the base
model (all zeros, never multiplied); a rank below ``max_rank`` is padded with zeros, which add
exactly nothing. B holds ``scaling * B``: one multiply fewer per token, and per-module scalings
(PEFT's ``alpha_pattern``) need no per-slice bookkeeping.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace

import torch

from engine_worker.lora.adapter import LoRAAdapter
from engine_worker.lora.ops import LoRAGroups, LoRAOps

# fused projection -> its PEFT modules, in the order their outputs are concatenated
Projections = dict[str, tuple[tuple[str, int, int], ...]]  # (module, in, out)
ShardFn = Callable[[str, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True, slots=True)
class LoRABatch:
    """What the model's projections need in one step: the stacked weights, which tokens use
    which slot, and the ops. ``add`` puts the LoRA delta of one projection onto its output."""

    a: tuple[dict[str, torch.Tensor], ...]  # per layer: projection -> A stack
    b: tuple[dict[str, torch.Tensor], ...]
    groups: LoRAGroups
    ops: LoRAOps
    slices: dict[str, tuple[int, ...]]  # projection -> its parts' output sizes

    @property
    def dtype(self) -> torch.dtype:
        return next(iter(self.a[0].values())).dtype

    def layers(self, start: int, end: int) -> LoRABatch:
        """The batch over layers ``[start, end)`` alone (a pipeline stage's, for its fused
        stack, which numbers its layers from 0)."""
        return replace(self, a=self.a[start:end], b=self.b[start:end])

    def add(self, y: torch.Tensor, x: torch.Tensor, layer: int, projection: str
            ) -> torch.Tensor:
        a = self.a[layer].get(projection)
        if a is not None:
            h = self.ops.shrink(x, a, self.groups)
            self.ops.expand(y, h, self.b[layer][projection], self.groups,
                            self.slices[projection])
        return y


class LoRASlots:
    """Device slots 1..max_loras, reassigned least recently used first."""

    def __init__(self, projections: Projections, num_layers: int, max_loras: int,
                 max_rank: int, dtype: torch.dtype, device: torch.device,
                 b_rank_major: bool = False, shard: ShardFn | None = None) -> None:
        self.projections = projections
        self.shard = shard  # (module, A, B) -> this tensor-parallel rank's parts
        self.max_rank = max_rank
        self.b_rank_major = b_rank_major
        self.slices = {p: tuple(m[2] for m in mods) for p, mods in projections.items()}
        num_slots = max_loras + 1

        def b_stack(mods) -> torch.Tensor:
            out, ranks = sum(m[2] for m in mods), len(mods) * max_rank
            shape = (num_slots, ranks, out) if b_rank_major else (num_slots, out, ranks)
            return torch.zeros(shape, dtype=dtype, device=device)
        self.a = tuple({p: torch.zeros(num_slots, len(mods) * max_rank, mods[0][1],
                                       dtype=dtype, device=device)
                        for p, mods in projections.items()} for _ in range(num_layers))
        self.b = tuple({p: b_stack(mods) for p, mods in projections.items()}
                       for _ in range(num_layers))
        self.names: list[str | None] = [None] * num_slots  # slot -> adapter held
        self._last_used = [0] * num_slots
        self._clock = 0
        self.num_slot_loads = 0  # adapters written into a slot, in all

    def slot_of(self, name: str) -> int | None:
        return self.names.index(name) if name in self.names else None

    def forget(self, name: str) -> None:
        slot = self.slot_of(name)
        if slot is not None:
            self.names[slot] = None

    def activate(self, adapters: Iterable[LoRAAdapter]) -> dict[str, int]:
        """Slots for this step's adapters (at most max_loras of them): those held keep
        theirs, the others take free or least recently used slots not needed now."""
        adapters = list(adapters)
        assert len(adapters) < len(self.names), "more adapters in one step than max_loras"
        self._clock += 1
        wanted = {a.name for a in adapters}
        slots: dict[str, int] = {}
        for adapter in adapters:
            slot = self.slot_of(adapter.name)
            if slot is None:
                slot = min((s for s in range(1, len(self.names))
                            if self.names[s] not in wanted),
                           key=lambda s: (self.names[s] is not None, self._last_used[s]))
                self._write(slot, adapter)
            self._last_used[slot] = self._clock
            slots[adapter.name] = slot
        return slots

    def _write(self, slot: int, adapter: LoRAAdapter) -> None:
        r_max = self.max_rank
        for layer, (a_stacks, b_stacks) in enumerate(zip(self.a, self.b)):
            for projection, modules in self.projections.items():
                a, b = a_stacks[projection][slot], b_stacks[projection][slot]
                if self.b_rank_major:
                    b = b.T  # written through as [out, R], as the other layout
                a.zero_()
                b.zero_()
                out = 0
                for i, (module, _, out_features) in enumerate(modules):
                    weights = adapter.modules.get((layer, module))
                    if weights is not None:
                        lora_a, lora_b = weights.lora_a, weights.lora_b
                        if self.shard is not None:
                            lora_a, lora_b = self.shard(module, lora_a, lora_b)
                        r = lora_a.shape[0]
                        a[i * r_max:i * r_max + r] = lora_a
                        b[out:out + out_features, i * r_max:i * r_max + r] = \
                            lora_b * weights.scaling
                    out += out_features
        self.names[slot] = adapter.name
        self.num_slot_loads += 1

    def batch(self, token_slots: list[int], ops: LoRAOps, device: torch.device
              ) -> LoRABatch | None:
        """The step's view: ``token_slots[t]`` is token t's slot (0: base). None when every
        token runs the base model."""
        present = sorted(set(token_slots) - {0})
        if not present:
            return None
        slots = torch.tensor(token_slots, dtype=torch.int64)
        if len(present) == 1 and 0 not in token_slots:
            groups = ((present[0], None),)
        else:
            groups = tuple((s, (slots == s).nonzero().flatten().to(device)) for s in present)
        return LoRABatch(self.a, self.b,
                         LoRAGroups(len(token_slots), groups, slots.to(device)), ops,
                         self.slices)
