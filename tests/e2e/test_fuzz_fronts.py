"""A standing fuzz suite over both fronts (issue 20), on a tiny random model: generated JSON bodies
for /v1/completions and /v1/chat/completions, generated and garbage protobuf for Generate (through
the router and on the engine directly). For any client input: no 5xx, no INTERNAL / UNKNOWN,
every error names a field or the limit, and a bystander's requests sent alongside are served.

Bounded and deterministic by default: a fixed number of examples each, the same on every run
(the "deterministic" Hypothesis profile, tests/conftest.py), small ``max_tokens``; about a minute
on 2 cores. ``QUIRE_FUZZ=explore`` draws new examples on every run, many more of them; what it
finds is kept below as an explicit ``@example``."""

from __future__ import annotations

import http.client
import json
import re
import threading

import grpc
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from quire.v1 import engine_pb2 as pb
from tests.e2e.fuzz_stack import MODEL, engine, router  # noqa: F401 (fixtures)

pytestmark = pytest.mark.fuzz

# The loaded profile decides randomness (tests/conftest.py); exploring also sets the count.
EXPLORING = not settings.default.derandomize
FUZZ = settings(deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                      HealthCheck.function_scoped_fixture],
                **({} if EXPLORING else {"max_examples": 80}))
# "field: message", "field.sub[3].x: message", or "body key #2: message" (a key that cannot name
# itself: empty or not valid Unicode), as every front's errors begin
NAMES_A_FIELD = re.compile(r"^([A-Za-z_][\w.\[\]]*|body key #\d+): .+", re.S)
CLIENT_CODES = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT,
                grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.NOT_FOUND}


class Bystander:
    """Sends an unrelated small completion over and over while the fuzz runs; every one must
    be served."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.served = 0
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join(60)
        assert not self.failures, self.failures[:3]
        assert self.served >= 1

    def _run(self) -> None:
        body = json.dumps({"model": MODEL, "prompt": "bystander", "max_tokens": 2}).encode()
        while not self._stop.is_set():
            status, text = http_post(self.port, "/v1/completions", body)
            if status == 200:
                self.served += 1
            else:
                self.failures.append(f"{status} {text[:200]}")
            self._stop.wait(0.2)


def http_post(port: int, path: str, body: bytes) -> tuple[int, str]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        conn.request("POST", path, body=body, headers={"Content-Type": "application/json"})
        response = conn.getresponse()
        return response.status, response.read().decode("utf-8", "replace")
    finally:
        conn.close()


# ---- strategies -----------------------------------------------------------------------------

scalars = st.one_of(st.none(), st.booleans(), st.integers(-2 ** 70, 2 ** 70),
                    st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=12),
                    st.sampled_from([0, 1, -1, 2 ** 31, 2 ** 32, 2 ** 63, 2 ** 64, 0.5, "\ud800"]))
json_values = st.recursive(scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)),
    max_leaves=8)
small_ints = st.integers(-3, 8)
max_tokens = st.one_of(st.integers(1, 6), st.integers(-5, 0), st.integers(2 ** 31, 2 ** 70),
                       json_values)
text = st.text(max_size=40)
token_ids = st.lists(st.integers(-5, 60_000), min_size=0, max_size=12)

def mostly(valid, junk=json_values):
    """Well-typed three times in four, anything else the fourth."""
    return st.one_of(valid, valid, valid, junk)


SAMPLING = {
    "n": mostly(st.integers(1, 3), small_ints),
    "temperature": mostly(st.floats(0, 2), st.floats(allow_nan=False)),
    "top_p": mostly(st.floats(0.01, 1)), "top_k": mostly(small_ints),
    "min_p": mostly(st.floats(0, 1)), "presence_penalty": mostly(st.floats(-3, 3)),
    "frequency_penalty": mostly(st.floats(-3, 3)),
    "repetition_penalty": mostly(st.floats(-1, 3)),
    "seed": mostly(st.integers(0, 2 ** 63), st.integers(-2 ** 64, 2 ** 65)),
    "stop": mostly(st.one_of(text, st.lists(text, max_size=20))),
    "stop_token_ids": mostly(token_ids), "min_tokens": mostly(st.integers(0, 3), small_ints),
    "ignore_eos": mostly(st.booleans()), "stream": mostly(st.booleans()),
    "stream_options": mostly(st.just({"include_usage": True})),
    "model": mostly(st.just(MODEL), text), "max_tokens": max_tokens,
}
# Fields this server refuses (or ignores) in most forms: one now and then.
EXTRAS = {"best_of": json_values, "echo": json_values, "suffix": json_values,
          "user": json_values, "frobnicate": json_values, "logit_bias": json_values,
          "tools": json_values, "tool_choice": json_values, "response_format": json_values}
COMPLETION = SAMPLING | {"logprobs": mostly(st.integers(-1, 25))}
COMPLETION_PROMPT = mostly(st.one_of(text.filter(bool), token_ids, st.lists(text, max_size=3)))
message = mostly(st.fixed_dictionaries(
    {"role": mostly(st.sampled_from(["user", "system", "assistant"]),
                    st.sampled_from(["tool", "bogus"])),
     "content": mostly(text, st.lists(st.fixed_dictionaries(
         {"type": st.sampled_from(["text", "image_url"]), "text": text}), max_size=2))}))
CHAT = SAMPLING | {"max_completion_tokens": max_tokens, "logprobs": mostly(st.booleans()),
                   "top_logprobs": mostly(st.integers(-1, 25))}
CHAT_MESSAGES = mostly(st.lists(message, min_size=1, max_size=3))


@st.composite
def bodies(draw, fields: dict, prompt_field: str, prompt) -> dict:
    """A body: always a small max_tokens (so valid requests end fast) and usually a prompt,
    then a random subset of fields, most of them well-typed; now and then a field this server
    does not implement, or arbitrary JSON of any shape instead of a body."""
    # rare branches test a middle value: Hypothesis favours the ends of a range
    if draw(st.integers(0, 15)) == 7:
        return draw(json_values)
    body = {"max_tokens": draw(st.integers(1, 6))}
    if draw(st.integers(0, 9)) != 7:
        body[prompt_field] = draw(prompt)
    for name in draw(st.lists(st.sampled_from(sorted(fields)), max_size=5, unique=True)):
        body[name] = draw(fields[name])
    if draw(st.integers(0, 9)) == 7:
        name = draw(st.sampled_from(sorted(EXTRAS)))
        body[name] = draw(EXTRAS[name])
    return body


def check_http(status: int, text: str, sent) -> None:
    assert status < 500, (status, text, sent)
    if status >= 400:
        error = json.loads(text)["error"]
        assert error["param"] is None or error["param"].strip(), error  # "" names nothing
        assert NAMES_A_FIELD.match(error["message"]), error


def check_grpc(error: grpc.RpcError | None, sent) -> None:
    if error is None:
        return
    assert error.code() in CLIENT_CODES | {grpc.StatusCode.DEADLINE_EXCEEDED}, (
        error.code(), error.details(), sent)
    if error.code() == grpc.StatusCode.INVALID_ARGUMENT:
        assert NAMES_A_FIELD.match(error.details()), (error.details(), sent)


# ---- HTTP front -----------------------------------------------------------------------------

@pytest.mark.parametrize("path,strategy", [
    ("/v1/completions", bodies(COMPLETION, "prompt", COMPLETION_PROMPT)),
    ("/v1/chat/completions", bodies(CHAT, "messages", CHAT_MESSAGES))])
def test_http_front_answers_every_body_with_a_named_4xx_or_a_result(router, path, strategy):
    port = router.server.http_port

    @FUZZ
    @given(body=strategy)
    @example(body={"": "\ud800"})  # found on Zen 5: the error named no field (param "")
    @example(body={"\ud800": 1, "prompt": "hi"})  # a key that is not valid Unicode
    @example(body={"max_tokens": 2, "": 1})  # an unknown empty key
    @example(body={"max_tokens": 2, "a b": 1})  # an unknown key that is no identifier
    def run(body):
        raw = json.dumps(body).encode("utf-8", "surrogatepass")
        status, text = http_post(port, path, raw)
        check_http(status, text, body)

    with Bystander(port):
        run()


@FUZZ
@given(raw=st.one_of(st.binary(max_size=64), st.text(max_size=64).map(
    lambda t: t.encode("utf-8", "surrogatepass"))))
def test_http_front_answers_garbage_bytes_with_a_named_400(router, raw):
    status, text = http_post(router.server.http_port, "/v1/completions", raw)
    check_http(status, text, raw)


# ---- gRPC front -----------------------------------------------------------------------------

uint32 = st.integers(0, 2 ** 32 - 1)
sampling_options = st.builds(
    pb.SamplingOptions, n=st.one_of(st.integers(0, 4), uint32),
    temperature=st.floats(width=32, allow_nan=True), top_p=st.floats(width=32),
    top_k=st.integers(-2 ** 31, 2 ** 31 - 1), min_p=st.floats(width=32),
    repetition_penalty=st.floats(width=32), presence_penalty=st.floats(width=32),
    frequency_penalty=st.floats(width=32), seed=st.integers(0, 2 ** 64 - 1),
    max_tokens=st.one_of(st.integers(0, 6), uint32), min_tokens=st.one_of(st.integers(0, 6),
                                                                          uint32),
    stop=st.lists(st.text(max_size=300), max_size=20), stop_token_ids=st.lists(uint32, max_size=4),
    ignore_eos=st.booleans(), logprobs=st.one_of(st.integers(0, 25), uint32),
    prompt_logprobs=st.one_of(st.integers(0, 25), uint32), skip_special_tokens=st.booleans())


@st.composite
def generate_requests(draw) -> pb.GenerateRequest:
    request = pb.GenerateRequest(request_id=draw(st.text(max_size=8)),
                                 cache_salt=draw(st.text(max_size=8)),
                                 priority=draw(st.integers(-2 ** 31, 2 ** 31 - 1)))
    kind = draw(st.sampled_from(["text", "ids", "none"]))
    if kind == "text":
        request.text = draw(st.text(max_size=60))
    elif kind == "ids":
        request.token_ids.ids[:] = draw(st.lists(st.one_of(st.integers(0, 50_000), uint32),
                                                 max_size=12))
    if draw(st.booleans()):
        request.sampling.CopyFrom(draw(sampling_options))
    sampling = request.sampling
    if not sampling.HasField("max_tokens") or 6 < sampling.max_tokens <= 4096:
        sampling.max_tokens = 4  # quick when valid; above the cap it is refused
    return request


def _call(channel: grpc.Channel, payload: bytes) -> grpc.RpcError | None:
    generate = channel.unary_stream("/quire.v1.EngineService/Generate")
    try:
        list(generate(payload, timeout=20))
    except grpc.RpcError as e:
        return e
    return None


@pytest.mark.parametrize("target", ["router", "engine"])
def test_grpc_generate_answers_every_message_with_a_client_status(router, engine, target):
    port = router.port if target == "router" else engine.port

    @FUZZ
    @given(request=generate_requests())
    def run(request):
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            check_grpc(_call(channel, request.SerializeToString()), request)

    with Bystander(router.server.http_port):
        run()


@FUZZ
@given(payload=st.binary(max_size=80))
def test_grpc_generate_answers_garbage_bytes_with_invalid_argument(router, engine, payload):
    for port in (router.port, engine.port):
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            check_grpc(_call(channel, payload), payload)
