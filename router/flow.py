"""Flow control: which request runs next when the engines are full.

The router admits at most as many requests at a time as the engines can batch
(``router.engine_slots``); the rest wait here, where they can still be ordered, shed or
dropped. When a slot frees, the next request is chosen by

1. **priority** (vLLM's field: lower first; 0 takes the tenant's default): the band of the
   lowest value with a waiting request is served first;
2. **fairness** within a band: deficit round robin across tenants by weight, so a tenant with
   weight 2 gets two turns to another's one, whatever either sends;
3. arrival order within a tenant.

A request that cannot be admitted is refused with ``FlowRefused`` (RESOURCE_EXHAUSTED / HTTP
429 at the edge, with the seconds after which a retry may succeed): its tenant's rate limit is
spent, its tenant's queue is full, or it waited past the queueing deadline or its own.
A waiting request whose client leaves is removed at once (its task is cancelled).

The number admitted at once is the engines' slots, or fewer under a gradient limit
(``router.gradient_limit``), which trades throughput for each request's speed. With
``limit_when_shared`` it applies only while the capacity is shared: while more than one
*demand class* (a tenant at a priority) has requests waiting or running, or had within
``DEMAND_WINDOW_S``. One tenant alone then gets every slot (the throughput of the full batch),
and a light tenant beside a flood gets requests that run near their idle speed rather than in
the flood's full batch; the window keeps a tenant that sends a request every few seconds
counted between its requests, so the flood does not refill the batch in each gap.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import count

from router.gradient_limit import GradientLimit
from router.rate_limit import TenantLimits
from router.tenants import Tenant

# Service time assumed before any request has finished, for Retry-After only.
_INITIAL_SERVICE_S = 1.0
_SERVICE_EWMA = 0.1  # weight of the newest request in the mean service time
# How long a demand class counts as sharing the capacity after its last request ended: longer
# than the gap of a tenant that sends one every few seconds, short enough that a one-off
# request does not hold the limit for long.
DEMAND_WINDOW_S = 10.0


class FlowRefused(Exception):
    """The request was not admitted. ``reason``: rate_limited, queue_full, queue_timeout."""

    def __init__(self, message: str, reason: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.reason = reason
        self.retry_after_s = retry_after_s

    @property
    def retry_after(self) -> str:
        """Retry-After in whole seconds (at least 1), as HTTP writes it."""
        return str(max(1, math.ceil(self.retry_after_s)))


@dataclass(frozen=True, slots=True)
class FlowRequest:
    tenant: Tenant
    priority: int  # the effective one: the request's, or its tenant's default
    num_prompt_tokens: int
    max_wait_s: float | None = None  # the request's own deadline, from now (None: none)
    priority_label: str = ""  # its metric label ("" : the priority itself)

    @property
    def label(self) -> str:
        return self.priority_label or str(self.priority)


class FlowObserver:
    """What the controller reports (metrics, spans); every method may be left as is."""

    def queued(self, request: FlowRequest, depth_change: int) -> None: ...

    def admitted(self, request: FlowRequest, wait_s: float) -> None: ...

    def refused(self, request: FlowRequest, reason: str) -> None: ...

    def capacity(self, slots: int | None, limit: int | None, inflight: int) -> None: ...


@dataclass(slots=True)
class Admission:
    """One admitted request's slot: ``release()`` when it ends (more calls do nothing)."""

    controller: FlowController
    request: FlowRequest
    wait_s: float
    admitted_s: float
    released: bool = False
    num_generated: int = 0
    first_message_s: float | None = None

    @property
    def priority(self) -> int:
        return self.request.priority

    def started(self) -> None:
        """Its first message was relayed: from here on its time is decoding."""
        if self.first_message_s is None:
            self.first_message_s = self.controller.clock()

    def generated(self, num_tokens: int) -> None:
        """Charge generated tokens to the tenant's tokens-a-minute limit."""
        self.num_generated += num_tokens
        self.controller.charge(self.request.tenant, num_tokens)

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.controller.release(self)


@dataclass(slots=True)
class _Waiter:
    request: FlowRequest
    future: asyncio.Future
    enqueued_s: float
    seq: int


@dataclass(slots=True)
class _Band:
    """One priority's waiting requests: a FIFO per tenant, deficit round robin across them."""

    queues: dict[str, OrderedDict[int, _Waiter]] = field(default_factory=dict)
    turn: deque = field(default_factory=deque)  # tenants with requests, in round-robin order
    deficit: dict[str, float] = field(default_factory=dict)
    size: int = 0
    spent: str | None = None  # the tenant at the head whose turn is used up (next: the others)

    def push(self, waiter: _Waiter) -> None:
        name = waiter.request.tenant.name
        queue = self.queues.get(name)
        if queue is None:
            queue = self.queues[name] = OrderedDict()
            # A newcomer joins the end of the round. When one tenant alone has the band and has
            # used up its turn, that end is just before it: rotating a round of one is a no-op,
            # so without this the newcomer would wait for one more of its requests.
            if self.spent is not None and len(self.turn) == 1 and self.turn[0] == self.spent:
                self.turn.appendleft(name)
            else:
                self.turn.append(name)
            self.deficit[name] = 0.0
        queue[waiter.seq] = waiter
        self.size += 1

    def remove(self, waiter: _Waiter) -> bool:
        name = waiter.request.tenant.name
        queue = self.queues.get(name)
        if queue is None or queue.pop(waiter.seq, None) is None:
            return False
        self.size -= 1
        if not queue:
            self._drop(name)
        return True

    def pop(self) -> _Waiter:
        """The next request by deficit round robin (each request costs 1; a tenant's turn
        adds its weight to its deficit)."""
        while True:
            name = self.turn[0]
            if self.deficit[name] < 1.0:
                self.deficit[name] += self.queues[name][next(iter(self.queues[name]))] \
                    .request.tenant.policy.weight
                if self.deficit[name] < 1.0:  # a weight under 1 needs several turns
                    self.turn.rotate(-1)
                    continue
            queue = self.queues[name]
            _, waiter = queue.popitem(last=False)
            self.size -= 1
            self.deficit[name] -= 1.0
            self.spent = None
            if not queue:
                self._drop(name)
            elif self.deficit[name] < 1.0:
                self.turn.rotate(-1)  # its turn is spent: the next tenant's
                self.spent = name
            return waiter

    def _drop(self, name: str) -> None:
        del self.queues[name]
        del self.deficit[name]  # an idle tenant banks no credit (as DRR)
        self.turn.remove(name)


class FlowController:
    """Admission of requests into ``capacity`` slots. Lives on the router's event loop."""

    def __init__(self, capacity: Callable[[], int | None], *, queue_timeout_s: float = 0.0,
                 observer: FlowObserver | None = None, limit: GradientLimit | None = None,
                 limit_floor: Callable[[], int] = lambda: 1, limit_when_shared: bool = False,
                 demand_window_s: float = DEMAND_WINDOW_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """``capacity()``: the slots of the serving engines now (None: no engine serves,
        requests pass through to placement, which answers for itself). ``queue_timeout_s``
        > 0: the longest a request waits here. ``limit``: admits fewer than the slots where
        more would only slow every request down (None: the slots alone), never below
        ``limit_floor()`` (the serving engines: none should idle). ``limit_when_shared``: the
        limit applies (and learns) only while more than one demand class has demand (within
        ``demand_window_s``); otherwise always."""
        self.capacity_of = capacity
        self.limit = limit
        self.limit_floor = limit_floor
        self.limit_when_shared = limit_when_shared
        self.demand_window_s = demand_window_s
        self.limited = False  # whether the limit holds admissions now (else: the slots)
        self._active: dict[tuple[str, int], int] = {}  # per demand class: waiting + running
        self._last_seen: dict[tuple[str, int], float] = {}  # when each last had demand
        self.slots: int | None = None  # the engines' slots, as last read
        self.queue_timeout_s = queue_timeout_s
        self.observer = observer or FlowObserver()
        self.clock = clock
        self.capacity: int | None = None
        self.inflight = 0
        self._bands: dict[int, _Band] = {}
        self._queued: dict[str, int] = {}  # per tenant, over all bands
        self._limits: dict[str, TenantLimits] = {}
        self._service_s = _INITIAL_SERVICE_S
        self._seq = count()

    # ----------------------------------------------------------------- admission
    async def admit(self, request: FlowRequest) -> Admission:
        """Wait for a slot; raises ``FlowRefused``, or CancelledError if the caller leaves
        (then the request is no longer queued)."""
        now = self.clock()
        tenant = request.tenant
        if self.capacity is None:  # unknown until the first refresh after an engine joined
            self.refresh()
        limits = self._rate_limits(request, now)
        self._last_seen[_demand_class(request)] = now  # its demand counts from its arrival
        self._set_capacity(now)
        if self.capacity is None or (self.inflight < self.capacity and not self._bands):
            self._take(limits, request, now)
            self._enter(request)
            return self._grant(request, 0.0, now)
        queued = self._queued.get(tenant.name, 0)
        if queued >= tenant.policy.max_queue:
            self._refuse(request, "queue_full", f"tenant {tenant.name!r}: {queued} requests "
                         f"are already waiting (its queue holds {tenant.policy.max_queue})")
        self._take(limits, request, now)  # a request refused above costs its tenant nothing
        waiter = _Waiter(request, asyncio.get_running_loop().create_future(), now,
                         next(self._seq))
        self._enqueue(waiter)
        limit = min((s for s in (self.queue_timeout_s or None, request.max_wait_s)
                     if s is not None), default=None)
        try:
            admission = await asyncio.wait_for(asyncio.shield(waiter.future), limit)
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                # the caller was cancelled in the instant it was admitted: Python 3.11's
                # wait_for then returns the result and drops the cancellation, and the request
                # would run for a client that has gone
                admission.release()
                raise asyncio.CancelledError()
            return admission
        except TimeoutError:
            if waiter.future.done():  # admitted in the same instant: keep it
                return waiter.future.result()
            self._dequeue(waiter)
            which = ("the router's queueing deadline" if limit == self.queue_timeout_s
                     else "the request's deadline")
            self._refuse(request, "queue_timeout", f"not admitted within {limit:.3g} s "
                         f"({which}): the engines are full")
        except asyncio.CancelledError:
            if waiter.future.done() and not waiter.future.cancelled():
                waiter.future.result().release()  # admitted as the client left
            else:
                self._dequeue(waiter)
                waiter.future.cancel()
            raise

    def _rate_limits(self, request: FlowRequest, now: float) -> TenantLimits | None:
        """The tenant's buckets (None: no limits); refuses when they cannot cover the
        request now."""
        policy = request.tenant.policy
        if not (policy.requests_per_minute or policy.tokens_per_minute):
            return None
        name = request.tenant.name
        limits = self._limits.get(name)
        if limits is None:
            limits = self._limits[name] = TenantLimits.of(
                policy.requests_per_minute, policy.tokens_per_minute, now)
        wait_s, which = limits.wait_s(request.num_prompt_tokens, now)
        if wait_s > 0:
            self._refuse(request, "rate_limited", f"tenant {name!r}: rate limit "
                         f"{which.replace('_', ' ')} reached", wait_s)
        return limits

    @staticmethod
    def _take(limits: TenantLimits | None, request: FlowRequest, now: float) -> None:
        if limits is not None:
            limits.take(1, request.num_prompt_tokens, now)

    def charge(self, tenant: Tenant, num_tokens: int) -> None:
        limits = self._limits.get(tenant.name)
        if limits is not None:
            limits.take(0, num_tokens, self.clock())

    def _refuse(self, request: FlowRequest, reason: str, message: str,
                retry_after_s: float | None = None) -> None:
        self.observer.refused(request, reason)
        raise FlowRefused(message, reason, self.expected_wait_s() if retry_after_s is None
                          else retry_after_s)

    def expected_wait_s(self) -> float:
        """About how long until a request arriving now would be admitted: everything queued
        ahead, served by every slot at the mean service time (for Retry-After)."""
        queued = sum(band.size for band in self._bands.values())
        return (queued + 1) * self._service_s / max(self.capacity or 1, 1)

    # ------------------------------------------------------------------ the queue
    def _enqueue(self, waiter: _Waiter) -> None:
        request = waiter.request
        band = self._bands.get(request.priority)
        if band is None:
            band = self._bands[request.priority] = _Band()
        band.push(waiter)
        self._enter(request)
        self._queued[request.tenant.name] = self._queued.get(request.tenant.name, 0) + 1
        self.observer.queued(request, +1)

    def _dequeue(self, waiter: _Waiter) -> None:
        band = self._bands.get(waiter.request.priority)
        if band is not None and band.remove(waiter):
            self._forget(waiter, band)
            self._leave(waiter.request, self.clock())

    def _forget(self, waiter: _Waiter, band: _Band) -> None:
        request = waiter.request
        if not band.size:
            del self._bands[request.priority]
        name = request.tenant.name
        self._queued[name] -= 1
        if not self._queued[name]:
            del self._queued[name]
        self.observer.queued(request, -1)

    def _grant(self, request: FlowRequest, wait_s: float, now: float) -> Admission:
        self.inflight += 1
        self.observer.admitted(request, wait_s)
        return Admission(self, request, wait_s, now)

    def release(self, admission: Admission) -> None:
        now = self.clock()
        self.inflight -= 1
        self._leave(admission.request, now)
        took = now - admission.admitted_s
        self._service_s += _SERVICE_EWMA * (took - self._service_s)
        started = admission.first_message_s
        if self.limited and started is not None and admission.num_generated > 1 and self.slots:
            # time per output token after the first: what a bigger batch slows down (the
            # prefill before it depends on the prompt, not on the load)
            per_token_s = (now - started) / (admission.num_generated - 1)
            self.limit.observe(per_token_s, self.slots, self.limit_floor())
        self._set_capacity(now)
        self.dispatch()

    def dispatch(self) -> None:
        """Fill free slots from the queue: best priority band first, DRR within it."""
        now = self.clock()
        while self._bands and (self.capacity is None or self.inflight < self.capacity):
            priority = min(self._bands)
            band = self._bands[priority]
            waiter = band.pop()
            self._forget(waiter, band)
            if waiter.future.done():  # its client left in this very instant
                self._leave(waiter.request, now)
                continue
            waiter.future.set_result(self._grant(waiter.request, now - waiter.enqueued_s, now))
        self.observer.capacity(self.slots, self.capacity, self.inflight)

    # --------------------------------------------------------------- capacity
    def refresh(self) -> None:
        """Read the engines' capacity now and admit what fits."""
        now = self.clock()
        self.slots = self.capacity_of()
        for key in [k for k, seen in self._last_seen.items()
                    if k not in self._active and now - seen > self.demand_window_s]:
            del self._last_seen[key]
        self._set_capacity(now)
        self.dispatch()
        for name in [n for n, limits in self._limits.items() if limits.idle(now)]:
            del self._limits[name]  # a full bucket is what a new tenant gets anyway

    def _set_capacity(self, now: float) -> None:
        """The admission limit now: the slots, or the gradient limit where it applies."""
        self.limited = self.slots is not None and self.limit is not None and (
            not self.limit_when_shared or self.shared(now))
        self.capacity = self.limit.value(self.slots, self.limit_floor()) if self.limited \
            else self.slots
        self.observer.capacity(self.slots, self.capacity, self.inflight)

    def shared(self, now: float | None = None) -> bool:
        """Whether more than one demand class (tenant, priority) has requests waiting or
        running, or had within the demand window."""
        now = self.clock() if now is None else now
        classes = 0
        for key, seen in self._last_seen.items():
            if key in self._active or now - seen <= self.demand_window_s:
                classes += 1
                if classes > 1:
                    return True
        return False

    def _enter(self, request: FlowRequest) -> None:
        key = _demand_class(request)
        self._active[key] = self._active.get(key, 0) + 1

    def _leave(self, request: FlowRequest, now: float) -> None:
        key = _demand_class(request)
        left = self._active.get(key, 0) - 1
        if left > 0:
            self._active[key] = left
        else:
            self._active.pop(key, None)
            self._last_seen[key] = now  # the window runs from its last request's end

    async def run(self, interval_s: float) -> None:
        """Refresh every ``interval_s`` (the engines' load-report period) until cancelled."""
        while True:
            self.refresh()
            await asyncio.sleep(interval_s)

    def depth(self) -> dict[str, int]:
        """Waiting requests per tenant."""
        return dict(self._queued)


def _demand_class(request: FlowRequest) -> tuple[str, int]:
    return request.tenant.name, request.priority
