"""Placing one request: request block hashes + endpoint snapshots -> the engine to send it to.

``choose`` is a pure function of its arguments (the round-robin policy carries a counter, which is
the whole of its state). A policy scores every healthy endpoint, lower is better, and the lowest
score wins; ties go to the smallest engine id so decisions are reproducible.

Policies live in ``POLICIES`` (name -> class):

- ``prefix_aware``: estimated time to first token, ``decode step + (work ahead + uncached
  prompt tokens) / prefill rate``, each engine at its own measured rates
  (``router.engine_rates``). An engine holding more of the prompt has less to prefill, but a
  queue in front of it costs as much as recomputing: a hot shared prefix stays on its warm
  engine only while that is faster than prefilling elsewhere, then spreads (and the new copy
  becomes warm in turn). No threshold: the rates and the queues decide.
  A request under a LoRA adapter adds what the adapter costs there (``adapter_cost_s``): a
  read from its path where host memory does not hold it, plus the wait for step slots to
  turn over where the engine's ``max_loras`` are held by adapters in use and others wait
  for them before it (nothing where its adapter runs and no other waits: it joins the step;
  but an engine that keeps other adapters waiting soon lets nothing pass them, so a hot
  adapter stops being free where it crowds the others out). So an adapter stays where it
  is loaded and its prefix is cached, goes to the cheapest engine when none holds it, and a
  hot one spreads to another engine once its queue costs more than a load there, never by
  evicting an adapter that is in use while a free slot is to be had (llm-d's LoRA-affinity
  failure: piling a hot adapter on one pod, or thrashing slots).
- ``prefix_affinity``: most cached tokens, load only breaking ties: pure cache affinity, the
  baseline that piles a hot prefix onto one engine (kept to compare against).
- ``least_loaded``: fewest tokens of work ahead (``EndpointSnapshot.work_ahead_tokens``), then
  fewest running requests.
- ``round_robin``: healthy engines in engine-id order, one step per call.
- ``session_affinity``: rendezvous (highest-random-weight) hashing of the session key, so taking
  an engine away moves only the sessions it held; requests without a key fall back to
  ``prefix_aware``.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import ClassVar, Protocol


class NoEndpointError(RuntimeError):
    """No healthy endpoint can take the request (maps to UNAVAILABLE at the edge)."""


@dataclass(frozen=True, slots=True)
class RoutingRequest:
    block_hashes: tuple[int, ...]  # full blocks of the prompt, quire.block_hash chain
    num_prompt_tokens: int
    session_key: str | None = None

    def __post_init__(self) -> None:
        if self.num_prompt_tokens < 0:
            raise ValueError(f"num_prompt_tokens must be >= 0, got {self.num_prompt_tokens}")


@dataclass(frozen=True, slots=True)
class AdapterState:
    """The request's LoRA adapter on one engine, as the router sees it now."""

    running: bool  # requests under it run there: it holds a step slot
    loaded: bool  # held in the engine's host memory (max_cpu_loras): no read from its path
    # adapters that must leave a step slot before the request runs: before its adapter has
    # one, or (held already) before the adapters waiting ahead of it have theirs, since the
    # engine lets nothing pass a request kept waiting for long (0: it runs at once)
    num_slot_waits: int
    max_loras: int  # the engine's step slots
    load_s: float  # what one read from its path costs there
    slot_wait_s: float  # how long an adapter holds a slot there (a request's time)

    def __post_init__(self) -> None:
        for name in ("num_slot_waits", "load_s", "slot_wait_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.max_loras < 1:
            raise ValueError(f"max_loras must be >= 1, got {self.max_loras}")


def adapter_cost_s(adapter: AdapterState | None) -> float:
    """Seconds the request's adapter adds before its prefill can start there (None: the
    base model, nothing): a read where host memory lacks it, and a share of a request's time
    per adapter that must leave a step slot first (with ``max_loras`` slots, one of them
    frees every ``slot_wait_s / max_loras`` on average)."""
    if adapter is None:
        return 0.0
    load_s = 0.0 if adapter.loaded or adapter.running else adapter.load_s
    return load_s + adapter.num_slot_waits * adapter.slot_wait_s / adapter.max_loras


@dataclass(frozen=True, slots=True)
class EndpointSnapshot:
    """One engine as the router sees it at decision time."""

    engine_id: str
    healthy: bool
    cached_blocks: int  # leading request blocks cached there (from the prefix index)
    block_size: int
    num_running: int = 0
    num_waiting: int = 0
    num_queued_tokens: int = 0  # prefill tokens waiting, from the engine's last load report
    kv_cache_usage: float = 0.0  # fraction of KV blocks in use, 0..1
    # uncached prompt tokens this router sent there that have not given a first token yet
    inflight_tokens: int = 0
    prefill_tokens_per_s: float = 2000.0  # measured prefill throughput (router.engine_rates)
    decode_step_s: float = 0.0  # measured time of one decode step there now (0: unknown)
    adapter: AdapterState | None = None  # the request's LoRA adapter there (None: base model)
    # its waiting requests wait for a LoRA step slot (every one held by adapters in use), so
    # they say nothing of how many requests its batch could take (router.engine_slots)
    adapter_bound: bool = False
    # its last step left requests waiting for batch room, not for the step's token budget
    # (LoadReport.batch_full); None: the engine does not say (vLLM engines)
    batch_full: bool | None = None
    # routers reading its load now (LoadReport.num_load_readers; 0: it does not say), and
    # this router's requests there now (sent, not yet ended): what the others have there is
    # the rest of what it reports running and waiting (router.engine_slots)
    num_load_readers: int = 0
    router_requests: int = 0

    def __post_init__(self) -> None:
        for name in ("cached_blocks", "num_running", "num_waiting", "num_queued_tokens",
                     "inflight_tokens", "num_load_readers", "router_requests"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if not 0.0 <= self.kv_cache_usage <= 1.0:
            raise ValueError(f"kv_cache_usage must be in [0, 1], got {self.kv_cache_usage}")
        if self.prefill_tokens_per_s <= 0:
            raise ValueError(f"prefill_tokens_per_s must be > 0, got {self.prefill_tokens_per_s}")
        if self.decode_step_s < 0:
            raise ValueError(f"decode_step_s must be >= 0, got {self.decode_step_s}")

    @property
    def work_ahead_tokens(self) -> int:
        """Prefill tokens a request placed there now waits behind. The load report counts
        every router's requests but lags (an engine publishes it between steps); the router's
        own in-flight tokens are current but its own only. Each request is in one or both, so
        the larger is the better estimate; their sum would count the router's requests twice
        once the report shows them."""
        return max(self.num_queued_tokens, self.inflight_tokens)


@dataclass(frozen=True, slots=True)
class Decision:
    engine_id: str
    policy: str
    scores: dict[str, float] = field(hash=False)  # healthy engines only; lower is better
    predicted_cached_tokens: int


def cached_tokens(request: RoutingRequest, endpoint: EndpointSnapshot) -> int:
    """Prompt tokens the engine will not prefill. Like the engine's prefix cache, a hit never
    covers the last prompt token: it must be computed to produce the first output."""
    return min(endpoint.cached_blocks * endpoint.block_size, max(request.num_prompt_tokens - 1, 0))


class Policy(Protocol):
    name: str

    def scores(self, request: RoutingRequest,
               endpoints: Sequence[EndpointSnapshot]) -> dict[str, float]:
        """A score per (healthy, non-empty) endpoint; lower is better."""
        ...


@dataclass(frozen=True, slots=True)
class PrefixAware:
    """Estimated TTFT in seconds: the engine's current decode step (its first token is one
    more step) plus the work ahead of the request and its own uncached prompt tokens at the
    engine's prefill rate, plus what its LoRA adapter costs there (``adapter_cost_s``)."""

    name: ClassVar[str] = "prefix_aware"

    def ttft_s(self, request: RoutingRequest, endpoint: EndpointSnapshot) -> float:
        uncached = request.num_prompt_tokens - cached_tokens(request, endpoint)
        ahead = endpoint.work_ahead_tokens
        return (endpoint.decode_step_s + (ahead + uncached) / endpoint.prefill_tokens_per_s
                + adapter_cost_s(endpoint.adapter))

    def scores(self, request, endpoints):
        return {e.engine_id: self.ttft_s(request, e) for e in endpoints}


@dataclass(frozen=True, slots=True)
class PrefixAffinity:
    name: ClassVar[str] = "prefix_affinity"

    def scores(self, request, endpoints):
        # Cached tokens are integers; the load adds a fraction below 1, so it only breaks ties.
        load = LeastLoaded().scores(request, endpoints)
        scale = 1.0 + max(load.values())
        return {e.engine_id: -float(cached_tokens(request, e)) + load[e.engine_id] / scale
                for e in endpoints}


@dataclass(frozen=True, slots=True)
class LeastLoaded:
    name: ClassVar[str] = "least_loaded"

    def scores(self, request, endpoints):
        # Tokens are integers; running requests add a fraction below 1, so they only break ties.
        scale = 1 + max(e.num_running for e in endpoints)
        return {e.engine_id: float(e.work_ahead_tokens) + e.num_running / scale
                for e in endpoints}


class RoundRobin:
    """Healthy engines in engine-id order; the counter advances once per scored request."""

    __slots__ = ("_counter",)
    name: ClassVar[str] = "round_robin"

    def __init__(self) -> None:
        self._counter = 0

    def scores(self, request, endpoints):
        order = sorted(e.engine_id for e in endpoints)
        turn = self._counter % len(order)
        self._counter += 1
        return {engine_id: float((i - turn) % len(order)) for i, engine_id in enumerate(order)}


def rendezvous_weight(session_key: str, engine_id: str) -> int:
    """Stable 64-bit weight of a (key, engine) pair; the same in every router process."""
    data = session_key.encode("utf-8", "surrogateescape") + b"\x00" + engine_id.encode("utf-8")
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


@dataclass(frozen=True, slots=True)
class SessionAffinity:
    fallback: PrefixAware = field(default_factory=PrefixAware)
    name: ClassVar[str] = "session_affinity"

    def scores(self, request, endpoints):
        if request.session_key is None:
            return self.fallback.scores(request, endpoints)
        # Highest weight wins; negate so that lower is better like every other policy.
        return {e.engine_id: -float(rendezvous_weight(request.session_key, e.engine_id))
                for e in endpoints}


POLICIES: dict[str, type] = {
    "prefix_aware": PrefixAware,
    "prefix_affinity": PrefixAffinity,
    "least_loaded": LeastLoaded,
    "round_robin": RoundRobin,
    "session_affinity": SessionAffinity,
}


def make_policy(name: str) -> Policy:
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(f"policy must be one of {sorted(POLICIES)}, got {name!r}") from None


def choose(request: RoutingRequest, endpoints: Sequence[EndpointSnapshot],
           policy: Policy) -> Decision:
    """The endpoint ``policy`` scores lowest among the healthy ones (ties: smallest engine id).

    Raises ``NoEndpointError`` when no endpoint is healthy.
    """
    healthy = [e for e in endpoints if e.healthy]
    if not healthy:
        raise NoEndpointError(f"no healthy endpoint among {len(endpoints)}")
    scores = policy.scores(request, healthy)
    engine_id = min(scores, key=lambda eid: (scores[eid], eid))
    chosen = next(e for e in healthy if e.engine_id == engine_id)
    return Decision(engine_id=engine_id, policy=policy.name, scores=scores,
                    predicted_cached_tokens=cached_tokens(request, chosen))
