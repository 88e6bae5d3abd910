"""Which LoRA adapters one engine holds and uses, as the router can tell: the balancer's
``AdapterState`` for a request's adapter on that engine.

Three sources, freshest first:

- the requests the router itself has on the engine (sent, not yet ended), by adapter: those
  streaming run there (their adapter holds a step slot), those without a first message yet
  wait for one, and the engine's load report may not show either yet;
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

    # adapter -> the router's live requests there: sent, not yet streaming (waiting or in
    # prefill), and streaming (admitted: they run, so their adapter holds a step slot)
    sent_only: Counter = field(default_factory=Counter)
    streaming: Counter = field(default_factory=Counter)
    recent: OrderedDict = field(default_factory=OrderedDict)  # from KV events, oldest first

    def sent(self, lora_name: str | None) -> None:
        if lora_name:
            self.sent_only[lora_name] += 1

    def started(self, lora_name: str | None) -> None:
        """The request's first message came: it runs."""
        if lora_name:
            _take(self.sent_only, lora_name)
            self.streaming[lora_name] += 1

    def ended(self, lora_name: str | None, started: bool) -> None:
        if lora_name:
            _take(self.streaming if started else self.sent_only, lora_name)

    def stored(self, lora_names: Iterable[str | None]) -> None:
        """Blocks were stored under these adapters (the engine's KV events)."""
        for name in lora_names:
            if name:
                self.recent[name] = None
                self.recent.move_to_end(name)
        while len(self.recent) > _RECENT:
            self.recent.popitem(last=False)

    def running(self, load: pb.LoadReport | None) -> set[str]:
        """Adapters whose requests run there: each holds a step slot."""
        found = set(self.streaming)
        if load is not None:
            found.update(load.running_lora_adapters)
        return found

    def pending(self, load: pb.LoadReport | None) -> set[str]:
        """Adapters whose requests wait there for a step slot (or were just sent)."""
        found = set(self.sent_only)
        if load is not None:
            found.update(load.waiting_lora_adapters)
        return found - self.running(load)

    def bound(self, load: pb.LoadReport | None, max_loras: int) -> bool:
        """Whether requests wait there for a step slot: the running adapters fill them and
        another adapter's requests wait (vLLM's ``curr_loras`` rule holds them back)."""
        if load is None or not load.waiting_lora_adapters:
            return False
        running = set(load.running_lora_adapters)
        slots = load.max_loras or max_loras or 1
        return len(running) >= slots and not set(load.waiting_lora_adapters) <= running

    def state(self, lora_name: str, load: pb.LoadReport | None, *, max_loras: int,
              load_s: float, slot_wait_s: float) -> AdapterState:
        """``lora_name`` on this engine. ``max_loras``: its step slots (the load report's
        when it says, else this); ``load_s``: the least a read is priced at (the engine's
        measured read time when longer): a read also pushes another adapter out of host
        memory, to be read again later, and a price that jumps with every noisy measurement
        of a small adapter would move adapters back and forth.

        Slots: the adapters waiting before it take the free ones first (first come, first
        served), so it waits for as many slots to turn over as it and they need beyond the
        free ones; an adapter that runs needs none for itself, but the engine lets nothing
        pass a request kept waiting for long (vLLM's scheduler likewise), so it waits for
        the others' slots all the same."""
        running, pending = self.running(load), self.pending(load)
        slots = (load.max_loras if load is not None and load.max_loras else max_loras) or 1
        if load is not None and load.loaded_lora_adapters:
            loaded = lora_name in load.loaded_lora_adapters
        else:  # no host LRU reported: the adapters that ran there last stand in for it
            loaded = lora_name in list(self.recent)[-slots:]
        free = max(slots - len(running), 0)
        needs = 0 if lora_name in running else 1
        waits = max(len(pending - {lora_name}) + needs - free, 0)
        measured = load.lora_adapter_load_s if load is not None else 0.0
        return AdapterState(running=lora_name in running,
                            loaded=loaded or lora_name in running | pending,
                            num_slot_waits=waits, max_loras=slots,
                            load_s=max(measured, load_s), slot_wait_s=slot_wait_s)


def _take(counts: Counter, name: str) -> None:
    counts[name] -= 1
    if counts[name] <= 0:
        del counts[name]
