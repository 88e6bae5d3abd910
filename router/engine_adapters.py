"""Which LoRA adapters one engine holds and uses, as the router can tell: the balancer's
``AdapterState`` for a request's adapter on that engine.

Three sources, freshest first:

- the requests the router itself has on the engine (sent, not yet ended), by adapter: they
  hold (or are about to take) a step slot there, and the engine's load report may not show
  them yet;
- the engine's load report: the adapters of its running and waiting requests, its host LRU
  (``loaded_lora_adapters``, a Quire engine's) and ``max_loras`` (a vLLM engine reports the
  first two and ``max_lora`` in ``vllm:lora_requests_info``);
- its KV events: a block stored under an adapter means the adapter ran there just now. For an
  engine that does not report its host LRU (vLLM), the last ``max_loras`` adapters seen there
  stand in for it (vLLM's CPU LRU holds ``max_cpu_loras``, by default ``max_loras``).
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field

from quire.v1 import engine_pb2 as pb
from router.balancer import AdapterState

# Adapters remembered from KV events per engine: far more than any engine's max_loras.
_RECENT = 64


@dataclass(slots=True)
class EngineAdapters:
    """One engine's adapters as the router saw them; only the pool writes it."""

    inflight: Counter = field(default_factory=Counter)  # adapter -> the router's live requests
    recent: OrderedDict = field(default_factory=OrderedDict)  # from KV events, oldest first

    def sent(self, lora_name: str | None) -> None:
        if lora_name:
            self.inflight[lora_name] += 1

    def ended(self, lora_name: str | None) -> None:
        if lora_name:
            self.inflight[lora_name] -= 1
            if self.inflight[lora_name] <= 0:
                del self.inflight[lora_name]

    def stored(self, lora_names: Iterable[str | None]) -> None:
        """Blocks were stored under these adapters (the engine's KV events)."""
        for name in lora_names:
            if name:
                self.recent[name] = None
                self.recent.move_to_end(name)
        while len(self.recent) > _RECENT:
            self.recent.popitem(last=False)

    def in_use(self, load: pb.LoadReport | None) -> set[str]:
        """Adapters whose requests run or wait there (each holds, or will, a step slot)."""
        found = set(self.inflight)
        if load is not None:
            found.update(load.running_lora_adapters, load.waiting_lora_adapters)
        return found

    def state(self, lora_name: str, load: pb.LoadReport | None, *, max_loras: int,
              load_s: float, slot_wait_s: float) -> AdapterState:
        """``lora_name`` on this engine. ``max_loras``: its step slots (the load report's
        when it says, else this); ``load_s``: the least a read is priced at (the engine's
        measured read time when longer): a read also pushes another adapter out of host
        memory, to be read again later, and a price that jumps with every noisy measurement
        of a small adapter would move adapters back and forth."""
        in_use = self.in_use(load)
        slots = (load.max_loras if load is not None and load.max_loras else max_loras) or 1
        if load is not None and load.loaded_lora_adapters:
            loaded = lora_name in load.loaded_lora_adapters
        else:  # no host LRU reported: the adapters that ran there last stand in for it
            loaded = lora_name in list(self.recent)[-slots:]
        measured = load.lora_adapter_load_s if load is not None else 0.0
        return AdapterState(in_use=lora_name in in_use, loaded=loaded or lora_name in in_use,
                            free_slots=slots - len(in_use - {lora_name}),
                            load_s=max(measured, load_s), slot_wait_s=slot_wait_s)
