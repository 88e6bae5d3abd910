"""The runner's LoRA collaborator: registered adapters, their host LRU, the device slots and
the ops, turned into one ``LoRABatch`` per step."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine_worker.backends.base import stack_lora_dtype
from engine_worker.lora.adapter import LoRAModelSpec
from engine_worker.lora.cache import LoRAAdapterCache
from engine_worker.lora.config import LoRAConfig
from engine_worker.lora.ops import LoRAGroups, LoRAOps, lora_ops_for
from engine_worker.lora.request import LoRARequest
from engine_worker.lora.slots import LoRABatch, LoRASlots


@dataclass(frozen=True, slots=True)
class LoRAStats:
    """The engine's adapters at one moment: what a router places by (its load report) and
    what its metrics count. Counts and times are running totals."""

    max_loras: int  # adapters one step can run
    running_adapters: tuple[str, ...]  # distinct adapters of running requests
    waiting_adapters: tuple[str, ...]  # ... and of waiting ones
    loaded_adapters: tuple[str, ...]  # in host memory, least recently used first
    num_adapter_loads: int  # adapters read from their path (registering included)
    num_slot_loads: int  # adapters written into a step slot
    adapter_load_s: float  # the time all those reads took

    @property
    def mean_load_s(self) -> float:
        """One read's mean time (0: none yet)."""
        return self.adapter_load_s / self.num_adapter_loads if self.num_adapter_loads else 0.0


@dataclass(frozen=True, slots=True)
class LoRARegistry:
    """Rank 0's registered adapters, as plain data: what the other tensor-parallel ranks are
    sent before a step whenever they changed."""

    requests: tuple[LoRARequest, ...]


class LoRAManager:
    def __init__(self, cache: LoRAAdapterCache, slots: LoRASlots, ops: LoRAOps,
                 device: torch.device) -> None:
        self.cache = cache
        self.slots = slots
        self.ops = ops
        self.device = device

    @classmethod
    def for_model(cls, model: torch.nn.Module, config: LoRAConfig, backend_name: str,
                  dtype: torch.dtype, device: torch.device) -> LoRAManager:
        projections = model.lora_projections()
        # adapters are checked against the whole model; the slots hold this rank's part
        spec = LoRAModelSpec(num_layers=model.cfg.num_layers,
                             modules={m: (i, o) for mods in
                                      model.lora_projections(whole=True).values()
                                      for m, i, o in mods})
        ops = lora_ops_for(backend_name)
        # a fused layer stack that runs LoRA takes its slots in its activation dtype (fp32
        # on AVX2 under a bf16 model), in the layout of the backend's pair
        stack_dtype = stack_lora_dtype(getattr(model, "layer_stack", None))
        if stack_dtype is not None and ops.b_rank_major:
            dtype = stack_dtype
        return cls(LoRAAdapterCache(spec, config.max_lora_rank, config.max_cpu_loras),
                   LoRASlots(projections, model.cfg.num_layers, config.max_loras,
                             config.max_lora_rank, dtype, device, ops.b_rank_major,
                             shard=model.lora_shard),
                   ops, device)

    def remove(self, name: str) -> bool:
        self.slots.forget(name)
        return self.cache.remove(name)

    def registry(self) -> LoRARegistry:
        """The registered adapters, for the other tensor-parallel ranks (``sync``)."""
        return LoRARegistry(tuple(self.cache.registered.values()))

    def sync(self, registry: LoRARegistry) -> None:
        """On another rank: register what rank 0 has (each adapter is read from its path
        when a step first needs it, and sliced to this rank); drop what it dropped."""
        wanted = {r.lora_name: r for r in registry.requests}
        for name, request in list(self.cache.registered.items()):
            if wanted.get(name) != request:
                self.remove(name)
        for name, request in wanted.items():
            self.cache.registered.setdefault(name, request)

    def stats(self, running: Sequence[str], waiting: Sequence[str]) -> LoRAStats:
        """Now, given the adapters of the running and waiting requests (the scheduler's)."""
        return LoRAStats(max_loras=len(self.slots.names) - 1,
                         running_adapters=tuple(running), waiting_adapters=tuple(waiting),
                         loaded_adapters=tuple(self.cache.loaded_names),
                         num_adapter_loads=self.cache.num_loads,
                         num_slot_loads=self.slots.num_slot_loads,
                         adapter_load_s=self.cache.load_s)

    def step_slots(self, lora_names: Sequence[str | None], counts: Sequence[int]
                   ) -> list[int] | None:
        """Each token's slot this step (0: base), its adapters placed in slots first;
        ``lora_names[i]``: the adapter of the step's request i (None: base), which runs
        ``counts[i]`` tokens, requests in step order. None when every token runs the base."""
        names = list(dict.fromkeys(n for n in lora_names if n is not None))
        if not names:
            return None
        adapters = [self.cache.get(n, keep=names) for n in names]
        slot_of = self.slots.activate(adapters)
        return [slot_of[name] if name is not None else 0
                for name, n in zip(lora_names, counts) for _ in range(n)]

    def batch(self, token_slots: list[int]) -> LoRABatch | None:
        return self.slots.batch(token_slots, self.ops, self.device)

    @property
    def graph_ready(self) -> bool:
        return self.ops.graph_ready

    def graph_batch(self, token_slots: torch.Tensor) -> LoRABatch:
        """The view a CUDA graph records: every slot's stacks (fixed addresses) and a fixed
        ``token_slots`` buffer [padded] the decoder fills before each replay (only for a
        ``graph_ready`` pair, which reads nothing else)."""
        assert self.ops.graph_ready, f"the {self.ops.name} LoRA pair is not graph-ready"
        return LoRABatch(self.slots.a, self.slots.b,
                         LoRAGroups(token_slots.shape[0], (), token_slots), self.ops,
                         self.slots.slices)
