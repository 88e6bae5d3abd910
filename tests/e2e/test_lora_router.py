"""LoRA through the router's OpenAI front over real loopback: ``model`` names an adapter,
``/v1/models`` lists adapters with their parent, adapters load and unload on the pool behind
the API keys (paths outside the engines' adapter directories refused), requests go only to
engines holding their adapter, and the router's predicted cached tokens under an adapter
equal what the engine reports."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import grpc
import pytest

from engine_worker.server.config import ServerConfig
from quire.v1 import engine_pb2 as pb
from tests.e2e.lora_adapters import make_adapter
from tests.e2e.router_harness import TIMEOUT_S, RunningRouter, address
from tests.e2e.test_engine_server import RunningServer, _engine

MODEL = "tiny-llama"
KEY = "lora-key"
PROMPT = list(range(3000, 3040))  # two full blocks of 16


@pytest.fixture(scope="module")
def adapter_root(tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("router-adapters")
    make_adapter(tiny_model_dir, root / "a", r=8, seed=1)
    make_adapter(tiny_model_dir, root / "b", r=8, seed=2)
    return root


def lora_engines(model_dir, adapter_root, first_modules: str | None = None):
    """Two tiny engines with LoRA on (2 step slots, rank 8) loading adapters at run time from
    ``adapter_root``; the first loads ``first_modules`` at start. Yields them, then closes."""
    running = [RunningServer(_engine(model_dir, kernels="torch", enable_lora=True,
                                     max_loras=2, max_lora_rank=8,
                                     lora_modules=first_modules if i == 0 else None),
                             ServerConfig(host="127.0.0.1", port=0,
                                          lora_adapter_dirs=str(adapter_root)))
               for i in range(2)]
    yield running
    for server in running:
        server.close()


@pytest.fixture(scope="module")
def engines(tiny_model_dir, adapter_root):
    # engine 0 holds adapter "a" from the start; engine 1 none
    yield from lora_engines(tiny_model_dir, adapter_root, f"a={adapter_root / 'a'}")


@pytest.fixture(scope="module")
def router(engines):
    running = RunningRouter([address(e) for e in engines], http_port=0, model_name=MODEL,
                            api_keys=KEY)
    yield running
    running.close()


def _http(router, path, body=None, key=KEY):
    port = router.server.front.port
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", headers=headers,
                                     data=None if body is None else json.dumps(body).encode(),
                                     method="GET" if body is None else "POST")
    try:
        with urllib.request.urlopen(request, timeout=TIMEOUT_S) as response:
            text = response.read().decode()
            return response.status, text
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def _complete(router, model, max_tokens=4):
    status, text = _http(router, "/v1/completions", {
        "model": model, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0,
        "ignore_eos": True})
    return status, json.loads(text)


def _models(router) -> dict[str, dict]:
    status, text = _http(router, "/v1/models")
    assert status == 200
    return {m["id"]: m for m in json.loads(text)["data"]}


def test_models_lists_adapters_with_their_parent(router, adapter_root):
    models = _models(router)
    assert models[MODEL]["parent"] is None
    assert models["a"]["parent"] == MODEL and models["a"]["root"] == str(adapter_root / "a")


def test_an_adapter_request_goes_to_an_engine_holding_it(router, engines):
    for _ in range(3):
        status, body = _complete(router, "a")
        assert status == 200 and body["model"] == "a"
    # engine 1 holds no adapter: it never served one
    decisions = router.server.metrics.decisions.latest(3)
    holder = router.read(lambda: router.server.pool.holding_adapter("a"))
    assert {d.engine_id for d in decisions} <= holder and len(holder) == 1
    # the same prompt again under "a" is predicted cached exactly as the engine reports
    status, body = _complete(router, "a")
    last = router.server.metrics.decisions.latest(1)[0]
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 32
    assert last.predicted_cached_tokens == 32
    # under the base model, the same prompt is not cached anywhere yet
    status, body = _complete(router, MODEL)
    assert status == 200 and body["model"] == MODEL
    assert router.server.metrics.decisions.latest(1)[0].predicted_cached_tokens in (0, 32)
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == \
        router.server.metrics.decisions.latest(1)[0].predicted_cached_tokens


def test_unknown_adapter_is_a_404_naming_it(router):
    status, body = _complete(router, "nope")
    assert status == 404 and "nope" in body["error"]["message"]
    assert body["error"]["param"] == "model"
    with pytest.raises(Exception) as info:
        list(router.stub.Generate(pb.GenerateRequest(
            token_ids=pb.TokenIds(ids=PROMPT), lora_name="nope",
            sampling=pb.SamplingOptions(max_tokens=2)),
            metadata=(("authorization", f"Bearer {KEY}"),), timeout=TIMEOUT_S))
    assert info.value.code().name == "NOT_FOUND" and "'nope'" in info.value.details()


def test_load_and_unload_on_the_pool(router, adapter_root, tmp_path):
    body = {"lora_name": "b", "lora_path": str(adapter_root / "b")}
    assert _http(router, "/v1/load_lora_adapter", body, key=None)[0] == 401
    status, text = _http(router, "/v1/load_lora_adapter", body)
    assert status == 200, text
    assert _models(router)["b"]["parent"] == MODEL
    assert router.read(lambda: router.server.pool.holding_adapter("b")) == \
        set(router.read(lambda: router.server.pool.clients))
    assert _complete(router, "b")[0] == 200

    status, text = _http(router, "/v1/load_lora_adapter",
                         {"lora_name": "c", "lora_path": str(tmp_path)})
    assert status == 400 and "outside the adapter directories" in text
    status, text = _http(router, "/v1/load_lora_adapter", {"lora_name": "c"})
    assert status == 400 and json.loads(text)["error"]["param"] == "lora_path"
    assert "c" not in _models(router)

    assert _http(router, "/v1/unload_lora_adapter", {"lora_name": "b"})[0] == 200
    assert "b" not in _models(router)
    status, text = _http(router, "/v1/unload_lora_adapter", {"lora_name": "b"})
    assert status == 404 and "'b'" in text
    assert _complete(router, "b")[0] == 404
    assert _complete(router, MODEL)[0] == 200  # still serving


def test_load_and_unload_over_the_routers_grpc(router, adapter_root):
    """The router serves the engine's EngineService, LoRA calls included (they were the
    generated stubs' UNIMPLEMENTED, each with a traceback in the router's log)."""
    auth = (("authorization", f"Bearer {KEY}"),)
    with pytest.raises(grpc.RpcError) as err:
        router.stub.LoadLoRAAdapter(pb.LoadLoRAAdapterRequest(
            lora_name="g", lora_path=str(adapter_root / "b")), timeout=TIMEOUT_S)
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    answer = router.stub.LoadLoRAAdapter(pb.LoadLoRAAdapterRequest(
        lora_name="g", lora_path=str(adapter_root / "b")), metadata=auth, timeout=TIMEOUT_S)
    assert answer.loaded and "g" in _models(router)
    assert _complete(router, "g")[0] == 200
    router.stub.UnloadLoRAAdapter(pb.UnloadLoRAAdapterRequest(lora_name="g"), metadata=auth,
                                  timeout=TIMEOUT_S)
    assert "g" not in _models(router)
    with pytest.raises(grpc.RpcError) as err:
        router.stub.UnloadLoRAAdapter(pb.UnloadLoRAAdapterRequest(lora_name="g"),
                                      metadata=auth, timeout=TIMEOUT_S)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND and "'g'" in err.value.details()
    with pytest.raises(grpc.RpcError) as err:
        router.stub.LoadLoRAAdapter(pb.LoadLoRAAdapterRequest(lora_name="h"), metadata=auth,
                                    timeout=TIMEOUT_S)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    base = router.stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=auth,
                                    timeout=TIMEOUT_S).model_name
    with pytest.raises(grpc.RpcError) as err:  # the base model's own name, as over HTTP
        router.stub.LoadLoRAAdapter(pb.LoadLoRAAdapterRequest(
            lora_name=base, lora_path=str(adapter_root / "b")), metadata=auth, timeout=TIMEOUT_S)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "base model" in \
        err.value.details()
