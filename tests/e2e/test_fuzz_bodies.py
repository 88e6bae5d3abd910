"""Fuzzing the HTTP front's body handling and list limits (issue 32) on a real router and a
tiny-model engine (max_model_len 1024, vocabulary 49152): compressed bodies of every kind are a
415 answered from the headers, and lists of every length around their limits are served or
refused exactly at the limit, naming the field and the limit.

Deterministic: every property runs derandomized (the same examples on every run, boundaries
included by ``@example``), with small ``max_tokens``; under a minute on 2 cores."""

from __future__ import annotations

import gzip
import http.client
import json
import zlib

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from quire.list_limits import MAX_CHAT_MESSAGES, MAX_CONTENT_PARTS, MAX_STOP_TOKEN_IDS
from tests.e2e.fuzz_stack import MODEL, engine, router  # noqa: F401 (fixtures)
from tests.e2e.router_harness import TIMEOUT_S

pytestmark = pytest.mark.fuzz

VOCAB_SIZE = 49152
MAX_MODEL_LEN = 1024
MAX_STOP_STRINGS = 16  # the router's default max_stop_strings
FUZZ = settings(derandomize=True, max_examples=25, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow,
                                       HealthCheck.function_scoped_fixture])


def post(port: int, path: str, raw: bytes, headers: dict | None = None):
    """(status, headers, parsed JSON) of one POST over a fresh connection."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=TIMEOUT_S)
    try:
        conn.request("POST", path, body=raw,
                     headers={"Content-Type": "application/json", **(headers or {})})
        response = conn.getresponse()
        return response.status, response.headers, json.loads(response.read() or b"null")
    finally:
        conn.close()


# ---- compressed bodies ----------------------------------------------------------------------

VALID = json.dumps({"prompt": "hi", "max_tokens": 1}).encode()
encodings = st.sampled_from(["gzip", "deflate", "br", "zstd", "compress", "x-gzip", "GZIP",
                             " deflate ", "gzip, deflate", "identity, gzip", "bogus"])
compressed = st.one_of(
    st.binary(max_size=128),  # anything at all
    st.just(gzip.compress(VALID)), st.just(zlib.compress(VALID)),  # well-formed, valid JSON
    st.integers(1, 1 << 22).map(lambda n: gzip.compress(bytes(n))),  # small bombs
    st.binary(max_size=32).map(lambda b: b"\x1f\x8b" + b))  # a gzip header, then junk


@FUZZ
@given(encoding=encodings, body=compressed,
       path=st.sampled_from(["/v1/completions", "/v1/chat/completions"]))
@example(encoding="gzip", body=b"\x1f\x8b" + bytes(18), path="/v1/completions")
@example(encoding="deflate", body=b"not-deflate", path="/v1/chat/completions")
def test_a_compressed_body_is_a_415_answered_from_the_headers(router, encoding, body, path):
    status, headers, answer = post(router.server.http_port, path, body,
                                   {"Content-Encoding": encoding})
    assert status == 415, answer
    assert answer["error"]["param"] == "body" and "Content-Encoding" in \
        answer["error"]["message"], answer
    assert headers["Accept-Encoding"] == "identity" and headers["Connection"] == "close"


@FUZZ
@given(encoding=st.sampled_from(["identity", "IDENTITY", " identity", ""]),
       body=st.sampled_from([VALID, b"{", gzip.compress(VALID)]))
def test_an_identity_body_is_read_as_sent(router, encoding, body):
    status, _, answer = post(router.server.http_port, "/v1/completions", body,
                             {"Content-Encoding": encoding})
    if body == VALID:
        assert status == 200, answer
    else:  # not JSON as sent: nothing was inflated
        assert status == 400 and answer["error"]["param"] == "body", answer


# ---- list lengths around their limits -------------------------------------------------------

def lengths(limit: int):
    """Lengths around ``limit`` (both sides of it) and far beyond."""
    return st.one_of(st.sampled_from([0, 1, limit - 1, limit, limit + 1]),
                     st.integers(0, 3 * limit))


def completion(port: int, body: dict):
    return post(port, "/v1/completions", json.dumps({"max_tokens": 1, **body}).encode())


def assert_limit_error(status, answer, param: str, *words: str) -> None:
    assert status == 400, answer
    assert answer["error"]["param"] == param, answer
    for word in words:
        assert word in answer["error"]["message"], answer


@FUZZ
@given(num_ids=lengths(MAX_STOP_TOKEN_IDS), out_of_vocab=st.booleans(),
       first=st.integers(0, VOCAB_SIZE - 1))
@example(num_ids=500_000, out_of_vocab=False, first=5)
def test_stop_token_ids_are_served_up_to_their_limit(router, num_ids, out_of_vocab, first):
    ids = [first] * num_ids
    if out_of_vocab and ids:
        ids[-1] = VOCAB_SIZE + first
    status, _, answer = completion(router.server.http_port,
                                   {"prompt": "hi", "stop_token_ids": ids})
    if num_ids > MAX_STOP_TOKEN_IDS:
        assert_limit_error(status, answer, "stop_token_ids", f"at most {MAX_STOP_TOKEN_IDS}",
                           f"got {num_ids}")
    elif out_of_vocab and ids:
        assert_limit_error(status, answer, "stop_token_ids", str(VOCAB_SIZE + first),
                           f"[0, {VOCAB_SIZE})")
    else:
        assert status == 200, answer


@FUZZ
@given(num_stops=lengths(MAX_STOP_STRINGS))
def test_stop_strings_are_served_up_to_their_limit(router, num_stops):
    stops = [f"#{i}#" for i in range(num_stops)]
    status, _, answer = completion(router.server.http_port, {"prompt": "hi", "stop": stops})
    if num_stops > MAX_STOP_STRINGS:
        assert_limit_error(status, answer, "stop", f"at most {MAX_STOP_STRINGS}")
    else:
        assert status == 200, answer


@FUZZ
@given(num_ids=lengths(MAX_MODEL_LEN), max_tokens=st.one_of(st.none(), st.integers(1, 8)))
@example(num_ids=MAX_MODEL_LEN - 4, max_tokens=5)
def test_token_id_prompts_are_served_up_to_the_models_length(router, num_ids, max_tokens):
    body = {"prompt": [7] * num_ids, "ignore_eos": True}
    if max_tokens is not None:
        body["max_tokens"] = max_tokens
    status, _, answer = post(router.server.http_port, "/v1/completions",
                             json.dumps(body).encode())
    if num_ids == 0:
        assert_limit_error(status, answer, "prompt")
    elif num_ids >= MAX_MODEL_LEN:
        assert_limit_error(status, answer, "prompt", f"max_model_len={MAX_MODEL_LEN}")
    else:  # a max_tokens past the context is cut to fit, as vLLM 0.32 cuts it
        assert status == 200, answer
        room = MAX_MODEL_LEN - num_ids
        # completions' default when max_tokens is not sent: 16 (OpenAI's and vLLM's)
        wanted = 16 if max_tokens is None else max_tokens
        assert answer["usage"]["completion_tokens"] == min(room, wanted)


@FUZZ
@given(num_messages=lengths(MAX_CHAT_MESSAGES), num_parts=lengths(MAX_CONTENT_PARTS))
def test_chat_messages_and_parts_are_refused_only_beyond_their_limits(router, num_messages,
                                                                      num_parts):
    parts = [{"type": "text", "text": "a"}] * num_parts
    messages = [{"role": "user", "content": "b"}] * num_messages
    if messages:
        messages[-1] = {"role": "user", "content": parts}
    status, _, answer = post(router.server.http_port, "/v1/chat/completions",
                             json.dumps({"messages": messages, "max_tokens": 1}).encode())
    if num_messages == 0:
        assert_limit_error(status, answer, "messages", "non-empty")
    elif num_messages > MAX_CHAT_MESSAGES:
        assert_limit_error(status, answer, "messages", f"at most {MAX_CHAT_MESSAGES} messages")
    elif num_parts > MAX_CONTENT_PARTS:
        assert_limit_error(status, answer, "messages", f"at most {MAX_CONTENT_PARTS} parts")
    else:  # within the limits: served, unless the rendered conversation is too long
        assert status == 200 or answer["error"]["param"] == "messages", answer
