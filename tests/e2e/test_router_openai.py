"""The OpenAI HTTP front over real loopback: the official client against router + two engines."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import openai
import pytest

from quire.v1 import engine_pb2 as pb
from tests.e2e.router_harness import TIMEOUT_S, RunningRouter, address
from tests.e2e.test_router import engines as engines_fixture

MODEL = "tiny-llama"
PROMPT = "The quick brown fox jumps over the lazy dog"


engines = engines_fixture


@pytest.fixture(scope="module")
def router(engines):
    running = RunningRouter([address(e) for e in engines], http_port=0, model_name=MODEL)
    yield running
    running.close()


@pytest.fixture(scope="module")
def front(router):
    return router.server.front


@pytest.fixture(scope="module")
def client(front):
    with openai.OpenAI(base_url=f"http://127.0.0.1:{front.port}/v1", api_key="x",
                       max_retries=0, timeout=TIMEOUT_S) as c:
        yield c


def _grpc_text(router, text, max_tokens):  # noqa: F811
    request = pb.GenerateRequest(text=text, sampling=pb.SamplingOptions(
        temperature=0, max_tokens=max_tokens))
    stream = router.stub.Generate(request, timeout=TIMEOUT_S)
    pieces = [d.text for m in stream for d in m.outputs]
    return "".join(pieces)


def _http(front, method, path, body=None):
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(f"http://127.0.0.1:{front.port}{path}", data=data,
                                     method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=TIMEOUT_S) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def test_completions_match_grpc(router, client):  # noqa: F811
    expected = _grpc_text(router, PROMPT, 12)
    result = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0)
    assert result.choices[0].text == expected and expected
    assert result.choices[0].finish_reason in ("length", "stop")
    assert result.usage.prompt_tokens > 0 and result.usage.completion_tokens > 0
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12,
                                            temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 0


def test_repeated_prompt_reports_cached_tokens(client):
    prompt = " ".join(f"word{i}" for i in range(60))  # several full blocks
    client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    result = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    assert result.usage.prompt_tokens_details.cached_tokens > 0


def test_completions_n_seed_stop_logprobs(client):
    result = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, n=2,
                                       temperature=1.0, top_p=0.9, seed=7, logprobs=2)
    assert sorted(c.index for c in result.choices) == [0, 1]
    for choice in result.choices:
        lp = choice.logprobs
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) > 0
        # the chosen token and the top 2, as vLLM's
        assert all(len(top) <= 3 and token in top for token, top in zip(lp.tokens,
                                                                       lp.top_logprobs))
    again = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, n=2,
                                      temperature=1.0, top_p=0.9, seed=7, logprobs=2)
    assert [c.text for c in again.choices] == [c.text for c in result.choices]
    stopped = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=40,
                                        temperature=0, stop=["e"])
    assert "e" not in stopped.choices[0].text


def test_chat_completions(client):
    messages = [{"role": "system", "content": "You are terse."},
                {"role": "user", "content": "Say hello."}]
    result = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8,
                                            temperature=0, logprobs=True, top_logprobs=2)
    message = result.choices[0].message
    assert message.role == "assistant" and message.content
    # vLLM's field, null without a reasoning parser: vLLM's examples read message.reasoning
    assert message.reasoning is None
    assert len(result.choices[0].logprobs.content) == result.usage.completion_tokens
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8,
                                                 temperature=0, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == message.content
    assert chunks[-1].choices[0].finish_reason in ("length", "stop")
    two = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, n=2)
    assert sorted(c.index for c in two.choices) == [0, 1]


def test_logprobs_name_each_token_by_the_text_it_adds(client, front):
    """A character of several UTF-8 bytes comes in tokens that are no text alone (this
    tokenizer has no token holding all of "日"). In logprobs each of the sequence's tokens
    reads as the text it adds ("" until the character is whole, as vLLM's), so the tokens
    join into the text and text_offset indexes into it; chat's bytes are each token's own,
    joining into the content's UTF-8 (OpenAI's)."""
    text = "日本 🙂 héllo"
    for stream in (False, True):
        result = client.completions.create(model=MODEL, prompt=text, max_tokens=3,
                                           temperature=0, echo=True, logprobs=1, stream=stream)
        choices = list(result) if stream else [result]
        got = "".join(c.choices[0].text for c in choices)
        tokens = [t for c in choices for t in c.choices[0].logprobs.tokens]
        offsets = [o for c in choices for o in c.choices[0].logprobs.text_offset]
        assert got.startswith(text) and "".join(tokens) == got
        assert tokens[:2] == ["", "日"]  # 日's bytes: the first piece adds nothing
        assert all(got[at:at + len(t)] == t for at, t in zip(offsets, tokens))
        assert offsets == sorted(offsets) and offsets[-1] <= len(got)
    # vLLM's prompt_logprobs: each prompt token's decoded_token is the text it adds too
    positions = client.completions.create(model=MODEL, prompt=text, max_tokens=1, temperature=0,
                                          extra_body={"prompt_logprobs": 1}).choices[0]
    ids = json.loads(_http(front, "POST", "/tokenize", {"model": MODEL, "prompt": text})[1])[
        "tokens"]
    named = [p[str(t)]["decoded_token"] for p, t in zip(positions.prompt_logprobs[1:], ids[1:],
                                                          strict=True)]
    # position 0 has none; its token is the first piece of 日, which the next one completes
    assert "".join(named) == text and named[0] == "日"
    for stream in (False, True):
        result = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Say it."}], temperature=0,
            logprobs=True, top_logprobs=1, stream=stream,
            extra_body={"structured_outputs": {"choice": ["日"]}})
        chunks = list(result) if stream else [result]
        content = "".join((c.choices[0].delta.content if stream else c.choices[0].message.content)
                          or "" for c in chunks if c.choices)
        items = [i for c in chunks if c.choices and c.choices[0].logprobs
                 for i in c.choices[0].logprobs.content]
        if items and items[-1].token == "<|im_end|>":  # the stop token, named as itself
            items.pop()
        assert content == "日" and len(items) >= 2
        assert "".join(i.token for i in items) == content and items[0].token == ""
        assert b"".join(bytes(i.bytes) for i in items) == content.encode()


def test_models_health_metrics(client, front):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert _http(front, "GET", "/health")[0] == 200
    status, text = _http(front, "GET", "/metrics")
    assert status == 200 and "quire_router_http_requests_total" in text
    assert 'quire_router_engines{state="serving"} 2.0' in text
    assert "quire_router_placement_seconds_count" in text


@pytest.mark.parametrize("create, kwargs, param", [
    ("completions", dict(prompt=PROMPT, temperature=-1), "temperature"),
    ("completions", dict(prompt=PROMPT, n=0), "n"),
    ("completions", dict(prompt=PROMPT, logprobs=99), "logprobs"),
    ("completions", dict(prompt="", max_tokens=4), "prompt"),
    ("chat", dict(messages=[]), "messages"),
    ("chat", dict(messages=[{"role": "user", "content": "hi"}], top_p=0), "top_p"),
    ("chat", dict(messages=[{"role": "user", "content": "hi"}], top_logprobs=2),
     "top_logprobs"),
])
def test_bad_input_is_a_400_naming_the_field(client, create, kwargs, param):
    api = client.chat.completions if create == "chat" else client.completions
    with pytest.raises(openai.BadRequestError) as err:
        api.create(model=MODEL, **kwargs)
    assert err.value.status_code == 400
    assert err.value.body["param"] == param and err.value.body["type"] == "invalid_request_error"
    assert param in err.value.body["message"]
    ok = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, temperature=0)
    assert ok.choices[0].finish_reason in ("length", "stop")


def test_missing_messages_and_bad_json_are_json_400s(front):
    status, text = _http(front, "POST", "/v1/chat/completions", {"model": MODEL})
    assert status == 400 and json.loads(text)["error"]["param"] == "messages"
    status, text = _http(front, "POST", "/v1/completions", None)
    assert status == 400 and "error" in json.loads(text)
    status, text = _http(front, "POST", "/v1/completions", {"model": "other", "prompt": "x"})
    assert status == 404 and json.loads(text)["error"]["param"] == "model"
    status, text = _http(front, "GET", "/v1/nope")
    assert status == 404 and "error" in json.loads(text)


def test_engine_rejection_maps_to_400_and_streams_end_with_done(front, client):
    status, text = _http(front, "POST", "/v1/completions",
                         {"model": MODEL, "prompt": list(range(100, 2100)), "max_tokens": 4})
    assert status == 400 and json.loads(text)["error"]["type"] == "invalid_request_error"
    request = urllib.request.Request(
        f"http://127.0.0.1:{front.port}/v1/completions", method="POST",
        data=json.dumps({"model": MODEL, "prompt": PROMPT, "max_tokens": 3, "n": 2,
                         "stream": True}).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=TIMEOUT_S) as response:
        events = [e for e in response.read().decode().split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events) and events[-1] == "data: [DONE]"
    indices = {c["index"] for e in events[:-1] for c in json.loads(e[6:])["choices"]}
    assert indices == {0, 1}
    assert client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1).choices
