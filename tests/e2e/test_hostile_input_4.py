"""Hostile input, fourth round: what a probe of a running router and engine found (twenty-ninth
session), against the third round's stack (a real router with API keys, HTTP and gRPC, and a
real tiny-model engine on loopback). The grammar workers' memory cap and import path are in
test_grammar_compile_workers.py; the flow controller's admitted-as-cancelled race in
tests/unit/test_router_flow.py."""

from __future__ import annotations

import http.client
import json

import grpc
import pytest

from quire.limits import MAX_LORA_NAME_CHARS
from quire.v1 import engine_pb2 as pb
from quire.v1 import engine_pb2_grpc
from tests.e2e import test_hostile_input_3 as hostile_3
from tests.e2e.router_harness import address

engines, router = hostile_3.engines, hostile_3.router
post, assert_400, no_tracebacks = hostile_3.post, hostile_3.assert_400, hostile_3.no_tracebacks
grpc_error, field_metadata = hostile_3.grpc_error, hostile_3.field_metadata


def get(router, path: str) -> tuple[int, dict]:
    connection = http.client.HTTPConnection("127.0.0.1", router.server.http_port, timeout=30)
    try:
        connection.request("GET", path, headers=hostile_3.AUTH)
        response = connection.getresponse()
        return response.status, json.loads(response.read())
    finally:
        connection.close()


@pytest.mark.parametrize("target", ["router", "engine"])
def test_grpc_a_lora_name_is_bounded(router, engines, target):
    """A 100,000-character adapter name was echoed into the error, which then overflowed
    gRPC's metadata limit: the client got RESOURCE_EXHAUSTED naming nothing."""
    channel = grpc.insecure_channel(f"127.0.0.1:{router.port}" if target == "router"
                                    else address(engines[0]))
    stub = engine_pb2_grpc.EngineServiceStub(channel)
    error = grpc_error(stub.Generate, pb.GenerateRequest(
        text="Hello", lora_name="a" * 100_000, sampling=pb.SamplingOptions(max_tokens=2)))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error
    assert field_metadata(error) == "lora_name"
    assert f"at most {MAX_LORA_NAME_CHARS} characters, got 100000" in error.details()
    channel.close()


@pytest.mark.parametrize("limit", ["abc", "1e3", "%00", "-1", "9" * 40])
def test_debug_decisions_refuses_a_bad_limit_with_a_json_400(router, caplog, limit):
    status, body = get(router, f"/debug/decisions?limit={limit}")
    assert_400(status, body, "limit", "must be an integer")
    assert no_tracebacks(caplog)
    status, body = get(router, "/debug/decisions?limit=2")
    assert status == 200 and len(body["decisions"]) <= 2


@pytest.mark.parametrize("body, param, words", [
    ({"lora_name": "tiny", "lora_path": "/adapters/x"}, "lora_name", "the base model's name"),
    ({"lora_name": "ok", "lora_path": "/adapters/x\u0000y"}, "lora_path", "NUL"),
    ({"lora_name": "a\u0000b", "lora_path": "/adapters/x"}, "lora_name", "NUL"),
    ({"lora_name": "a" * (MAX_LORA_NAME_CHARS + 1), "lora_path": "/x"}, "lora_name",
     f"at most {MAX_LORA_NAME_CHARS}"),
])
def test_a_lora_adapter_cannot_take_the_base_models_name_or_a_nul(router, caplog, body, param,
                                                                  words):
    """An adapter loaded under the base model's name listed the model twice in /v1/models; a
    NUL in a path came back as 'embedded null byte' naming no field."""
    status, answer = post(router, "/v1/load_lora_adapter", body)
    assert_400(status, answer, param, words)
    assert no_tracebacks(caplog)
    status, models = get(router, "/v1/models")
    assert [m["id"] for m in models["data"]] == [hostile_3.MODEL]


def test_the_engine_refuses_an_adapter_under_its_models_name_and_a_nul_path(engines, tmp_path):
    stub = engine_pb2_grpc.EngineServiceStub(grpc.insecure_channel(address(engines[0])))
    name = stub.GetModelInfo(pb.GetModelInfoRequest()).model_name
    with pytest.raises(grpc.RpcError) as info:
        stub.LoadLoRAAdapter(pb.LoadLoRAAdapterRequest(lora_name=name, lora_path="/x"),
                             timeout=30)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value
    assert field_metadata(info.value) == "lora_name" and "base model" in info.value.details()
    # the path check itself (these engines load no adapters at run time, so it is called here
    # with an adapter directory, as an engine started with --lora-adapter-dirs calls it)
    from engine_worker.lora.paths import check_adapter_path
    from quire.errors import FieldError

    with pytest.raises(FieldError) as err:
        check_adapter_path(str(tmp_path / "a\x00b"), (tmp_path,))
    assert err.value.field == "lora_path" and "NUL" in str(err.value)
