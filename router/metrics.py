"""The router's Prometheus metrics and its decision log.

Metrics live in a registry of the router's own (no process-wide state). Engine counts by state
are computed at scrape time from the pool, so they can never drift from it.

The decision log keeps the last ``capacity`` placements, each with every candidate's score,
the cached tokens the router predicted and the cached tokens the engine then reported, so a
placement can be explained after the fact (``GET /debug/decisions`` on the HTTP front). The
same comparison feeds ``quire_router_cached_tokens_{predicted,actual}_total`` and the
``quire_router_cache_prediction_error_tokens`` histogram: a precise index keeps them equal.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily

PLACEMENT_BUCKETS_S = (1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01,
                       0.025, 0.05, 0.1)
TTFT_BUCKETS_S = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                  7.5, 10.0, 20.0, 40.0, 80.0)
ERROR_BUCKETS_TOKENS = (0, 16, 64, 256, 1024, 4096, 16384)
QUEUE_WAIT_BUCKETS_S = (0.0, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
                        120.0, 300.0)


@dataclass(slots=True)
class DecisionRecord:
    """One placement; ``actual_cached_tokens`` is filled in when the engine's usage arrives."""

    request_id: str
    engine_id: str
    policy: str
    attempt: int
    scores: dict[str, float]
    num_prompt_tokens: int
    predicted_cached_tokens: int
    placement_us: float
    actual_cached_tokens: int | None = None
    outcome: str = "pending"  # ok, or the gRPC status name of the failure

    def as_json(self) -> dict:
        return asdict(self)


@dataclass(slots=True)
class DecisionLog:
    capacity: int = 256
    records: deque = field(default_factory=deque)

    def add(self, record: DecisionRecord) -> DecisionRecord:
        self.records.append(record)
        while len(self.records) > self.capacity:
            self.records.popleft()
        return record

    def latest(self, limit: int) -> list[DecisionRecord]:
        return list(self.records)[-limit:] if limit > 0 else []


class _EngineStates:
    """Collector: engines per state, read from the pool at scrape time."""

    def __init__(self, states: Callable[[], dict[str, int]]) -> None:
        self._states = states

    def collect(self):
        family = GaugeMetricFamily("quire_router_engines", "Engines in the pool by state",
                                   labels=["state"])
        for state, count in sorted(self._states().items()):
            family.add_metric([state], count)
        yield family


class RouterMetrics:
    def __init__(self, engine_states: Callable[[], dict[str, int]]) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("quire_router_requests", "Requests by engine and gRPC status",
                                ["engine", "code"], registry=r)
        self.retries = Counter("quire_router_retries", "Requests retried on another engine "
                               "after a failure before the first token", ["engine"], registry=r)
        self.migrations = Counter("quire_router_migrations", "Streams moved to another engine "
                                  "after their engine failed mid-way (router.resume)",
                                  ["engine"], registry=r)
        self.placement_s = Histogram("quire_router_placement_seconds",
                                     "Hashing, index lookup and scoring per placement",
                                     buckets=PLACEMENT_BUCKETS_S, registry=r)
        self.tokenize_s = Histogram("quire_router_tokenize_seconds",
                                    "Tokenizing a text prompt", buckets=PLACEMENT_BUCKETS_S,
                                    registry=r)
        self.ttft_s = Histogram("quire_router_time_to_first_token_seconds",
                                "From the router receiving a request to relaying its first "
                                "message", buckets=TTFT_BUCKETS_S, registry=r)
        self.predicted = Counter("quire_router_cached_tokens_predicted",
                                 "Prompt tokens the router predicted cached on the chosen "
                                 "engine", ["engine"], registry=r)
        self.actual = Counter("quire_router_cached_tokens_actual",
                              "Prompt tokens the engine reported cached", ["engine"], registry=r)
        self.prediction_error = Histogram("quire_router_cache_prediction_error_tokens",
                                          "|actual - predicted| cached tokens per request",
                                          buckets=ERROR_BUCKETS_TOKENS, registry=r)
        self.http_requests = Counter("quire_router_http_requests", "HTTP requests by path and "
                                     "status", ["path", "status"], registry=r)
        self.tokens = Counter("quire_router_tokens", "Tokens served, by kind (prompt, "
                              "completion, cached)", ["kind"], registry=r)
        r.register(_EngineStates(engine_states))
        self.decisions = DecisionLog()
        self.flow = FlowMetrics(r)

    def observe_usage(self, record: DecisionRecord, cached_tokens: int) -> None:
        record.actual_cached_tokens = cached_tokens
        self.predicted.labels(record.engine_id).inc(record.predicted_cached_tokens)
        self.actual.labels(record.engine_id).inc(cached_tokens)
        self.prediction_error.observe(abs(cached_tokens - record.predicted_cached_tokens))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class FlowMetrics:
    """Flow control's metrics (``router.flow.FlowObserver``). Tenants are labelled by their
    name in the tenants table, every other one as ``other``; priorities by their value where it
    is a tenant's default (0 included), else ``other`` (clients choose them freely)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        r = registry
        self.depth = Gauge("quire_router_queue_depth", "Requests waiting in the router for a "
                           "slot, by tenant and priority", ["tenant", "priority"], registry=r)
        self.wait_s = Histogram("quire_router_queue_wait_seconds", "Wait in the router's queue "
                                "before placement, per admitted request (0: the engines had "
                                "room)", ["tenant", "priority"], buckets=QUEUE_WAIT_BUCKETS_S,
                                registry=r)
        self.refused_total = Counter("quire_router_flow_refused", "Requests refused with 429 / "
                                     "RESOURCE_EXHAUSTED by tenant and reason (rate_limited, "
                                     "queue_full, queue_timeout)", ["tenant", "reason"],
                                     registry=r)
        self.slots = Gauge("quire_router_engine_slots", "Requests the serving engines can "
                           "batch together, as the router learned it (-1: unknown)", registry=r)
        self.limit = Gauge("quire_router_admission_limit", "Requests the router admits at once: "
                           "the engines' slots, or fewer under the gradient limit (with "
                           "--gradient-limit auto: only while more than one tenant or priority "
                           "has demand; -1: unknown)", registry=r)
        self.inflight = Gauge("quire_router_inflight_requests", "Requests admitted and not "
                              "finished", registry=r)

    def queued(self, request, depth_change: int) -> None:
        self.depth.labels(request.tenant.label, request.label).inc(depth_change)

    def admitted(self, request, wait_s: float) -> None:
        self.wait_s.labels(request.tenant.label, request.label).observe(wait_s)

    def refused(self, request, reason: str) -> None:
        self.refused_total.labels(request.tenant.label, reason).inc()

    def capacity(self, slots: int | None, limit: int | None, inflight: int) -> None:
        self.slots.set(-1 if slots is None else slots)
        self.limit.set(-1 if limit is None else limit)
        self.inflight.set(inflight)
