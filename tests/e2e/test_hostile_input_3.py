"""Hostile input, third round: what a probe of a running `quire up` found giving a 500 or a wrong
answer (twenty-eighth session), against a real router (HTTP + gRPC, API keys on) and a real
tiny-model engine on loopback. Each is now a 4xx naming the field, or served, and nothing
logs a traceback; every case is sent through the real fronts."""

from __future__ import annotations

import json

import grpc
import pytest

from quire.limits import MAX_REQUEST_ID_CHARS
from quire.v1 import engine_pb2 as pb
from quire.v1 import engine_pb2_grpc
from tests.e2e import test_hostile_input_2 as hostile_2
from tests.e2e.router_harness import TIMEOUT_S, RunningRouter, address, engine_fleet

MODEL = "tiny"
KEY = "sk-probe"
AUTH = {"Authorization": f"Bearer {KEY}"}
HUGE = "1" * 5000  # past Python's 4,300-digit limit on int() of a string
USER = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def engines(tiny_model_dir):
    yield from engine_fleet(tiny_model_dir, count=1, max_model_len=512)


@pytest.fixture(scope="module")
def router(engines):
    running = RunningRouter([address(e) for e in engines], http_port=0, model_name=MODEL,
                            api_keys=KEY)
    yield running
    running.close()


def post(router, path: str, body=None, *, raw: bytes | None = None, headers=None):
    """(status, parsed JSON body) of one POST with the API key; ``headers`` values may be
    bytes (sent as they are)."""
    status, _, answer = hostile_2.post(router, path, body, raw=raw,
                                       headers={**AUTH, **(headers or {})})
    return status, answer


def assert_400(status, body, param: str, *words: str) -> None:
    hostile_2.assert_error(status, body, 400, param, *words)


no_tracebacks = hostile_2.no_tracebacks


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", '{"model": "tiny", "prompt": "hi", "max_tokens": %s}'),
    ("/v1/completions", '{"model": "tiny", "prompt": "hi", "metadata": %s}'),
    ("/v1/chat/completions", '{"model": "tiny", "messages": [], "temperature": %s}'),
    ("/v1/embeddings", '{"model": "tiny", "input": [%s]}'),
    ("/tokenize", '{"model": "tiny", "prompt": "hi", "x": %s}'),
    ("/detokenize", '{"model": "tiny", "tokens": [%s]}'),
])
def test_an_integer_past_4300_digits_is_a_400_on_the_body(router, caplog, path, body):
    status, answer = post(router, path, raw=(body % HUGE).encode())
    assert_400(status, answer, "body", "not valid JSON", "4300 digits")
    assert no_tracebacks(caplog)


@pytest.mark.parametrize("field", ["temperature", "repetition_penalty", "top_p", "min_p"])
@pytest.mark.parametrize("value", [10 ** 400, 10 ** 39, 1e308],
                         ids=["int-1e400", "int-1e39", "float-1e308"])
def test_a_number_beyond_float32_is_a_400_naming_the_field(router, caplog, field, value):
    status, answer = post(router, "/v1/completions",
                          {"model": MODEL, "prompt": "hi", "max_tokens": 2, field: value})
    assert_400(status, answer, field)
    assert no_tracebacks(caplog)


@pytest.mark.parametrize("bias", [
    {"4294967296": 1}, {"99999999999999999999": 1}, {HUGE: 1},  # ids past uint32 / int()
    {"1": 10 ** 400}, {"1": float("nan")},  # biases past any float, and not a number
])
def test_logit_bias_out_of_range_is_a_400(router, caplog, bias):
    raw = json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 2, "logit_bias": bias})
    status, answer = post(router, "/v1/completions", raw=raw.encode())
    assert_400(status, answer, "logit_bias")
    assert no_tracebacks(caplog)


def test_a_non_utf8_api_key_is_a_401_and_a_right_key_still_works(router, caplog):
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
    for path in ("/v1/completions", "/v1/embeddings", "/tokenize"):
        status, answer = post(router, path, {"model": MODEL, "input": "hi"}
                              if path == "/v1/embeddings" else
                              {"model": MODEL, "prompt": "hi"} if path == "/tokenize" else body,
                              headers={"Authorization": b"Bearer \xff\xfe"})
        assert status == 401, (path, answer)
    status, answer = post(router, "/v1/completions", body)
    assert status == 200 and answer["choices"][0]["text"] is not None
    assert no_tracebacks(caplog)


def test_non_utf8_session_and_tenant_headers_are_served(router, caplog):
    """(The session key is hashed only under session_affinity: tests/unit, rendezvous.)"""
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
    status, answer = post(router, "/v1/completions", body,
                          headers={"x-session-id": b"\xff\xfe", "x-tenant": b"\xc3("})
    assert status == 200, answer
    assert no_tracebacks(caplog)


def test_a_token_id_outside_the_vocabulary_is_named_as_the_prompt_sent(router):
    status, answer = post(router, "/v1/completions",
                          {"model": MODEL, "prompt": [5, 60000], "max_tokens": 2})
    assert_400(status, answer, "prompt", "prompt: 60000 is not a token id")


def test_deeply_nested_tool_call_arguments_render_as_sent(router, caplog):
    arguments = "[" * 100_000 + "]" * 100_000  # past the JSON parser's ~1,000 levels
    messages = USER + [{"role": "assistant", "tool_calls": [
        {"id": "1", "type": "function", "function": {"name": "f", "arguments": arguments}}]}]
    status, answer = post(router, "/v1/chat/completions",
                          {"model": MODEL, "messages": messages, "max_tokens": 1})
    # too long, not a 500; the conversation is what the client sent
    assert status == 400 and answer["error"]["param"] == "messages", answer
    assert no_tracebacks(caplog)


def test_tokenize_counts_the_prompt_chat_sends_with_tools_and_tool_results(router):
    """/tokenize renders tool calls, tool results and the tools the prompt shows as the chat
    route does: its count is the chat answer's usage.prompt_tokens."""
    tools = [{"type": "function", "function": {
        "name": "get_weather", "description": "The weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
    messages = USER + [
        {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "18 C, sunny"}]
    for with_tools in (False, True):
        extra = {"tools": tools} if with_tools else {}
        status, counted = post(router, "/tokenize", {"model": MODEL, "messages": messages,
                                                     **extra})
        assert status == 200, counted
        status, chat = post(router, "/v1/chat/completions",
                            {"model": MODEL, "messages": messages, "max_tokens": 1, **extra})
        assert status == 200, chat
        assert counted["count"] == chat["usage"]["prompt_tokens"], (with_tools, counted)
    status, answer = post(router, "/tokenize", {"model": MODEL, "messages": messages,
                                                "tools": [{"type": "function"}]})
    assert_400(status, answer, "tools")
    status, answer = post(router, "/tokenize", {"model": MODEL, "prompt": "hi", "tools": tools})
    assert_400(status, answer, "tools")


def grpc_error(stub_call, request, key=KEY):
    with pytest.raises(grpc.RpcError) as info:
        list(stub_call(request, metadata=(("authorization", f"Bearer {key}"),),
                       timeout=TIMEOUT_S))
    return info.value


def field_metadata(error) -> str | None:
    return dict(error.trailing_metadata() or ()).get("quire-error-field")


@pytest.mark.parametrize("target", ["router", "engine"])
def test_grpc_a_schema_with_a_huge_integer_names_its_field(router, engines, target):
    channel = grpc.insecure_channel(f"127.0.0.1:{router.port}" if target == "router"
                                    else address(engines[0]))
    stub = engine_pb2_grpc.EngineServiceStub(channel)
    request = pb.GenerateRequest(text="Hello", sampling=pb.SamplingOptions(
        max_tokens=3, structured_outputs=pb.StructuredOutputs(json='{"maxLength": ' + HUGE +
                                                              '}')))
    error = grpc_error(stub.Generate, request)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error
    # the field's path in the request sent, named alike by the router and the engine
    field = "sampling.structured_outputs.json"
    assert field_metadata(error) == field and "4300 digits" in error.details(), error
    channel.close()


@pytest.mark.parametrize("target", ["router", "engine"])
def test_grpc_a_request_id_is_bounded(router, engines, target):
    channel = grpc.insecure_channel(f"127.0.0.1:{router.port}" if target == "router"
                                    else address(engines[0]))
    stub = engine_pb2_grpc.EngineServiceStub(channel)
    long_id = "r" * (MAX_REQUEST_ID_CHARS + 1)
    error = grpc_error(stub.Generate, pb.GenerateRequest(
        request_id=long_id, text="Hello", sampling=pb.SamplingOptions(max_tokens=2)))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field_metadata(error) == "request_id", error
    with pytest.raises(grpc.RpcError) as info:
        stub.Embed(pb.EmbedRequest(request_id=long_id, text="Hello"),
                   metadata=(("authorization", f"Bearer {KEY}"),), timeout=TIMEOUT_S)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field_metadata(info.value) == "request_id", info.value
    ok = list(stub.Generate(pb.GenerateRequest(
        request_id="r" * MAX_REQUEST_ID_CHARS, text="Hello",
        sampling=pb.SamplingOptions(max_tokens=2)),
        metadata=(("authorization", f"Bearer {KEY}"),), timeout=TIMEOUT_S))
    assert ok and ok[-1].outputs[0].finish_reason
    channel.close()
