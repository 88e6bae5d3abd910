"""Flow control on real engines over loopback: once the engines' slots are full, requests wait in
the router, which admits them by priority and by tenant share, sheds them with 429 /
RESOURCE_EXHAUSTED and Retry-After, drops a client that leaves while queued, and applies
per-tenant rate limits.

Each test holds the engines' only slot (``Blocker``: taken from the router's flow controller,
as a request would take it) until the requests under test are queued, then frees it: the order
of admission is then the router's choice alone, whatever the machine's speed; the requests
themselves run on the real engine."""

from __future__ import annotations

import json
import socket
import threading
import urllib.error
import urllib.request

import grpc
import pytest

from quire.v1 import engine_pb2 as pb
from router.pool import PromptHashes
from router.flow import FlowRequest
from router.tenants import Tenant, TenantPolicy
from tests.e2e.router_harness import (TIMEOUT_S, RunningRouter, address, collect, request,
                                      start_engine, wait_for)

TENANT = "x-tenant-id"


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    running = start_engine(tiny_model_dir, max_num_seqs=2)
    yield running
    running.close()


def flow_router(engine, **flow) -> RunningRouter:
    flow.setdefault("engine_slots", 1)
    flow.setdefault("tenant_header", TENANT)
    return RunningRouter([address(engine)], http_port=0, flow=flow)


def depth(router) -> int:
    return sum(router.read(router.server.flow.depth).values())


def inflight(router) -> int:
    return router.read(lambda: router.server.flow.inflight)


class Blocker:
    """Holds one of the router's slots until cancelled (as tenant ``name``)."""

    def __init__(self, router, name: str = "holder") -> None:
        self.router = router
        flow = router.server.flow
        holder = Tenant(name, name, TenantPolicy())
        self.admission = router.call(flow.admit(FlowRequest(holder, 0, 0)))

    def cancel(self) -> None:
        self.router.read(self.admission.release)


class Queued(threading.Thread):
    """One gRPC request sent from its own thread (a Generate, or an Embed with ``embed``);
    ``outcome`` is "OK" or the status name."""

    def __init__(self, router, request_id: str, *, tenant: str = "t", priority: int = 0,
                 timeout_s: float = TIMEOUT_S, embed: bool = False) -> None:
        super().__init__()
        self.router, self.timeout_s, self.embed = router, timeout_s, embed
        self.req = pb.EmbedRequest(token_ids=pb.TokenIds(ids=[1, 2, 3, 4])) if embed else \
            request([1, 2, 3, 4], max_tokens=4)
        self.req.request_id = request_id
        self.req.priority = priority
        self.metadata = ((TENANT, tenant),)
        self.outcome = self.retry_after = None
        self.error: grpc.RpcError | None = None

    def run(self) -> None:
        try:
            if self.embed:
                self.router.stub.Embed(self.req, timeout=self.timeout_s, metadata=self.metadata)
            else:
                collect(self.router.stub.Generate(self.req, timeout=self.timeout_s,
                                                  metadata=self.metadata))
            self.outcome = "OK"
        except grpc.RpcError as e:
            self.outcome, self.error = e.code().name, e
            self.retry_after = dict(e.trailing_metadata() or ()).get("retry-after")


def queue_in_order(router, requests: list[Queued]) -> None:
    """Start each request once the previous one waits in the router: a fixed arrival order."""
    for i, queued in enumerate(requests, 1):
        queued.start()
        assert wait_for(lambda: depth(router) == i, TIMEOUT_S), (i, depth(router))


def placed_ids(router, among: set[str]) -> list[str]:
    return [d.request_id for d in router.decisions() if d.request_id in among]


def http(router, body, headers=None, path="/v1/completions"):
    data = json.dumps(body).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{router.server.http_port}{path}",
                                 data=data, method="POST",
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=TIMEOUT_S) as response:
            return response.status, dict(response.headers), json.loads(response.read())
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), json.loads(e.read())


def settle(router, engine) -> None:
    """Nothing left queued or running anywhere."""
    assert wait_for(lambda: depth(router) == 0 and inflight(router) == 0, TIMEOUT_S)
    assert wait_for(engine.holds_no_request, TIMEOUT_S)


def test_lower_priority_runs_first_under_saturation(engine):
    router = flow_router(engine)
    try:
        blocker = Blocker(router)
        sent = [Queued(router, f"p{p}", priority=p) for p in (5, 0, 3, -1, 7)]
        queue_in_order(router, sent)
        blocker.cancel()
        for queued in sent:
            queued.join()
        assert [q.outcome for q in sent] == ["OK"] * 5
        assert placed_ids(router, {q.req.request_id for q in sent}) == \
            ["p-1", "p0", "p3", "p5", "p7"]
        settle(router, engine)
    finally:
        router.close()


def test_a_flooding_tenant_does_not_delay_a_light_one_beyond_its_share(engine):
    router = flow_router(engine)
    try:
        blocker = Blocker(router)
        heavy = [Queued(router, f"h{i}", tenant="heavy") for i in range(6)]
        light = Queued(router, "light", tenant="light")
        queue_in_order(router, heavy + [light])
        blocker.cancel()
        for queued in heavy + [light]:
            queued.join()
        # the light tenant arrived behind six of the heavy one's, and runs second: one turn each
        assert placed_ids(router, {q.req.request_id for q in heavy + [light]}) == \
            ["h0", "light", "h1", "h2", "h3", "h4", "h5"]
        metrics = _metrics(router)
        assert 'quire_router_queue_wait_seconds_count{priority="0",tenant="other"} 7.0' in \
            metrics
        # one engine with --engine-slots 1: one slot, and the gradient limit cannot go below it
        assert "quire_router_engine_slots 1.0" in metrics
        assert "quire_router_admission_limit 1.0" in metrics
        settle(router, engine)
    finally:
        router.close()


def test_embeddings_wait_their_tenants_turn_like_generations(engine):
    """An embeddings flood is its tenant's demand: each input waits in the router and takes
    its turn by tenant share and priority, so a light tenant's generation runs after one of
    the flood's inputs, not after all of them (before, Embed bypassed flow control and the
    flood sat in the engine's first-come-first-served queue)."""
    router = flow_router(engine)
    try:
        blocker = Blocker(router)
        flood = [Queued(router, f"e{i}", tenant="heavy", embed=True) for i in range(5)]
        urgent = Queued(router, "urgent", tenant="heavy", embed=True, priority=-1)
        light = Queued(router, "light", tenant="light")
        sent = flood + [urgent, light]
        queue_in_order(router, sent)
        blocker.cancel()
        for queued in sent:
            queued.join()
        assert [q.outcome for q in sent] == ["OK"] * 7
        assert placed_ids(router, {q.req.request_id for q in sent}) == \
            ["urgent", "e0", "light", "e1", "e2", "e3", "e4"]
        assert 'quire_router_queue_wait_seconds_count{priority="0",tenant="other"} 6.0' in \
            _metrics(router)
        settle(router, engine)
    finally:
        router.close()


def test_an_embeddings_request_beyond_its_tenants_queue_is_shed_whole(engine):
    """Over HTTP, a request's inputs queue in the router: within the tenant's queue they wait
    and are answered; beyond it the request is a 429 with Retry-After, and its inputs that
    were waiting leave the queue at once."""
    router = flow_router(engine, max_queue_per_tenant=2)
    try:
        blocker = Blocker(router)
        answer = {}
        body = {"input": [[5, 6, 7], [8, 9]]}
        waiter = threading.Thread(target=lambda: answer.update(
            fits=http(router, body, {TENANT: "t"}, "/v1/embeddings")))
        waiter.start()
        assert wait_for(lambda: depth(router) == 2, TIMEOUT_S)
        status, headers, refused = http(router, {"input": ["one", "two", "three"]},
                                        {TENANT: "u"}, "/v1/embeddings")
        assert status == 429 and int(headers["Retry-After"]) >= 1
        assert refused["error"]["type"] == "rate_limit_error"
        assert "already waiting" in refused["error"]["message"]
        assert wait_for(lambda: depth(router) == 2, TIMEOUT_S)  # t's two inputs, none of u's
        blocker.cancel()
        waiter.join()
        status, _, fits = answer["fits"]
        assert status == 200 and [d["index"] for d in fits["data"]] == [0, 1]
        assert fits["usage"]["prompt_tokens"] == 5
        settle(router, engine)
    finally:
        router.close()


def test_a_batch_of_more_prompts_than_slots_is_answered(engine):
    """Each prompt of a completions batch is a request of its own in flow control: with one
    slot, the first must finish (and free it) before the next runs, so the batch is read as it
    comes rather than held until every prompt has started (which waited forever)."""
    router = flow_router(engine)
    try:
        status, _, body = http(router, {"prompt": [[1, 2], [3, 4], [5, 6]], "max_tokens": 2,
                                        "ignore_eos": True}, {TENANT: "t"})
        assert status == 200, body
        assert [c["index"] for c in body["choices"]] == [0, 1, 2]
        assert body["usage"]["completion_tokens"] == 6
        settle(router, engine)
    finally:
        router.close()


def test_shedding_answers_429_with_retry_after_and_leaves_nothing_running(engine):
    router = flow_router(engine, max_queue_per_tenant=1, queue_timeout_s=6.0)
    try:
        blocker = Blocker(router)
        waiting = Queued(router, "waits")
        queue_in_order(router, [waiting])
        refused = Queued(router, "refused")  # the tenant's queue is full
        refused.start()
        refused.join()
        assert refused.outcome == "RESOURCE_EXHAUSTED" and int(refused.retry_after) >= 1
        assert "already waiting" in refused.error.details()
        status, headers, body = http(router, {"prompt": [1, 2], "max_tokens": 2},
                                     {TENANT: "t"})
        assert status == 429 and int(headers["Retry-After"]) >= 1
        assert body["error"]["type"] == "rate_limit_error"
        waiting.join()  # the queueing deadline: refused, not left waiting
        assert waiting.outcome == "RESOURCE_EXHAUSTED" and int(waiting.retry_after) >= 1
        assert "queueing deadline" in waiting.error.details()
        assert "waits" not in placed_ids(router, {"waits", "refused"})
        blocker.cancel()
        settle(router, engine)
        text = _metrics(router)
        for reason in ("queue_full", "queue_timeout"):
            assert f'quire_router_flow_refused_total{{reason="{reason}",tenant="other"}}' in text
    finally:
        router.close()


def test_a_client_that_leaves_while_queued_is_dropped_at_once(engine):
    router = flow_router(engine)
    try:
        blocker = Blocker(router)
        stream = router.stub.Generate(request([1, 2, 3], max_tokens=4), timeout=TIMEOUT_S)
        assert wait_for(lambda: depth(router) == 1, TIMEOUT_S)
        stream.cancel()
        assert wait_for(lambda: depth(router) == 0, TIMEOUT_S)
        # an HTTP client that closes its connection while queued
        body = json.dumps({"prompt": [1, 2, 3], "max_tokens": 4}).encode()
        with socket.create_connection(("127.0.0.1", router.server.http_port)) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                         b"application/json\r\nContent-Length: " + str(len(body)).encode() +
                         b"\r\n\r\n" + body)
            assert wait_for(lambda: depth(router) == 1, TIMEOUT_S)
        assert wait_for(lambda: depth(router) == 0, TIMEOUT_S)
        assert inflight(router) == 1  # only the blocker
        blocker.cancel()
        settle(router, engine)
        assert router.decisions() == []  # neither ever reached an engine
    finally:
        router.close()


def test_rate_limits_answer_429_with_retry_after(engine):
    limits = {"tenants": {"metered": {"requests_per_minute": 2}}}
    router = flow_router(engine, engine_slots=0, tenants=json.dumps(limits))
    try:
        body = {"prompt": [1, 2, 3], "max_tokens": 2}
        for _ in range(2):
            assert http(router, body, {TENANT: "metered"})[0] == 200
        status, headers, answer = http(router, body, {TENANT: "metered"})
        assert status == 429 and 1 <= int(headers["Retry-After"]) <= 30
        assert "requests per minute" in answer["error"]["message"]
        assert http(router, body, {TENANT: "someone-else"})[0] == 200
        assert ('quire_router_flow_refused_total{reason="rate_limited",tenant="metered"} 1.0'
                in _metrics(router))
    finally:
        router.close()


def test_http_priority_is_validated_and_forwarded(engine):
    # a tenant whose default is -2 makes -2 a priority with its own metric label
    router = flow_router(engine, tenants=json.dumps({"tenants": {"urgent": {"priority": -2}}}))
    try:
        status, _, answer = http(router, {"prompt": [1, 2], "max_tokens": 2, "priority": "hi"})
        assert status == 400 and answer["error"]["param"] == "priority"
        blocker = Blocker(router)
        threads = []
        for priority, prompt in ((3, [1, 2]), (-2, [1, 2, 3])):
            body = {"prompt": prompt, "max_tokens": 2, "priority": priority}
            thread = threading.Thread(target=http, args=(router, body))
            thread.start()
            threads.append(thread)
            assert wait_for(lambda n=len(threads): depth(router) == n, TIMEOUT_S)
        blocker.cancel()
        for thread in threads:
            thread.join()
        waits = _metrics(router)
        assert 'quire_router_queue_wait_seconds_count{priority="-2",tenant="other"} 1.0' in waits
        # 3 is nobody's default: labelled "other", so clients cannot mint label values
        assert 'quire_router_queue_wait_seconds_count{priority="other",tenant="other"} 1.0' \
            in waits
        first, second = router.decisions(2)  # in the order placed: -2 first
        assert (first.num_prompt_tokens, second.num_prompt_tokens) == (3, 2)
    finally:
        router.close()


@pytest.fixture(scope="module")
def long_engine(tmp_path_factory, embedded_model_dir):
    """A tiny model with room for 32k tokens: a request generating to its end holds its slot
    until it is cancelled, on any host."""
    from tests.conftest import build_tiny_model

    model = build_tiny_model(tmp_path_factory.mktemp("long-tiny"), embedded_model_dir,
                             max_position_embeddings=32768)
    running = start_engine(model, max_num_seqs=2, max_model_len=32768, max_tokens_limit=16000)
    yield running
    running.close()


def test_two_routers_share_an_engines_slots_instead_of_each_filling_them(long_engine):
    """Two routers in front of one engine (router replicas): the engine says two read its
    load, so a router whose peer holds every slot admits only its share (one of two) and
    queues the rest where its flow control orders it; when the peer's requests end, the
    queued one runs. Before, each admitted up to all the slots, and the excess waited in the
    engine's first-come-first-served queue."""
    first, second = (RunningRouter([address(long_engine)], http_port=0,
                                   max_tokens_limit=16000, flow={
                                       "engine_slots": 2, "tenant_header": TENANT})
                     for _ in range(2))
    try:
        def seen(router):
            (snap,) = router.read(lambda: router.server.pool.candidates(PromptHashes({})))
            return snap
        assert wait_for(lambda: seen(first).num_load_readers == 2 and
                        seen(second).num_load_readers == 2, TIMEOUT_S)
        holds = []
        for i in range(2):  # the first router's two requests run until cancelled
            req = request([1, 2, 3, 4], max_tokens=10000)  # two fit the KV cache
            req.request_id = f"hold-{i}"
            call = first.stub.Generate(req, timeout=TIMEOUT_S, metadata=((TENANT, "a"),))
            holds.append(call)
            threading.Thread(target=_drain, args=(call,), daemon=True).start()
        # the second router's flow control has read that report (it refreshes at the
        # reports' period): its share is one slot
        assert wait_for(lambda: seen(second).num_running == 2 and second.read(
            lambda: second.server.flow.capacity) == 1, TIMEOUT_S)
        queued = [Queued(second, f"b{i}", tenant="b") for i in range(2)]
        for q in queued:
            q.start()
        assert wait_for(lambda: depth(second) == 1 and inflight(second) == 1, TIMEOUT_S), \
            (depth(second), inflight(second), [(q.outcome, q.error) for q in queued])
        for call in holds:
            call.cancel()
        for q in queued:
            q.join(TIMEOUT_S)
        assert [q.outcome for q in queued] == ["OK", "OK"], [q.error for q in queued]
        settle(second, long_engine)
    finally:
        first.close()
        second.close()


def _drain(call) -> None:
    try:
        for _ in call:
            pass
    except grpc.RpcError:
        pass  # cancelled


@pytest.mark.parametrize("flow_control", [True, False])
def test_a_priority_more_urgent_than_the_tenant_may_ask_is_a_403(engine, flow_control):
    """``min_priority`` bounds what a tenant's clients may claim (the probe: any client could
    send -2**31 and run before every other tenant): more urgent is 403 / PERMISSION_DENIED
    naming ``priority``, with flow control on or off; the tenant's own default and anything
    less urgent are served, and nothing is left queued or running."""
    tenants = {"default": {"min_priority": 0},
               "tenants": {"gold": {"priority": -1, "min_priority": -1}}}
    router = flow_router(engine, tenants=json.dumps(tenants), flow_control=flow_control)
    try:
        for tenant, priority in (("anyone", -1), ("anyone", -2 ** 31), ("gold", -2)):
            status, _, answer = http(router, {"prompt": [1, 2], "max_tokens": 2,
                                              "priority": priority}, {TENANT: tenant})
            assert status == 403, (tenant, priority, answer)
            error = answer["error"]
            assert error["param"] == "priority" and error["type"] == "permission_error"
            assert f"at least {0 if tenant == 'anyone' else -1}" in error["message"], error
        refused = Queued(router, "grpc", tenant="anyone", priority=-5)
        refused.run()
        assert refused.outcome == "PERMISSION_DENIED", refused.error
        assert dict(refused.error.trailing_metadata())["quire-error-field"] == "priority"
        for tenant, priority in (("anyone", 0), ("anyone", 4), ("gold", 0), ("gold", -1)):
            status, _, answer = http(router, {"prompt": [1, 2], "max_tokens": 2,
                                              "priority": priority}, {TENANT: tenant})
            assert status == 200, (tenant, priority, answer)
        embed = Queued(router, "embed", tenant="anyone", priority=-3, embed=True)
        embed.run()
        assert embed.outcome == "PERMISSION_DENIED"
        # /v1/embeddings takes vLLM's priority too (each input waits its turn at it)
        for priority, want in ((-1, 403), (3, 200), ("soon", 400)):
            status, _, answer = http(router, {"input": ["a b", "c"], "priority": priority},
                                     {TENANT: "anyone"}, path="/v1/embeddings")
            assert status == want, (priority, answer)
            assert want == 200 or answer["error"]["param"] == "priority"
        if flow_control:
            settle(router, engine)
    finally:
        router.close()


@pytest.mark.parametrize("mode, shared_limit", [("auto", 1), ("off", 2)])
def test_the_auto_gradient_limit_holds_back_only_while_two_tenants_have_demand(engine, mode,
                                                                             shared_limit):
    """--gradient-limit auto (the default): one tenant alone is admitted up to the engine's
    slots (2); when a second tenant has demand the gradient limit applies, from one request
    per engine. Off: the slots whatever the tenants."""
    router = flow_router(engine, engine_slots=2, gradient_limit=mode)
    try:
        blockers = [Blocker(router, "heavy") for _ in range(2)]  # the heavy tenant's two
        heavy = Queued(router, "heavy", tenant="heavy")
        queue_in_order(router, [heavy])
        assert router.read(lambda: (router.server.flow.capacity, router.server.flow.limited)) \
            == (2, False)
        assert "quire_router_admission_limit 2.0" in _metrics(router)
        light = Queued(router, "light", tenant="light")
        light.start()
        assert wait_for(lambda: depth(router) == 2, TIMEOUT_S)
        assert router.read(lambda: router.server.flow.capacity) == shared_limit
        assert f"quire_router_admission_limit {shared_limit}.0" in _metrics(router)
        for blocker in blockers:
            blocker.cancel()
        for queued in (heavy, light):
            queued.join()
        assert (heavy.outcome, light.outcome) == ("OK", "OK")
        settle(router, engine)
    finally:
        router.close()


def test_slots_are_learned_from_the_engines_reports(tiny_model_dir):
    """An engine that batches two: the router learns two slots and keeps the rest itself
    (the gradient limit off: it would hold the engine below its batch on this CPU)."""
    engine = start_engine(tiny_model_dir, max_num_seqs=2)
    router = RunningRouter([address(engine)], flow={"tenant_header": TENANT,
                                                    "gradient_limit": False})
    try:
        sent = [Queued(router, f"r{i}") for i in range(8)]
        for queued in sent:
            queued.req.sampling.max_tokens = 200
            queued.start()
        learned = wait_for(lambda: router.read(lambda: router.server.flow.slots) == 2,
                           TIMEOUT_S)
        for queued in sent:
            queued.join()
        assert learned and [q.outcome for q in sent] == ["OK"] * 8
        settle(router, engine)
    finally:
        router.close()
        engine.close()


def test_bad_flow_flags_are_errors_naming_the_flag(capsys):
    from quire_cli.main import main

    for argv, name in ((["--engine-slots", "-1"], "engine_slots"),
                       (["--tenants", '{"tenants": {"a": {"weight": 0}}}'], "tenants"),
                       (["--queue-timeout-s", "-3"], "queue_timeout_s")):
        assert main(["router", "--engines", "127.0.0.1:1", *argv]) == 2
        assert f"error: {name}:" in capsys.readouterr().err


def _metrics(router) -> str:
    return router.read(lambda: router.server.metrics.render().decode())
