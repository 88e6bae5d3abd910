"""The router's edge over real loopback (gRPC and HTTP, real tiny-model engines): API keys,
limits, the HTTP status of every failure class, and explainable decisions."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import grpc
import openai
import pytest

from quire.v1 import engine_pb2 as pb
from tests.e2e.router_harness import (TIMEOUT_S, RunningRouter, address, collect, engine_fleet,
                                      request, start_engine, wait_for)

KEY = "sk-quire-test-key"
MODEL = "tiny"


@pytest.fixture(scope="module")
def engines(tiny_model_dir):
    yield from engine_fleet(tiny_model_dir)


@pytest.fixture(scope="module")
def router(engines):
    running = RunningRouter([address(e) for e in engines], http_port=0, model_name=MODEL,
                            api_keys=f"other-key,{KEY}", max_n=3, max_tokens_limit=64,
                            max_body_bytes=4096)
    yield running
    running.close()


def _http(router, method, path, body=None, headers=None, raw: bytes | None = None):
    data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    req = urllib.request.Request(f"http://127.0.0.1:{router.server.http_port}{path}",
                                 data=data, method=method,
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=TIMEOUT_S) as response:
            return response.status, json.loads(response.read() or b"null")
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"null")


def _auth(key=KEY):
    return {"Authorization": f"Bearer {key}"}


# ---- API keys ------------------------------------------------------------------------------

def test_grpc_needs_a_key_but_health_does_not(router):
    with pytest.raises(grpc.RpcError) as err:
        collect(router.stub.Generate(request(list(range(20))), timeout=TIMEOUT_S))
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert "authorization" in err.value.details()
    for bad in ("Bearer wrong", f"Basic {KEY}", KEY, "Bearer "):
        with pytest.raises(grpc.RpcError) as err:
            router.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=TIMEOUT_S,
                                     metadata=(("authorization", bad),))
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    tokens, _ = collect(router.stub.Generate(request(list(range(20))), timeout=TIMEOUT_S,
                                             metadata=(("authorization", f"Bearer {KEY}"),)))
    assert len(tokens) == 8
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    def ready() -> bool:  # readiness follows the pool within a few tens of milliseconds
        reply = health_pb2_grpc.HealthStub(router.channel).Check(
            health_pb2.HealthCheckRequest(service="quire.v1.EngineService"), timeout=TIMEOUT_S)
        return reply.status == health_pb2.HealthCheckResponse.SERVING
    assert wait_for(ready)


def test_http_needs_a_key_but_health_and_metrics_do_not(router):
    status, body = _http(router, "GET", "/v1/models")
    assert status == 401 and body["error"]["type"] == "authentication_error"
    assert body["error"]["param"] == "authorization"
    assert _http(router, "GET", "/v1/models", headers=_auth("nope"))[0] == 401
    assert _http(router, "GET", "/v1/models", headers=_auth())[0] == 200
    assert _http(router, "GET", "/health")[0] == 200
    with urllib.request.urlopen(f"http://127.0.0.1:{router.server.http_port}/metrics",
                                timeout=TIMEOUT_S) as response:
        assert response.status == 200
    with openai.OpenAI(base_url=f"http://127.0.0.1:{router.server.http_port}/v1", api_key=KEY,
                       max_retries=0, timeout=TIMEOUT_S) as client:
        out = client.completions.create(model=MODEL, prompt="Hello there", max_tokens=4,
                                        temperature=0)
        assert out.usage.completion_tokens >= 1
    with openai.OpenAI(base_url=f"http://127.0.0.1:{router.server.http_port}/v1",
                       api_key="wrong", max_retries=0, timeout=TIMEOUT_S) as client:
        with pytest.raises(openai.AuthenticationError):
            client.completions.create(model=MODEL, prompt="Hello", max_tokens=4)


# ---- limits ----------------------------------------------------------------------------------

@pytest.mark.parametrize("body, param", [
    ({"prompt": "hi", "n": 4}, "n"),
    ({"prompt": "hi", "max_tokens": 65}, "max_tokens"),
])
def test_http_limits_name_the_field(router, body, param):
    status, answer = _http(router, "POST", "/v1/completions", {"model": MODEL, **body},
                           headers=_auth())
    assert status == 400 and answer["error"]["param"] == param


def test_grpc_limits_name_the_field(router):
    metadata = (("authorization", f"Bearer {KEY}"),)
    for sampling, field in ((dict(n=4), "sampling.n"), (dict(max_tokens=65),
                                                        "sampling.max_tokens")):
        req = pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1, 2, 3]),
                                 sampling=pb.SamplingOptions(**sampling))
        with pytest.raises(grpc.RpcError) as err:
            collect(router.stub.Generate(req, timeout=TIMEOUT_S, metadata=metadata))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert err.value.details().startswith(field + ":")


def test_a_too_large_body_is_a_413_and_others_keep_flowing(router):
    status, answer = _http(router, "POST", "/v1/completions", headers=_auth(),
                           raw=json.dumps({"model": MODEL, "prompt": "x" * 5000}).encode())
    assert status == 413 and "body" in answer["error"]["message"]
    status, answer = _http(router, "POST", "/v1/completions",
                           {"model": MODEL, "prompt": "still served", "max_tokens": 3},
                           headers=_auth())
    assert status == 200 and answer["usage"]["completion_tokens"] >= 1


# ---- failure classes ----------------------------------------------------------------------------

def test_full_engines_give_429_no_engine_503_deadline_504(tiny_model_dir):
    full = [start_engine(tiny_model_dir, max_waiting_requests=0) for _ in range(2)]
    # the deadline only bounds the 429 case here (the 504 case has its own test)
    router = RunningRouter([address(e) for e in full], http_port=0, request_timeout_s=5.0)
    try:
        body = {"prompt": "hello", "max_tokens": 4}
        status, answer = _http(router, "POST", "/v1/completions", body)
        assert status == 429 and answer["error"]["type"] == "rate_limit_error"
        assert [d.outcome for d in router.decisions(2)] == ["RESOURCE_EXHAUSTED"] * 2
        # both engines stop serving: 503, with /health saying so
        for engine in full:
            engine.call(engine.server._set_serving(False))
        assert wait_for(lambda: not any(router.healthy().values()))
        status, answer = _http(router, "POST", "/v1/completions", body)
        assert status == 503 and answer["error"]["type"] == "service_unavailable"
        assert _http(router, "GET", "/health")[0] == 503
    finally:
        router.close()
        for engine in full:
            engine.close()


def test_a_request_past_its_deadline_is_a_504(engines):
    router = RunningRouter([address(e) for e in engines], http_port=0, request_timeout_s=0.3)
    try:
        status, answer = _http(router, "POST", "/v1/completions",
                               {"prompt": "go on", "max_tokens": 1000, "ignore_eos": True})
        assert status == 504 and answer["error"]["type"] == "timeout_error"
        # the engines stopped the work
        assert wait_for(lambda: all(e.holds_no_request() for e in engines))
    finally:
        router.close()


# ---- decisions --------------------------------------------------------------------------------

def test_decisions_explain_placements_and_predictions_match(router, engines):
    metadata = (("authorization", f"Bearer {KEY}"),)
    prefix = list(range(5000, 5096))  # 6 blocks
    collect(router.stub.Generate(request(prefix + [1]), timeout=TIMEOUT_S, metadata=metadata))
    chosen = router.last_engine()
    assert wait_for(lambda: router.matches(prefix).get(chosen) == 6)
    # one after another: sent at once, a later one may fairly go to the other engine when the
    # warm one's queue outweighs its cached prefix (affinity yields to load), which would
    # make this a test of the machine's speed
    for i in range(3):
        collect(router.stub.Generate(request(prefix + [10 + i]), timeout=TIMEOUT_S,
                                     metadata=metadata))
    status, answer = _http(router, "GET", "/debug/decisions?limit=3", headers=_auth())
    assert status == 200
    for decision in answer["decisions"]:
        assert decision["engine_id"] == chosen and decision["policy"] == "prefix_aware"
        assert set(decision["scores"]) == {address(e) for e in engines}
        assert decision["scores"][chosen] == min(decision["scores"].values())
        assert decision["predicted_cached_tokens"] == 96
        assert decision["actual_cached_tokens"] == 96 and decision["outcome"] == "OK"
    text = router.read(lambda: router.server.metrics.render().decode())
    assert "quire_router_cache_prediction_error_tokens_bucket{le=\"0.0\"}" in text
