"""How many requests each engine can batch, learned from its load reports; the router admits
at most their sum at a time, so that requests beyond it wait in the router (where the flow
controller chooses what runs next) rather than in an engine's queue (where nobody can).

No engine reports its batch limit (``max_num_seqs``, or what its KV cache holds), but every
engine reports ``num_running`` and ``num_waiting``, and an engine that keeps requests waiting
is batching all it can: its slots are then the requests it runs. Per engine:

- start at ``initial`` slots (a documented default, or ``--engine-slots`` fixed by hand);
- while it runs as many requests as it has slots and keeps none waiting, it could take more:
  double the slots until it has first kept requests waiting, one more per report after;
- when it is full, its slots become what it runs (at least 1).

Full is what the engine says where it says it (Quire engines: ``batch_full``, its last step
left requests waiting for batch room: ``max_num_seqs``, free KV blocks or a preemption).
Requests that wait only for the step's token budget say nothing of the batch: with chunked
prefill a burst of prompts waits a few steps for the budget however large the batch could be
(64 prompts of 256 tokens sent at once to an engine with a 2,048-token budget: taken as full,
the slots stuck at the 8 the first step ran, then grew one per report, so the burst trickled
in over 23 s, measured on a 2-core Zen 4). An engine that does not say (vLLM's) is full when
two reports in a row show requests waiting: the second report skips the moment between a
request's arrival and the engine's next step, when a request waits without the engine being
full. A report whose waiting requests wait for
a LoRA step slot (``adapter_bound``: the running adapters fill ``max_loras``) changes
nothing: they wait for an adapter to leave, not for room in the batch, and taking them as a
full batch would hold back the requests that could join a running adapter.

With several routers in front of one engine (the chart's router replicas), each would admit up
to all of its slots, so the engine got up to that many times what it batches, and the excess
waited in its first-come-first-served queue, past every router's priorities and tenant
shares. An engine that says how many routers read its load (``num_load_readers``, R) is
shared instead: this router may use its slots less what the others have there (what it
reports running and waiting beyond this router's own requests), and never less than its
share, slots / R (rounded up), so a router whose peers keep the engine full is not starved
but converges to its share while they all have demand.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from router.balancer import EndpointSnapshot

DEFAULT_INITIAL_SLOTS = 8


@dataclass(slots=True)
class _Learned:
    slots: int
    saturated_once: bool = False
    waiting_before: bool = False


class EngineSlots:
    """Slots per engine from ``snapshots()`` (the pool's view of every engine)."""

    def __init__(self, snapshots: Callable[[], Sequence[EndpointSnapshot]], *,
                 fixed: int = 0, initial: int = DEFAULT_INITIAL_SLOTS,
                 ceiling: int = 4096) -> None:
        """``fixed`` > 0: every engine has exactly that many slots (nothing is learned)."""
        self.snapshots = snapshots
        self.fixed = fixed
        self.initial = initial
        self.ceiling = ceiling
        self._learned: dict[str, _Learned] = {}

    def observe(self) -> int | None:
        """Update from the engines' latest reports; the slots of the serving engines together
        (None while no engine serves: nothing to hold requests for)."""
        healthy = [s for s in self.snapshots() if s.healthy]
        self._learned = {s.engine_id: self._learned.get(s.engine_id) or _Learned(self.initial)
                         for s in healthy}
        if not healthy:
            return None
        if not self.fixed:
            for snapshot in healthy:
                self._update(self._learned[snapshot.engine_id], snapshot)
        slots = self.slots()
        return sum(shared(slots[s.engine_id], s) for s in healthy)

    def _update(self, learned: _Learned, snapshot: EndpointSnapshot) -> None:
        if snapshot.adapter_bound:
            learned.waiting_before = False
            return
        waiting = snapshot.num_waiting > 0
        full = waiting and learned.waiting_before if snapshot.batch_full is None \
            else snapshot.batch_full
        if full:
            learned.slots = max(1, snapshot.num_running)
            learned.saturated_once = True
        elif not waiting and snapshot.num_running >= learned.slots:
            grown = learned.slots + 1 if learned.saturated_once else learned.slots * 2
            learned.slots = min(grown, self.ceiling)
        learned.waiting_before = waiting

    @property
    def num_engines(self) -> int:
        """Serving engines, as last observed."""
        return len(self._learned)

    def slots(self) -> dict[str, int]:
        """Each serving engine's slots, as last observed."""
        if self.fixed:
            return {engine_id: self.fixed for engine_id in self._learned}
        return {engine_id: learned.slots for engine_id, learned in self._learned.items()}


def shared(slots: int, snapshot: EndpointSnapshot) -> int:
    """The slots of an engine this router may use now: all of them unless other routers read
    its load too; then what the others leave, and at least this router's share."""
    readers = snapshot.num_load_readers
    if readers <= 1:
        return slots
    others = max(0, snapshot.num_running + snapshot.num_waiting - snapshot.router_requests)
    return max(slots - others, -(-slots // readers))
