"""Hostile input, seventh round: what a probe of a running stack found (thirty-second
session), against a real router over two real tiny-model engines on loopback (two, because
the router retries a request on another engine when the first fails before any output)."""

from __future__ import annotations

import http.client
import json
import time

import grpc
import pytest

from quire.errors import FIELD_METADATA
from quire.v1 import engine_pb2 as pb
from tests.e2e import test_hostile_input_3 as hostile_3
from tests.e2e.router_harness import TIMEOUT_S, engine_fleet

MODEL, KEY = hostile_3.MODEL, hostile_3.KEY
router = hostile_3.router  # (its router, over this module's two engines)
assert_400, no_tracebacks = hostile_3.assert_400, hostile_3.no_tracebacks


def exchange(router, method: str, path: str, body=None) -> tuple[int, str]:
    """(status, body text) of one request with the API key, a stream read to its end."""
    conn = http.client.HTTPConnection("127.0.0.1", router.server.http_port, timeout=TIMEOUT_S)
    try:
        conn.request(method, path, body=None if body is None else json.dumps(body),
                     headers={"Content-Type": "application/json",
                              "Authorization": f"Bearer {KEY}"})
        response = conn.getresponse()
        return response.status, response.read().decode()
    finally:
        conn.close()


@pytest.fixture(scope="module")
def engines(tiny_model_dir):
    yield from engine_fleet(tiny_model_dir, count=2, max_model_len=512)


def _serving(router) -> int:
    status, body = exchange(router, "GET", "/health")
    return json.loads(body)["serving_engines"] if status == 200 else -1


NO_TOKEN_BODIES = [
    # the probe's: the grammar allows only ",", bad_words bans it; top-p drew index -1 and
    # failed the step, the engine stopped serving, and the router's retry took the other too
    ("bad_words", {"prompt": "x", "structured_outputs": {"regex": ","}, "bad_words": [","],
                   "top_p": 0.9}),
    ("bad_words", {"prompt": "x", "structured_outputs": {"regex": ","}, "bad_words": [","],
                   "temperature": 0}),  # greedy: a 200 whose token broke both
    ("allowed_token_ids", {"prompt": "Answer:", "allowed_token_ids": [28], "top_p": 0.5,
                           "structured_outputs": {"choice": ["yes", "no"]}}),
    # no grammar: bad_words ban the whole allowed list ("," is token 28 here); an allowed
    # list lifted the bans, so "," came out while it was banned
    ("bad_words", {"prompt": "x", "allowed_token_ids": [28], "bad_words": [","]}),
    # the conflict after a first token the grammar and the ban both allow
    ("bad_words", {"prompt": "x", "structured_outputs": {"regex": "a,"}, "bad_words": [","]}),
]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("field,body", NO_TOKEN_BODIES)
def test_constraints_that_leave_no_token_are_the_clients_error(router, caplog, path, stream,
                                                                field, body):
    if "chat" in path:
        body = {k: v for k, v in body.items() if k != "prompt"} | {
            "messages": [{"role": "user", "content": body["prompt"]}]}
    body = body | {"model": MODEL, "max_tokens": 4, "stream": stream}
    status, answer = exchange(router, "POST", path, body)
    if status == 200:  # a stream that began before the conflict: it ends with the error
        assert stream and "a," in json.dumps(body)
        errors = [json.loads(line[6:]) for line in answer.splitlines()
                  if line.startswith("data: {") and '"error"' in line]
        assert errors and errors[-1]["error"]["param"] == field, answer
        assert errors[-1]["error"]["code"] == 400
    else:
        assert_400(status, json.loads(answer), field, field, "left no token")
    # nothing else was lost: both engines serve, and a plain request is answered
    assert _serving(router) == 2
    assert exchange(router, "POST", path, {k: v for k, v in body.items()
                                           if k in ("model", "messages", "prompt")} | {
        "max_tokens": 2})[0] == 200
    assert no_tracebacks(caplog)


def test_grpc_gets_invalid_argument_naming_the_field(router):
    request = pb.GenerateRequest(text="x", sampling=pb.SamplingOptions(
        max_tokens=4, top_p=0.9, bad_words=[","],
        structured_outputs=pb.StructuredOutputs(regex=",")))
    with pytest.raises(grpc.RpcError) as err:
        list(router.stub.Generate(request, timeout=TIMEOUT_S,
                                  metadata=(("authorization", f"Bearer {KEY}"),)))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert dict(err.value.trailing_metadata())[FIELD_METADATA] == "sampling.bad_words"
    assert _serving(router) == 2


def _strict(constant: str):
    raise AssertionError(f"{constant} in an answer: not JSON")


@pytest.mark.parametrize("field,extra", [
    ("user", {"user": float("nan")}),
    ("user", {"user": 5}),
    ("metadata", {"metadata": {"a": float("inf")}}),
    ("metadata", {"metadata": {"a": 1}}),
    ("reasoning", {"reasoning": {"effort": "low", "summary": float("nan")}}),
    ("text", {"text": {"format": {"type": "text"}, "verbosity": float("-inf")}}),
    ("tools", {"tools": [{"type": "function", "name": "f", "strict": float("nan")}]}),
])
@pytest.mark.parametrize("stream", [False, True])
def test_responses_never_echo_what_json_cannot_hold(router, caplog, field, extra, stream):
    """The Responses answer echoes user, metadata, reasoning, text and tools as sent; NaN and
    Infinity (which Python's parser takes) came back bare in a 200, which strict parsers
    (openai-node, Go) fail on. Now a 400 naming the field; a string user, string metadata."""
    status, answer = exchange(router, "POST", "/v1/responses", {
        "model": MODEL, "input": "hi", "max_output_tokens": 2, "stream": stream} | extra)
    assert_400(status, json.loads(answer, parse_constant=_strict), field, field)
    assert no_tracebacks(caplog)


@pytest.mark.parametrize("sent,param", [
    ({"max_tokens": 5}, "max_tokens"), ({"messages": []}, "messages"),
    ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"reasoning_effort": "low"}, "reasoning_effort"), ({"prompt": {"id": "p"}}, "prompt"),
])
def test_responses_errors_name_the_field_sent(router, sent, param):
    """A chat field sent to /v1/responses was reported as its Responses name (the one the
    request had right): "max_output_tokens: unknown field" for max_tokens."""
    status, answer = exchange(router, "POST", "/v1/responses",
                              {"model": MODEL, "input": "hi"} | sent)
    assert_400(status, json.loads(answer), param, param)


def test_responses_take_tool_choice_auto_without_tools(router):
    """"auto" is the Responses default, sent by clients whatever their tools (OpenAI and vLLM
    take it without any); chat's rule, a tool for "auto", does not apply."""
    for tools in ({}, {"tools": []}):
        status, answer = exchange(router, "POST", "/v1/responses", {
            "model": MODEL, "input": "hi", "max_output_tokens": 2, "tool_choice": "auto"} | tools)
        assert status == 200, answer
        assert json.loads(answer)["tool_choice"] == "auto"


def test_a_small_chat_does_not_wait_behind_large_renders(router):
    """Every render and tokenization shared one FIFO pool, so a 2-token chat waited behind
    big /tokenize calls (up to 5 s behind two dozen 1 MB ones). Small jobs now run inline:
    with every pool thread held, a small chat, /tokenize and /detokenize are answered, and
    a large /tokenize waits for the pool (it is not run on the loop)."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    renderer = router.server.front._render
    release = threading.Event()
    held = [renderer.pool.submit(release.wait) for _ in range(renderer.pool._max_workers)]
    try:
        status, answer = exchange(router, "POST", "/v1/chat/completions", {
            "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
        assert status == 200, answer
        assert exchange(router, "POST", "/tokenize", {"model": MODEL, "prompt": "hi"})[0] == 200
        assert exchange(router, "POST", "/detokenize", {"model": MODEL, "tokens": [28]})[0] \
            == 200
        with ThreadPoolExecutor(1) as client:
            large = client.submit(exchange, router, "POST", "/tokenize",
                                  {"model": MODEL, "prompt": "ab " * 2000})
            # it waits in the pool's queue behind the held threads, not on the loop
            deadline = time.monotonic() + TIMEOUT_S
            while renderer.pool._work_queue.qsize() < 1 and time.monotonic() < deadline:
                time.sleep(0.01)
            assert renderer.pool._work_queue.qsize() == 1 and not large.done()
            release.set()
            status, answer = large.result(timeout=TIMEOUT_S)
        assert status == 200 and json.loads(answer)["count"] > 2000
    finally:
        release.set()
        for future in held:
            future.result(timeout=TIMEOUT_S)



@pytest.mark.parametrize("salt", ["a/b", "@", "a\x00b", "x" * 129, "s" * (4 << 20)])
def test_grpc_checks_cache_salt_as_http_does(router, engines, salt):
    """gRPC took any cache salt (NUL, '/', 4 MB), which reaches block hashes and KV event
    wires; HTTP refused these as vLLM does. Both fronts, the router's and an engine's own, now
    share one check."""
    auth = (("authorization", f"Bearer {KEY}"),)
    generate = pb.GenerateRequest(text="x", cache_salt=salt,
                                  sampling=pb.SamplingOptions(max_tokens=2))
    embed = pb.EmbedRequest(text="x", cache_salt=salt)
    for call, message, metadata in ((router.stub.Generate, generate, auth),
                                    (engines[0].stub.Generate, generate, ()),
                                    (router.stub.Embed, embed, auth),
                                    (engines[0].stub.Embed, embed, ())):
        with pytest.raises(grpc.RpcError) as err:
            answer = call(message, timeout=TIMEOUT_S, metadata=metadata)
            if message is generate:  # a stream: its error comes as it is read
                list(answer)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value
        assert dict(err.value.trailing_metadata())[FIELD_METADATA] == "cache_salt"
