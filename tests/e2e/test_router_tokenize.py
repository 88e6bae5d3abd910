"""vLLM's /tokenize and /detokenize on the router's HTTP front (no engine asked), and chat
``top_logprobs`` streamed and not, over real loopback with API keys on."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import openai
import pytest

from engine_worker.tokenizer import Tokenizer
from quire.v1 import engine_pb2 as pb
from tests.e2e.router_harness import TIMEOUT_S, RunningRouter, address, engine_fleet

MODEL = "tiny-llama"
KEY = "sk-test"
MESSAGES = [{"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Name a colour. ünïcode ✓"}]


@pytest.fixture(scope="module")
def engines(tiny_model_dir):
    yield from engine_fleet(tiny_model_dir, count=1, max_model_len=512)


@pytest.fixture(scope="module")
def router(engines):
    running = RunningRouter([address(e) for e in engines], http_port=0, model_name=MODEL,
                            api_keys=KEY)
    yield running
    running.close()


@pytest.fixture(scope="module")
def engine_tokenizer(tiny_model_dir):
    return Tokenizer(tiny_model_dir)


def _post(router, path, body, key=KEY):
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    request = urllib.request.Request(f"http://127.0.0.1:{router.server.http_port}{path}",
                                     data=json.dumps(body).encode(), method="POST",
                                     headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=TIMEOUT_S) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _engine_prompt_ids(engine, text: str) -> list[int]:
    """The engine's own tokenization of ``text``: its first Generate message says it."""
    import grpc

    from quire.v1 import engine_pb2_grpc

    with grpc.insecure_channel(address(engine)) as channel:
        stub = engine_pb2_grpc.EngineServiceStub(channel)
        stream = stub.Generate(pb.GenerateRequest(text=text, sampling=pb.SamplingOptions(
            max_tokens=1, temperature=0)), timeout=TIMEOUT_S)
        return list(next(iter(stream)).prompt_token_ids)


def test_tokenize_prompt_equals_the_engines(router, engines):
    text = "The quick brown fox, ünïcode ✓ and   spaces"
    status, body = _post(router, "/tokenize", {"model": MODEL, "prompt": text})
    assert status == 200
    assert body["tokens"] == _engine_prompt_ids(engines[0], text)
    assert body["count"] == len(body["tokens"]) and body["max_model_len"] == 512
    assert body["token_strs"] is None
    status, strs = _post(router, "/tokenize", {"prompt": text, "return_token_strs": True})
    assert status == 200 and len(strs["token_strs"]) == strs["count"]
    status, back = _post(router, "/detokenize", {"model": MODEL, "tokens": body["tokens"]})
    assert status == 200 and back == {"prompt": text}


def test_tokenize_chat_equals_the_engines_template(router, engine_tokenizer):
    for add in (True, False):
        status, body = _post(router, "/tokenize", {"model": MODEL, "messages": MESSAGES,
                                                   "add_generation_prompt": add})
        assert status == 200
        rendered = engine_tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=add)
        assert body["tokens"] == engine_tokenizer.encode(rendered, add_special_tokens=False)
    partial = MESSAGES + [{"role": "assistant", "content": "Blue"}]
    status, body = _post(router, "/tokenize", {"messages": partial,
                                               "continue_final_message": True})
    assert status == 200
    text = _post(router, "/detokenize", {"tokens": body["tokens"]})[1]["prompt"]
    assert text.endswith("Blue")


def test_chat_prompt_tokens_match_tokenize(router):
    """What /tokenize says a chat prompt is, the chat route sends to the engine."""
    _, body = _post(router, "/tokenize", {"messages": MESSAGES})
    with openai.OpenAI(base_url=f"http://127.0.0.1:{router.server.http_port}/v1", api_key=KEY,
                       max_retries=0, timeout=TIMEOUT_S) as client:
        result = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=1)
    assert result.usage.prompt_tokens == body["count"]


@pytest.mark.parametrize("path, body, param, status", [
    ("/tokenize", {"model": MODEL}, "prompt", 400),
    ("/tokenize", {"prompt": 5}, "prompt", 400),
    ("/tokenize", {"prompt": "x", "messages": MESSAGES}, "prompt", 400),
    ("/tokenize", {"prompt": "x", "add_generation_prompt": True}, "add_generation_prompt", 400),
    ("/tokenize", {"messages": []}, "messages", 400),
    ("/tokenize", {"messages": MESSAGES, "continue_final_message": True},
     "continue_final_message", 400),
    ("/tokenize", {"prompt": "x", "add_special_tokens": "yes"}, "add_special_tokens", 400),
    ("/tokenize", {"messages": MESSAGES, "chat_template_kwargs": [1]}, "chat_template_kwargs",
     400),
    ("/tokenize", {"prompt": "x", "tools": []}, "tools", 400),
    ("/tokenize", {"prompt": "x", "model": "other"}, "model", 404),
    ("/detokenize", {"tokens": "abc"}, "tokens", 400),
    ("/detokenize", {"tokens": [1, -2]}, "tokens", 400),
    ("/detokenize", {"tokens": [1, 10 ** 6]}, "tokens", 400),
    ("/detokenize", {"tokens": [1], "prompt": "x"}, "prompt", 400),
])
def test_bad_input_is_named(router, path, body, param, status):
    got, answer = _post(router, path, body)
    assert got == status and answer["error"]["param"] == param, answer
    assert param in answer["error"]["message"]
    assert _post(router, "/tokenize", {"prompt": "still served"})[0] == 200


def test_api_key_is_required(router):
    for path, body in (("/tokenize", {"prompt": "x"}), ("/detokenize", {"tokens": [1]})):
        status, answer = _post(router, path, body, key=None)
        assert status == 401 and answer["error"]["param"] == "authorization"
        assert _post(router, path, body, key="wrong")[0] == 401


def test_chat_top_logprobs_streamed_and_not(router):
    with openai.OpenAI(base_url=f"http://127.0.0.1:{router.server.http_port}/v1", api_key=KEY,
                       max_retries=0, timeout=TIMEOUT_S) as client:
        kwargs = dict(model=MODEL, messages=MESSAGES, max_tokens=6, temperature=0,
                      logprobs=True, top_logprobs=3)
        whole = client.chat.completions.create(**kwargs).choices[0].logprobs.content
        chunks = list(client.chat.completions.create(stream=True, **kwargs))
        streamed = [e for c in chunks if c.choices and c.choices[0].logprobs
                    for e in c.choices[0].logprobs.content]
        assert len(whole) == 6 and [e.token for e in streamed] == [e.token for e in whole]
        for entry, other in zip(whole, streamed):
            assert len(entry.top_logprobs) == 3 and entry.bytes == list(entry.token.encode())
            assert entry.logprob == pytest.approx(other.logprob, abs=1e-4)
            # greedy: the chosen token is the most likely one
            assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob, abs=1e-5)
        zero = client.chat.completions.create(**{**kwargs, "top_logprobs": 0})
        assert all(e.top_logprobs == [] for e in zero.choices[0].logprobs.content)
        for bad in (21, -1):
            with pytest.raises(openai.BadRequestError) as err:
                client.chat.completions.create(**{**kwargs, "top_logprobs": bad})
            assert err.value.body["param"] == "top_logprobs"
