"""Adapters no engine holds, loaded on demand by the router (``--lora-resolver-dir``, vLLM's
filesystem resolver) over real loopback: a request naming one is placed, the router loads it
on that engine from ``<dir>/<name>`` first (once, however many requests wait for it), and the
answer is transformers + PEFT's; a name with no directory is a 404 naming the model, a bad
adapter a 400, and every other request keeps being served."""

from __future__ import annotations

import json
import shutil
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import transformers

from quire.v1 import engine_pb2 as pb
from tests.e2e.lora_adapters import make_adapter
from tests.e2e.test_lora_router import _http, lora_engines
from tests.e2e.router_harness import TIMEOUT_S, RunningRouter, address
from tests.e2e.test_engine_server import _collect

MODEL = "tiny-llama"
PROMPT = list(range(3100, 3140))
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def adapter_root(tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("resolver-adapters")
    make_adapter(tiny_model_dir, root / "c", r=8, seed=3)
    make_adapter(tiny_model_dir, root / "d", r=8, seed=4)
    shutil.copytree(root / "c", root / "broken")
    (root / "broken" / "adapter_model.safetensors").write_bytes(b"not safetensors")
    return root


@pytest.fixture(scope="module")
def engines(tiny_model_dir, adapter_root):
    yield from lora_engines(tiny_model_dir, adapter_root)  # neither holds an adapter


@pytest.fixture(scope="module")
def router(engines, adapter_root):
    running = RunningRouter([address(e) for e in engines], http_port=0, model_name=MODEL,
                            placement={"reconnect_max_backoff_s": 0.5,
                                       "lora_resolver_dir": str(adapter_root)})
    yield running
    running.close()


def _peft_greedy(model_dir, adapter_dir) -> list[int]:
    from peft import PeftModel

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model = PeftModel.from_pretrained(model, str(adapter_dir))
    model.generation_config.eos_token_id = None
    out = model.generate(torch.tensor([PROMPT]), max_new_tokens=MAX_TOKENS, do_sample=False,
                         pad_token_id=0)
    return out[0, len(PROMPT):].tolist()


def _generate(router, lora_name: str) -> list[int]:
    tokens, _, _ = _collect(router.stub.Generate(pb.GenerateRequest(
        token_ids=pb.TokenIds(ids=PROMPT), lora_name=lora_name,
        sampling=pb.SamplingOptions(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)),
        timeout=TIMEOUT_S))
    return tokens


def _complete(router, model) -> tuple[int, dict]:
    status, text = _http(router, "/v1/completions", {"model": model, "prompt": PROMPT,
                                                      "max_tokens": 2, "temperature": 0},
                         key=None)
    return status, json.loads(text)


def _holding(router, name: str) -> set[str]:
    return router.read(lambda: router.server.pool.holding_adapter(name))


def test_an_adapter_no_engine_holds_is_loaded_where_placed(router, tiny_model_dir,
                                                           adapter_root):
    assert _holding(router, "c") == set()
    # a burst of requests for it: every one answered, by PEFT's tokens, after one load
    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(lambda _: _generate(router, "c"), range(4)))
    want = _peft_greedy(tiny_model_dir, adapter_root / "c")
    assert answers == [want] * 4
    holders = _holding(router, "c")
    assert holders, "the router loaded it nowhere"
    decisions = router.server.metrics.decisions.latest(4)
    assert {d.engine_id for d in decisions} <= holders
    # the OpenAI front takes it by model name and lists it once loaded, with its parent
    status, body = _complete(router, "c")
    assert status == 200 and body["model"] == "c"
    port = router.server.front.port
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models",
                                timeout=TIMEOUT_S) as response:
        models = {m["id"]: m for m in json.loads(response.read())["data"]}
    assert models["c"]["parent"] == MODEL
    # a second adapter goes where it costs least too, and its tokens are its own
    assert _generate(router, "d") == _peft_greedy(tiny_model_dir, adapter_root / "d")
    assert _holding(router, "d")


def test_a_name_with_no_adapter_is_a_404_and_a_bad_one_a_400(router, engines):
    for name in ("nope", "../c", "c/../d"):
        status, body = _complete(router, name)
        assert status == 404, (name, body)
        assert body["error"]["param"] == "model" and name in body["error"]["message"]
    status, body = _complete(router, "broken")
    assert status == 400 and body["error"]["param"] == "model", body
    assert "'broken'" in body["error"]["message"]
    assert "safetensors" in body["error"]["message"]
    assert _holding(router, "broken") == set()
    with pytest.raises(Exception) as info:
        _generate(router, "nope")
    assert info.value.code().name == "NOT_FOUND" and "'nope'" in info.value.details()
    # everyone else is still served
    status, body = _complete(router, MODEL)
    assert status == 200 and body["model"] == MODEL
