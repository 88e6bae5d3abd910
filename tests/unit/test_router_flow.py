"""Flow control's pure parts, exactly: the admission order (priority bands, deficit round robin
by weight, arrival order), shedding, deadlines, clients leaving, rate limits, the engine slots
learned from load reports and the tenants table."""

from __future__ import annotations

import asyncio
import hashlib
import json

import pytest

from router.balancer import EndpointSnapshot
from router.engine_slots import EngineSlots
from router.flow import FlowController, FlowRefused, FlowRequest
from router.flow_config import FlowConfig
from router.rate_limit import TokenBucket
from router.tenants import Tenant, TenantPolicy, TenantTable, parse_tenants


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def tenant(name: str, **policy) -> Tenant:
    return Tenant(name, name, TenantPolicy(**policy))


def req(t: Tenant, priority: int = 0, tokens: int = 10, max_wait_s=None) -> FlowRequest:
    return FlowRequest(tenant=t, priority=priority, num_prompt_tokens=tokens,
                       max_wait_s=max_wait_s)


def controller(capacity: int, **kwargs) -> FlowController:
    flow = FlowController(lambda: capacity, **kwargs)
    flow.refresh()
    return flow


async def admitted_order(flow: FlowController, requests: list[tuple[str, FlowRequest]]):
    """Queue ``requests`` (the slots being full), then free one slot at a time; the labels in
    the order they were admitted."""
    holders = [await flow.admit(req(tenant("holder"))) for _ in range(flow.capacity)]
    order: list[str] = []

    async def one(label, request):
        admission = await flow.admit(request)
        order.append(label)
        return admission

    tasks = [asyncio.create_task(one(label, r)) for label, r in requests]
    await asyncio.sleep(0)
    for holder in holders:
        holder.release()
    while len(order) < len(requests):
        await asyncio.sleep(0)
        admissions = [t.result() for t in tasks if t.done()]
        for admission in admissions:
            admission.release()
    return order


def test_lower_priority_value_runs_first_then_arrival_order():
    async def main():
        flow = controller(1)
        return await admitted_order(flow, [("a5", req(tenant("a"), 5)),
                                           ("a0", req(tenant("a"), 0)),
                                           ("b-1", req(tenant("b"), -1)),
                                           ("a0'", req(tenant("a"), 0))])
    assert asyncio.run(main()) == ["b-1", "a0", "a0'", "a5"]


def test_tenants_share_by_weight_within_a_band():
    heavy, light, gold = tenant("heavy"), tenant("light"), tenant("gold", weight=2)

    async def main():
        flow = controller(1)
        requests = [(f"h{i}", req(heavy)) for i in range(6)]
        requests += [(f"l{i}", req(light)) for i in range(2)]
        requests += [(f"g{i}", req(gold)) for i in range(4)]
        return await admitted_order(flow, requests)
    # one turn each in order of first arrival; gold's weight 2 gives it two per turn
    assert asyncio.run(main()) == ["h0", "l0", "g0", "g1", "h1", "l1", "g2", "g3", "h2", "h3",
                                   "h4", "h5"]


def test_a_fractional_weight_takes_several_turns():
    async def main():
        flow = controller(1)
        return await admitted_order(flow, [(f"s{i}", req(tenant("s", weight=0.5)))
                                           for i in range(2)] +
                                    [(f"n{i}", req(tenant("n"))) for i in range(4)])
    assert asyncio.run(main()) == ["n0", "s0", "n1", "n2", "s1", "n3"]


def test_full_queue_is_refused_with_retry_after_and_costs_nothing():
    t = tenant("t", max_queue=2, requests_per_minute=4)

    async def main():
        flow = controller(1)
        holder = await flow.admit(req(t))
        waiting = [asyncio.create_task(flow.admit(req(t))) for _ in range(2)]
        await asyncio.sleep(0)
        with pytest.raises(FlowRefused) as refused:
            await flow.admit(req(t))
        assert refused.value.reason == "queue_full" and refused.value.retry_after == "3"
        assert flow.depth() == {"t": 2}
        holder.release()
        (await waiting[0]).release()
        (await waiting[1]).release()
        assert flow.inflight == 0 and flow.depth() == {}
        (await flow.admit(req(t))).release()  # the refused request took none of the four
        with pytest.raises(FlowRefused, match="requests per minute"):
            await flow.admit(req(t))
    asyncio.run(main())


def test_queue_timeout_and_request_deadline_refuse_and_dequeue():
    async def main():
        flow = controller(1, queue_timeout_s=0.05)
        holder = await flow.admit(req(tenant("t")))
        with pytest.raises(FlowRefused) as timeout:
            await flow.admit(req(tenant("t")))
        assert timeout.value.reason == "queue_timeout" and "queueing deadline" in str(
            timeout.value)
        with pytest.raises(FlowRefused) as deadline:
            await flow.admit(req(tenant("t"), max_wait_s=0.01))
        assert "request's deadline" in str(deadline.value)
        assert flow.depth() == {} and flow.inflight == 1
        holder.release()
        assert flow.inflight == 0
    asyncio.run(main())


def test_a_client_that_leaves_is_dropped_at_once():
    async def main():
        flow = controller(1)
        holder = await flow.admit(req(tenant("t")))
        leaving = asyncio.create_task(flow.admit(req(tenant("a"))))
        staying = asyncio.create_task(flow.admit(req(tenant("b"))))
        await asyncio.sleep(0)
        assert flow.depth() == {"a": 1, "b": 1}
        leaving.cancel()
        await asyncio.gather(leaving, return_exceptions=True)
        assert flow.depth() == {"b": 1}
        holder.release()
        admission = await staying
        assert admission.request.tenant.name == "b" and flow.inflight == 1
    asyncio.run(main())


@pytest.mark.parametrize("max_wait_s", [None, 60.0])
def test_a_client_that_leaves_in_the_instant_it_is_admitted_gets_no_slot(max_wait_s):
    """Its slot is granted and its caller cancelled in the same loop iteration (found by a
    probe): with a deadline, Python 3.11's wait_for returned the admission and dropped the
    cancellation, so the request ran for a client that had gone and held the slot."""
    async def main():
        flow = controller(1)
        holder = await flow.admit(req(tenant("a")))
        waiter = asyncio.create_task(flow.admit(req(tenant("b"), max_wait_s=max_wait_s)))
        await asyncio.sleep(0.01)
        assert flow.depth() == {"b": 1}
        holder.release()  # b is granted the slot ...
        waiter.cancel()  # ... as its client leaves
        with pytest.raises(asyncio.CancelledError):
            await waiter
        assert flow.inflight == 0 and flow.depth() == {}
        again = await flow.admit(req(tenant("c")))  # the slot is free
        assert flow.inflight == 1
        again.release()
    asyncio.run(main())


def test_rate_limits_refuse_with_the_time_to_refill():
    clock = Clock()
    t = tenant("t", requests_per_minute=2, tokens_per_minute=600)

    async def main():
        flow = controller(100, clock=clock)
        for _ in range(2):
            (await flow.admit(req(t, tokens=100))).release()
        with pytest.raises(FlowRefused) as refused:
            await flow.admit(req(t, tokens=100))
        assert refused.value.reason == "rate_limited"
        assert refused.value.retry_after_s == pytest.approx(30.0)  # one request per 30 s
        clock.now += 30.0
        admission = await flow.admit(req(t, tokens=100))
        admission.generated(800)  # the bucket goes below zero: tokens now bind
        admission.release()
        clock.now += 30.0
        with pytest.raises(FlowRefused) as tokens:
            await flow.admit(req(t, tokens=100))
        assert "tokens per minute" in str(tokens.value)
        assert tokens.value.retry_after_s == pytest.approx(10.0)  # 100 tokens at 10 a second
        assert flow.inflight == 0
    asyncio.run(main())


def test_token_bucket_lets_a_request_larger_than_a_minute_through_a_full_bucket():
    bucket = TokenBucket.full(60.0, 0.0)
    assert bucket.wait_s(1000, 0.0) == 0.0
    bucket.take(1000, 0.0)
    assert bucket.wait_s(1, 0.0) == pytest.approx(941.0)


def snapshot(engine_id, running, waiting, healthy=True, batch_full=None, **more):
    return EndpointSnapshot(engine_id=engine_id, healthy=healthy, cached_blocks=0, block_size=16,
                            num_running=running, num_waiting=waiting, batch_full=batch_full,
                            **more)


def test_engine_slots_learn_what_an_engine_batches():
    reports = [snapshot("e", 0, 0)]
    slots = EngineSlots(lambda: reports, initial=4)
    assert slots.observe() == 4
    reports[:] = [snapshot("e", 4, 0)]  # full and nothing waiting: double (slow start)
    assert slots.observe() == 8
    reports[:] = [snapshot("e", 6, 1)]  # one report waiting: a request between two steps
    assert slots.observe() == 8
    reports[:] = [snapshot("e", 6, 2)]  # two in a row: it batches 6
    assert slots.observe() == 6
    reports[:] = [snapshot("e", 6, 0)]  # room again: one more at a time now
    assert slots.observe() == 7
    reports[:] = [snapshot("e", 3, 0), snapshot("f", 0, 0), snapshot("g", 9, 9, healthy=False)]
    assert slots.observe() == 7 + 4 and slots.slots() == {"e": 7, "f": 4}
    reports[:] = []
    assert slots.observe() is None
    assert EngineSlots(lambda: [snapshot("e", 1, 5)] * 2, fixed=3).observe() == 6


def test_routers_share_an_engines_slots_and_none_is_starved():
    """Routers in front of one engine (it says how many read its load): each may use the
    slots the others leave, counted from what the engine runs and queues beyond this router's
    own requests, and never less than its share (slots / readers, rounded up)."""
    def seen(running, waiting, readers, mine, **kw):
        return snapshot("e", running, waiting, num_load_readers=readers, router_requests=mine,
                        **kw)
    assert EngineSlots(lambda: [seen(6, 0, 1, 0)], fixed=8).observe() == 8  # alone: all
    assert EngineSlots(lambda: [seen(6, 0, 0, 0)], fixed=8).observe() == 8  # not said: all
    assert EngineSlots(lambda: [seen(0, 0, 2, 0)], fixed=8).observe() == 8  # the other idle
    assert EngineSlots(lambda: [seen(5, 0, 2, 2)], fixed=8).observe() == 5  # it has 3 there
    assert EngineSlots(lambda: [seen(8, 6, 2, 0)], fixed=8).observe() == 4  # full: the share
    assert EngineSlots(lambda: [seen(8, 6, 3, 1)], fixed=8).observe() == 3  # ceil(8 / 3)
    # fewer there than this router counts (the report lags its sends): the others have none
    assert EngineSlots(lambda: [seen(1, 0, 2, 4)], fixed=8).observe() == 8
    # several engines: each shared on its own
    both = [seen(8, 0, 2, 0), snapshot("f", 2, 0, num_load_readers=2, router_requests=2)]
    assert EngineSlots(lambda: both, fixed=8).observe() == 4 + 8


def test_engine_slots_take_an_engines_own_word_on_a_full_batch():
    """A Quire engine says whether its waiting requests wait for batch room (``batch_full``):
    a prefill backlog (requests waiting for the step's token budget) never pins the slots,
    however many reports show it; a full batch pins them at once, from one report."""
    reports = [snapshot("e", 0, 0, batch_full=False)]
    slots = EngineSlots(lambda: reports, initial=8)
    assert slots.observe() == 8
    reports[:] = [snapshot("e", 8, 0, batch_full=False)]
    assert slots.observe() == 16
    for _ in range(3):  # 8 prompts running, 8 waiting for the token budget: not full
        reports[:] = [snapshot("e", 8, 8, batch_full=False)]
        assert slots.observe() == 16
    reports[:] = [snapshot("e", 16, 0, batch_full=False)]  # the backlog taken in: double
    assert slots.observe() == 32
    reports[:] = [snapshot("e", 20, 12, batch_full=True)]  # out of KV blocks: it batches 20
    assert slots.observe() == 20
    reports[:] = [snapshot("e", 20, 0, batch_full=False)]
    assert slots.observe() == 21  # one at a time once it has been full
    # the two-report rule for the same backlog, from an engine that does not say
    reports[:] = [snapshot("v", 0, 0)]
    inferred = EngineSlots(lambda: reports, initial=8)
    inferred.observe()
    reports[:] = [snapshot("v", 8, 0)]
    inferred.observe()
    reports[:] = [snapshot("v", 8, 8)]
    inferred.observe()
    assert inferred.observe() == 8


def test_no_engine_serving_lets_requests_through():
    async def main():
        flow = FlowController(lambda: None)
        admission = await flow.admit(req(tenant("t")))
        assert flow.inflight == 1
        admission.release()
        admission.release()  # idempotent
        assert flow.inflight == 0
    asyncio.run(main())


def test_tenants_resolve_by_header_then_key_digest():
    key = "sk-gold"
    digest = hashlib.sha256(key.encode()).hexdigest()
    table = parse_tenants(json.dumps({"default": {"max_queue": 3}, "tenants": {
        "gold": {"weight": 4, "priority": -1, "api_key_sha256": [digest]}}}),
        TenantPolicy(), "X-Tenant-Id")
    gold = table.resolve((("authorization", f"Bearer {key}"),))
    assert (gold.name, gold.label, gold.policy.weight, gold.policy.priority) == \
        ("gold", "gold", 4, -1)
    other = table.resolve((("authorization", "Bearer sk-other"),))
    assert other.name == "key:" + hashlib.sha256(b"sk-other").hexdigest()[:12]
    assert other.label == "other" and other.policy.max_queue == 3
    by_header = table.resolve((("x-tenant-id", "acme"), ("authorization", f"Bearer {key}")))
    assert by_header.name == "acme" and by_header.label == "other"
    assert table.resolve(()).name == "anonymous"
    # metric labels: 0 and the tenants' defaults by value, any other priority as "other"
    assert [table.priority_label(p) for p in (0, -1, 7)] == ["0", "-1", "other"]
    assert isinstance(TenantTable().resolve(()), Tenant)
    # a key that is not UTF-8 (aiohttp hands it over decoded with surrogateescape) is digested
    # as the bytes sent: a tenant, not a crash
    raw = b"sk-\xff\xfe".decode("utf-8", "surrogateescape")
    assert table.resolve((("authorization", f"Bearer {raw}"),)).name == \
        "key:" + hashlib.sha256(b"sk-\xff\xfe").hexdigest()[:12]


@pytest.mark.parametrize("fields, message", [
    ({"engine_slots": -1}, "engine_slots: must be >= 0"),
    ({"max_queue_per_tenant": -2}, "max_queue_per_tenant: must be >= 0"),
    ({"queue_timeout_s": -1.0}, "queue_timeout_s: must be >= 0"),
    ({"tenant_requests_per_minute": -5.0}, "tenant_requests_per_minute: must be >= 0"),
    ({"tenant_header": " "}, "tenant_header: must not be empty"),
    ({"tenants": "{"}, "tenants: neither JSON nor YAML"),
    ({"tenants": "[1]"}, "tenants: must be an object"),
    ({"tenants": '{"tenants": {"a": {"weight": -1}}}'}, "tenants: tenants.a.weight: must be"),
    ({"tenants": '{"tenants": {"a": {"wieght": 2}}}'}, "tenants: tenants.a: unknown setting"),
    ({"tenants": '{"tenants": {"a": {"api_key_sha256": "abc"}}}'},
     "tenants: tenants.a.api_key_sha256: 'abc' is not a SHA-256"),
    ({"tenants": '{"default": {"tokens_per_minute": "x"}}'},
     "tenants: default.tokens_per_minute: must be a number"),
    ({"tenants": "@/nonexistent/tenants.yaml"}, "tenants: cannot read /nonexistent"),
    ({"tenants": '{"default": {"min_priority": 1.5}}'},
     "tenants: default.min_priority: must be an int32 or null"),
    ({"tenants": '{"default": {"min_priority": 0}, "tenants": {"gold": {"priority": -1}}}'},
     "tenants: tenants.gold.priority: -1 is more urgent than its min_priority 0"),
])
def test_bad_flow_config_names_the_flag(fields, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(".", r"\.")):
        FlowConfig(**fields)


def test_tenants_from_a_yaml_file(tmp_path):
    path = tmp_path / "tenants.yaml"
    path.write_text("tenants:\n  batch:\n    weight: 0.5\n    priority: 10\n")
    table = FlowConfig(tenants=f"@{path}", tenant_tokens_per_minute=1000).table()
    assert table.tenants["batch"] == TenantPolicy(weight=0.5, priority=10,
                                                  tokens_per_minute=1000)


def test_gradient_limit_grows_while_batching_is_free_and_settles_where_it_is_not():
    from router.gradient_limit import GradientLimit

    flat = GradientLimit(4)
    for _ in range(100):
        flat.observe(0.01, ceiling=64)  # per-token time does not grow: fill the slots
    assert flat.value(64) == 64
    # a compute-bound pool of 2 engines: per-token time grows with the requests per engine
    # (starting from one request per engine, as the router does: the fastest per-token
    # time is seen before the batch grows)
    bound = GradientLimit(2)
    for _ in range(200):
        bound.observe(0.01 * max(1.0, bound.value(64) / 2), ceiling=64, floor=2)
    # settles where each request runs at about half its own speed (two per engine): far
    # below the 64 slots
    assert 3 <= bound.value(64, 2) <= 7
    slowed = GradientLimit(16)  # every request four times slower than the fastest seen
    slowed.observe(0.01, ceiling=64, floor=2)
    for _ in range(100):
        slowed.observe(0.04, ceiling=64, floor=2)
    assert slowed.value(64, 2) == 2  # one per engine
    assert GradientLimit(1).value(64, floor=2) == 2


def test_controller_caps_admissions_at_the_gradient_limit():
    from router.gradient_limit import GradientLimit

    clock = Clock()

    async def main():
        limit = GradientLimit(2)
        flow = FlowController(lambda: 8, limit=limit, clock=clock)
        flow.refresh()
        assert (flow.slots, flow.capacity) == (8, 2)
        first, second = await flow.admit(req(tenant("t"))), await flow.admit(req(tenant("t")))
        third = asyncio.create_task(flow.admit(req(tenant("t"))))
        await asyncio.sleep(0)
        assert flow.depth() == {"t": 1}
        first.started()
        clock.now += 1.0
        first.generated(101)
        first.release()  # 10 ms a token, the fastest yet: the limit may grow
        assert flow.capacity >= 2 and (await third).wait_s == 1.0
        second.release()
    asyncio.run(main())


def test_a_tenant_arriving_behind_a_flood_runs_at_the_next_free_slot():
    heavy, light = tenant("heavy"), tenant("light")

    async def main():
        flow = controller(1)
        holder = await flow.admit(req(tenant("holder")))
        flood = [asyncio.create_task(flow.admit(req(heavy))) for _ in range(4)]
        await asyncio.sleep(0)
        holder.release()
        first = await flood[0]  # the heavy tenant alone: its turn is used up
        late = asyncio.create_task(flow.admit(req(light)))
        await asyncio.sleep(0)
        first.release()
        for _ in range(5):
            await asyncio.sleep(0)
        assert late.done() and not any(t.done() for t in flood[1:])
        late.result().release()
        for task in flood[1:]:
            (await task).release()
    asyncio.run(main())


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


def test_auto_gradient_limit_applies_only_while_the_capacity_is_shared():
    """--gradient-limit auto: one tenant alone is admitted up to the slots; a second tenant's
    demand brings the gradient limit in (from one request per engine), and it stays in for
    the demand window after that tenant's last request, then the slots return."""
    from router.gradient_limit import GradientLimit

    clock = Clock()
    heavy, light = tenant("heavy"), tenant("light")

    async def main():
        flow = FlowController(lambda: 8, limit=GradientLimit(1), limit_floor=lambda: 2,
                              limit_when_shared=True, demand_window_s=10.0, clock=clock)
        flow.refresh()
        assert (flow.capacity, flow.limited) == (8, False)
        floods = [await flow.admit(req(heavy)) for _ in range(8)]  # every slot, no waiting
        waiting = [asyncio.create_task(flow.admit(req(heavy))) for _ in range(2)]
        await asyncio.sleep(0)
        assert flow.depth() == {"heavy": 2} and flow.capacity == 8
        late = asyncio.create_task(flow.admit(req(light)))
        await asyncio.sleep(0)
        assert flow.limited and flow.capacity == 2  # the floor: one per engine
        for admission in floods[:6]:  # 8 -> 2 running: none admitted until below the limit
            admission.release()
        await settle()
        assert not late.done() and not any(t.done() for t in waiting)
        floods[6].release()  # 1 running: one more, the heavy tenant's (it queued first)
        await settle()
        assert not late.done() and [t.done() for t in waiting] == [True, False]
        floods[7].release()  # then the light tenant's turn
        await settle()
        assert late.done() and not waiting[1].done()
        clock.now += 1.0
        late.result().release()
        waiting[0].result().release()
        await settle()
        assert flow.limited and waiting[1].done()
        clock.now += 10.5  # the light tenant's window has passed: the slots again
        flow.refresh()
        assert (flow.capacity, flow.limited) == (8, False)
        waiting[1].result().release()
        assert flow.inflight == 0 and flow.depth() == {}
        # a priority level is a demand class of its own, as another tenant is
        clock.now += 20.0
        flow.refresh()
        one = await flow.admit(req(heavy))
        assert not flow.limited
        two = await flow.admit(req(heavy, priority=-1))
        assert flow.limited and flow.shared()
        one.release(), two.release()
    asyncio.run(main())


def test_auto_gradient_limit_learns_only_while_it_applies():
    from router.gradient_limit import GradientLimit

    clock = Clock()

    async def main():
        limit = GradientLimit(1)
        flow = FlowController(lambda: 8, limit=limit, limit_when_shared=True, clock=clock)
        flow.refresh()
        admission = await flow.admit(req(tenant("alone")))
        admission.started()
        clock.now += 1.0
        admission.generated(11)
        admission.release()
        assert limit.fastest_s is None  # one tenant at full slots teaches the limit nothing
        # another tenant within the window: the limit applies, from one request
        first = await flow.admit(req(tenant("other")))
        assert flow.limited and flow.capacity == 1
        second = asyncio.create_task(flow.admit(req(tenant("alone"))))
        await settle()
        assert not second.done()
        first.started()
        clock.now += 0.1
        first.generated(11)
        first.release()
        assert limit.fastest_s == pytest.approx(0.01, rel=1e-9)
        (await second).release()
    asyncio.run(main())


@pytest.mark.parametrize("value, mode", [("auto", "auto"), ("ON", "on"), ("off", "off"),
                                         (True, "on"), (False, "off"), ("true", "on"),
                                         ("false", "off")])
def test_gradient_limit_modes(value, mode):
    assert FlowConfig(gradient_limit=value).gradient_limit == mode


def test_gradient_limit_default_is_auto_and_bad_modes_are_named():
    assert FlowConfig().gradient_limit == "auto"
    with pytest.raises(ValueError, match="gradient_limit: choose from auto, on, off"):
        FlowConfig(gradient_limit="sometimes")
