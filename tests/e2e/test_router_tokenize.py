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


def _client(router) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{router.server.http_port}/v1",
                         api_key=KEY, max_retries=0, timeout=TIMEOUT_S)


@pytest.mark.parametrize("fields", [
    {"add_generation_prompt": False},
    {"continue_final_message": True, "add_generation_prompt": False},
    {"add_special_tokens": True},
    {"chat_template_kwargs": {"enable_thinking": False}},
])
def test_chat_template_fields_reach_the_prompt(router, fields):
    """vLLM's chat-template fields on chat completions: the prompt sent is the one /tokenize
    renders with the same fields, and each field changes what it should."""
    messages = MESSAGES + ([{"role": "assistant", "content": "Blue"}]
                           if fields.get("continue_final_message") else [])
    _, plain = _post(router, "/tokenize", {"messages": messages})
    _, expected = _post(router, "/tokenize", {"messages": messages, **fields})
    with _client(router) as client:
        result = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1,
                                                extra_body=fields)
    assert result.usage.prompt_tokens == expected["count"]
    if fields.get("continue_final_message"):  # left open: no end-of-turn after "Blue"
        text = _post(router, "/detokenize", {"tokens": expected["tokens"]})[1]["prompt"]
        assert text.endswith("Blue")
    if "add_generation_prompt" in fields or "continue_final_message" in fields:
        assert expected["count"] < plain["count"]


def test_completion_add_special_tokens(router, engine_tokenizer):
    text = "The quick brown fox"
    with _client(router) as client:
        default = client.completions.create(model=MODEL, prompt=text, max_tokens=1)
        without = client.completions.create(model=MODEL, prompt=text, max_tokens=1,
                                            extra_body={"add_special_tokens": False})
    assert without.usage.prompt_tokens == len(engine_tokenizer.encode(
        text, add_special_tokens=False))
    assert default.usage.prompt_tokens == len(engine_tokenizer.encode(text))


def test_include_stop_str_and_skip_special_tokens(router, engine_tokenizer):
    with _client(router) as client:
        greedy = dict(model=MODEL, prompt="Once upon a time", max_tokens=12, temperature=0)
        text = client.completions.create(**greedy).choices[0].text
        stop = text[len(text) // 2:len(text) // 2 + 2]
        assert stop.strip(), text  # a visible stop string from the middle of the output
        cut = client.completions.create(**greedy, stop=[stop]).choices[0].text
        kept = client.completions.create(**greedy, stop=[stop], extra_body={
            "include_stop_str_in_output": True}).choices[0].text
        assert kept == cut + stop and text.startswith(kept)
        # force the end-of-turn special token: skipped from the text by default, kept on ask
        special = min(engine_tokenizer.eos_token_ids)
        forced = dict(model=MODEL, prompt="x", max_tokens=2, temperature=0,
                      logit_bias={str(special): 100},
                      extra_body={"ignore_eos": True})
        hidden = client.completions.create(**forced).choices[0].text
        shown_text = client.completions.create(**{**forced, "extra_body": {
            "ignore_eos": True, "skip_special_tokens": False}}).choices[0].text
    piece = engine_tokenizer.decode([special], skip_special_tokens=False)
    assert hidden == "" and shown_text == piece * 2


@pytest.mark.parametrize("path, body, param, status", [
    ("/v1/chat/completions", {"messages": MESSAGES, "chat_template": "{{ 1 }}"},
     "chat_template", 400),
    ("/v1/chat/completions", {"messages": MESSAGES, "chat_template_kwargs": {"tools": 1}},
     "chat_template_kwargs", 400),
    ("/v1/chat/completions", {"messages": MESSAGES, "continue_final_message": True},
     "continue_final_message", 400),
    ("/v1/chat/completions", {"messages": MESSAGES, "add_generation_prompt": "no"},
     "add_generation_prompt", 400),
    ("/v1/completions", {"prompt": "x", "spaces_between_special_tokens": False},
     "spaces_between_special_tokens", 400),
    ("/v1/completions", {"prompt": "x", "skip_special_tokens": 1}, "skip_special_tokens", 400),
    ("/v1/completions", {"prompt": "x", "include_stop_str_in_output": "y"},
     "include_stop_str_in_output", 400),
    ("/v1/completions", {"prompt": "x", "add_generation_prompt": True},
     "add_generation_prompt", 400),
])
def test_vllm_extra_fields_bad_input_is_named(router, path, body, param, status):
    got, answer = _post(router, path, {"model": MODEL, "max_tokens": 1, **body})
    assert got == status and answer["error"]["param"] == param, answer
    assert _post(router, "/v1/completions", {"model": MODEL, "prompt": "still served",
                                             "max_tokens": 1})[0] == 200


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


def test_tokenize_needs_no_engine(tiny_model_dir, engine_tokenizer):
    """/tokenize and /detokenize are the router's own: once an engine has joined they are
    answered with every engine gone, even if nothing asked while it served (a request that
    asked an engine would fail or hang)."""
    from tests.e2e.router_harness import start_engine, wait_for

    engine = start_engine(tiny_model_dir, max_model_len=512)
    running = RunningRouter([address(engine)], http_port=0, model_name=MODEL, api_keys=KEY)
    try:
        engine.close()
        assert wait_for(lambda: running.server.engine_states().get("serving", 0) == 0,
                        timeout_s=30), running.server.engine_states()
        body = {"model": MODEL, "messages": MESSAGES, "add_generation_prompt": True}
        status, tokens = _post(running, "/tokenize", body)
        assert status == 200, tokens
        rendered = engine_tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True)
        assert tokens["tokens"] == engine_tokenizer.encode(rendered, add_special_tokens=False)
        assert tokens["max_model_len"] == 512
        status, back = _post(running, "/detokenize", {"model": MODEL,
                                                      "tokens": tokens["tokens"]})
        assert (status, back) == (200, {"prompt": rendered})
        # a generation needs an engine: a 503 the client may retry, not a stale answer
        status, error = _post(running, "/v1/completions", {"model": MODEL, "prompt": "hi",
                                                          "max_tokens": 1})
        assert status == 503, error
    finally:
        running.close()
        if engine.thread.is_alive():
            engine.close()
