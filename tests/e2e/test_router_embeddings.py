"""Embeddings through the router: the official ``openai`` client's ``embeddings.create`` over
real loopback (router + two engines), gRPC ``Embed`` on the router, prefix-aware placement,
a ``--runner pooling`` engine beside a generating one, and every bad input a 400 naming it."""

from __future__ import annotations

import base64
import json
import struct
import urllib.error
import urllib.request

import grpc
import openai
import pytest
import torch

from engine_worker.tokenizer import Tokenizer
from quire.v1 import engine_pb2 as pb
from tests.e2e.router_harness import (TIMEOUT_S, RunningRouter, address, engine_fleet,
                                      start_engine)
from tests.e2e.test_embeddings import ATOL, hf_embeddings

MODEL = "tiny-llama"
TEXTS = ["The quick brown fox", "jumps over the lazy dog " * 6, "ünïcode ✓", "a"]


@pytest.fixture(scope="module")
def engines(tiny_model_dir):
    yield from engine_fleet(tiny_model_dir, count=2, max_model_len=256, dtype="float32")


@pytest.fixture(scope="module")
def router(engines):
    running = RunningRouter([address(e) for e in engines], http_port=0, model_name=MODEL)
    yield running
    running.close()


@pytest.fixture(scope="module")
def client(router):
    with openai.OpenAI(base_url=f"http://127.0.0.1:{router.server.http_port}/v1",
                       api_key="x", max_retries=0, timeout=TIMEOUT_S) as c:
        yield c


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return Tokenizer(tiny_model_dir)


def _post(router, body):
    request = urllib.request.Request(
        f"http://127.0.0.1:{router.server.http_port}/v1/embeddings",
        data=json.dumps(body).encode(), method="POST",
        headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=TIMEOUT_S) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _assert_close(vectors, refs):
    assert len(vectors) == len(refs)
    for vector, ref in zip(vectors, refs):
        assert torch.allclose(torch.tensor(vector, dtype=torch.float32), ref, atol=ATOL)


def test_openai_client_embeddings_equal_transformers(client, tokenizer, tiny_model_dir):
    refs = hf_embeddings(tiny_model_dir, [tokenizer.encode(t) for t in TEXTS], "LAST")
    # the client asks for base64 by default and decodes it
    result = client.embeddings.create(model=MODEL, input=TEXTS)
    assert [d.index for d in result.data] == list(range(len(TEXTS)))
    _assert_close([d.embedding for d in result.data], refs)
    assert result.usage.prompt_tokens == sum(len(tokenizer.encode(t)) for t in TEXTS)
    floats = client.embeddings.create(model=MODEL, input=TEXTS[0], encoding_format="float")
    _assert_close([floats.data[0].embedding], refs[:1])
    ids = [tokenizer.encode(t) for t in TEXTS[:2]]
    by_ids = client.embeddings.create(model=MODEL, input=ids, encoding_format="float")
    _assert_close([d.embedding for d in by_ids.data], refs[:2])
    one = client.embeddings.create(model=MODEL, input=ids[1], encoding_format="float")
    _assert_close([one.data[0].embedding], refs[1:2])


def test_base64_is_little_endian_float32(router, client):
    status, body = _post(router, {"model": MODEL, "input": TEXTS[0],
                                  "encoding_format": "base64"})
    assert status == 200
    raw = base64.b64decode(body["data"][0]["embedding"])
    decoded = struct.unpack(f"<{len(raw) // 4}f", raw)
    floats = client.embeddings.create(model=MODEL, input=TEXTS[0], encoding_format="float")
    assert list(decoded) == pytest.approx(floats.data[0].embedding, abs=1e-6)
    raw_vec = _post(router, {"input": TEXTS[0], "normalize": False,
                             "encoding_format": "float"})[1]["data"][0]["embedding"]
    assert torch.tensor(raw_vec).norm().item() != pytest.approx(1.0, abs=1e-3)


def test_truncate_prompt_tokens_keeps_the_first_tokens_as_vllm_032(client, tiny_model_dir):
    """vLLM 0.32 cuts a pooling model's prompt at its end (truncation_side "right", its
    default there): the first k tokens; "left" keeps the last k. Above max_model_len: 400."""
    ids = list(range(2000, 2300))  # longer than max_model_len (256)
    for keep, side, kept in ((100, None, ids[:100]), (100, "left", ids[-100:]),
                             (-1, None, ids[:256])):
        result = client.embeddings.create(model=MODEL, input=ids, encoding_format="float",
                                          extra_body={"truncate_prompt_tokens": keep} | (
                                              {"truncation_side": side} if side else {}))
        assert result.usage.prompt_tokens == len(kept)
        _assert_close([result.data[0].embedding], hf_embeddings(tiny_model_dir, [kept], "LAST"))


def test_embed_is_placed_prefix_aware_and_fills_the_cache(router, client):
    """Placement uses the prompt's blocks: the same long prompt again lands on the engine that
    cached it, and reports cached tokens (LAST pooling reads the cache)."""
    text = " ".join(f"token{i}" for i in range(80))
    client.embeddings.create(model=MODEL, input=text)
    first = router.last_engine()
    stub_router = router.stub
    response, call = stub_router.Embed.with_call(pb.EmbedRequest(text=text), timeout=TIMEOUT_S)
    assert dict(call.initial_metadata())["quire-engine-id"] == first
    assert response.usage.cached_tokens > 0 and len(response.embedding) == 64


@pytest.mark.parametrize("body, param", [
    ({"input": ""}, "input"),
    ({"input": []}, "input"),
    ({"input": ["ok", ""]}, "input"),
    ({"input": [["x"]]}, "input"),
    ({"input": [1, -1]}, "input"),
    ({"input": 5}, "input"),
    ({"input": "x" * 3000}, "input"),  # over max_model_len (256) once tokenized
    ({"input": ["ok", list(range(300))]}, "input"),  # over max_model_len
    ({"input": [10 ** 6]}, "input"),  # not a token id of the vocabulary
    ({"input": ["x"] * 2049}, "input"),
    ({"input": "x", "dimensions": 8}, "dimensions"),
    ({"input": "x", "encoding_format": "int8"}, "encoding_format"),
    ({"input": "x", "normalize": "yes"}, "normalize"),
    ({"input": "x", "truncate": 3}, "truncate"),
    ({"input": "x", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ({"input": "x", "truncate_prompt_tokens": -2}, "truncate_prompt_tokens"),
    ({"input": "x", "truncate_prompt_tokens": "5"}, "truncate_prompt_tokens"),
    ({"input": "x", "truncate_prompt_tokens": 257}, "truncate_prompt_tokens"),
    ({"input": "x", "truncate_prompt_tokens": 5, "truncation_side": "up"}, "truncation_side"),
    # chat form
    ({"input": "x", "messages": [{"role": "user", "content": "x"}]}, "input"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages"),
    ({"messages": [[{"role": "user", "content": "x"}], [{"role": "robot"}]]}, "messages"),
    ({"messages": [{"role": "user", "content": "x" * 3000}]}, "messages"),  # too long
    ({"input": "x", "add_generation_prompt": True}, "add_generation_prompt"),
    ({"messages": [{"role": "user", "content": "x"}], "continue_final_message": True},
     "continue_final_message"),
    ({"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": 3},
     "chat_template_kwargs"),
])
def test_bad_input_is_a_400_naming_it(router, client, body, param):
    status, answer = _post(router, {"model": MODEL, **body})
    assert status == 400 and answer["error"]["param"] == param, answer
    assert answer["error"]["message"].startswith(param)
    assert client.embeddings.create(model=MODEL, input="still served").data


@pytest.mark.parametrize("request_, field", [
    (pb.EmbedRequest(), "prompt"),
    (pb.EmbedRequest(token_ids=pb.TokenIds()), "token_ids"),
    (pb.EmbedRequest(token_ids=pb.TokenIds(ids=list(range(300)))), "prompt"),
    (pb.EmbedRequest(token_ids=pb.TokenIds(ids=[10 ** 6])), "token_ids"),
    (pb.EmbedRequest(text="x", truncate_prompt_tokens=-3), "truncate_prompt_tokens"),
])
def test_grpc_embed_refusals_name_the_field(router, request_, field):
    with pytest.raises(grpc.RpcError) as err:
        router.stub.Embed(request_, timeout=TIMEOUT_S)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert dict(err.value.trailing_metadata())["quire-error-field"] == field
    assert err.value.details().startswith(field)


CHAT = [{"role": "system", "content": "You embed."}, {"role": "user", "content": "Hi there"}]
OTHER_CHAT = [{"role": "user", "content": "Another conversation"}]


def _tokenized(router, messages, **options) -> list[int]:
    request = urllib.request.Request(
        f"http://127.0.0.1:{router.server.http_port}/tokenize",
        data=json.dumps({"model": MODEL, "messages": messages, **options}).encode(),
        method="POST", headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=TIMEOUT_S) as response:
        return json.loads(response.read())["tokens"]


def test_chat_form_embeds_the_rendered_template_as_vllm_does(router, client, tokenizer,
                                                             tiny_model_dir):
    # vLLM's embedding defaults: no generation prompt; /tokenize renders the same template
    ids = _tokenized(router, CHAT, add_generation_prompt=False)
    with_prompt = _tokenized(router, CHAT, add_generation_prompt=True)
    assert len(with_prompt) > len(ids)
    other = _tokenized(router, OTHER_CHAT, add_generation_prompt=False)
    refs = hf_embeddings(tiny_model_dir, [ids, with_prompt, other], "LAST")
    status, one = _post(router, {"model": MODEL, "messages": CHAT, "encoding_format": "float"})
    assert status == 200 and one["usage"]["prompt_tokens"] == len(ids)
    _assert_close([one["data"][0]["embedding"]], refs[:1])
    # a conversation as input (vLLM takes it there too), the generation prompt asked for
    status, prompted = _post(router, {"model": MODEL, "input": CHAT,
                                      "add_generation_prompt": True,
                                      "encoding_format": "base64"})
    assert status == 200
    _assert_close([struct.unpack(f"<{len(refs[1])}f", base64.b64decode(
        prompted["data"][0]["embedding"]))], refs[1:2])
    # several conversations: a vector each, in order
    status, both = _post(router, {"model": MODEL, "messages": [CHAT, OTHER_CHAT],
                                  "encoding_format": "float"})
    assert status == 200 and [d["index"] for d in both["data"]] == [0, 1]
    _assert_close([d["embedding"] for d in both["data"]], [refs[0], refs[2]])
    # the official client passes vLLM's extra fields through extra_body
    result = client.embeddings.create(model=MODEL, input=[], encoding_format="float",
                                      extra_body={"messages": CHAT, "input": None})
    _assert_close([result.data[0].embedding], refs[:1])


def test_unknown_model_is_a_404(router):
    status, answer = _post(router, {"model": "other", "input": "x"})
    assert status == 404 and answer["error"]["param"] == "model"


def test_pooling_runner_engine_beside_a_generating_one(tiny_model_dir):
    """A --runner pooling engine embeds (MEAN here, from --pooler-config) and refuses
    generation; the router sends Generate only to the generating engine."""
    pooling = start_engine(tiny_model_dir, runner="pooling", dtype="float32",
                           pooler_config='{"pooling_type": "MEAN"}')
    generating = start_engine(tiny_model_dir, dtype="float32")
    running = RunningRouter([address(pooling), address(generating)])
    try:
        with grpc.insecure_channel(address(pooling)) as channel:
            from quire.v1 import engine_pb2_grpc

            stub = engine_pb2_grpc.EngineServiceStub(channel)
            info = stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=TIMEOUT_S)
            assert (info.runner, info.pooling_type, info.pooling_normalize,
                    info.hidden_size) == ("pooling", "MEAN", True, 64)
            with pytest.raises(grpc.RpcError) as err:
                list(stub.Generate(pb.GenerateRequest(text="hi"), timeout=TIMEOUT_S))
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "--runner pooling" in err.value.details()
            ids = list(range(500, 540))
            vector = stub.Embed(pb.EmbedRequest(token_ids=pb.TokenIds(ids=ids)),
                                timeout=TIMEOUT_S).embedding
            _assert_close([vector], hf_embeddings(tiny_model_dir, [ids], "MEAN"))
        for _ in range(4):
            request = pb.GenerateRequest(text="hello there", sampling=pb.SamplingOptions(
                max_tokens=2, temperature=0))
            stream = running.stub.Generate(request, timeout=TIMEOUT_S)
            assert sum(len(d.token_ids) for m in stream for d in m.outputs) == 2
            assert dict(stream.initial_metadata())["quire-engine-id"] == address(generating)
    finally:
        running.close()
        pooling.close()
        generating.close()
