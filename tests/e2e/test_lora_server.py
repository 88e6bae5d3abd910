"""LoRA over the engine's real loopback gRPC: requests name adapters, adapters load and unload
at run time from inside the adapter directories only, and bad input is a clear status while
the engine keeps serving."""

from __future__ import annotations

import shutil

import grpc
import pytest

from engine_worker import LLM, LoRARequest, SamplingParams
from engine_worker.server.config import ServerConfig
from quire.v1 import engine_pb2 as pb
from tests.e2e.lora_adapters import make_adapter
from tests.e2e.test_engine_server import RunningServer, _collect, _engine, _request

PROMPT = [5, 100, 200, 300, 400]


@pytest.fixture(scope="module")
def adapter_root(tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    make_adapter(tiny_model_dir, root / "a", r=8, seed=1)
    make_adapter(tiny_model_dir, root / "big", r=32, seed=2)
    return root


@pytest.fixture(scope="module")
def server(tiny_model_dir, adapter_root):
    engine = _engine(tiny_model_dir, kernels="torch", enable_lora=True, max_loras=2,
                     max_lora_rank=16, lora_modules=f"a={adapter_root / 'a'}")
    running = RunningServer(engine, ServerConfig(host="127.0.0.1", port=0,
                                                 lora_adapter_dirs=str(adapter_root)))
    yield running
    running.close()


def _expected(model_dir, lora_path: str | None) -> list[int]:
    llm = LLM(str(model_dir), dtype="float32", kv_cache_memory_bytes=1 << 22,
              kernels="torch", enable_lora=True, max_lora_rank=16)
    lora = LoRARequest("x", 1, lora_path) if lora_path else None
    out = llm.generate([{"prompt_token_ids": PROMPT}], SamplingParams(
        temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False, lora_request=lora)
    return out[0].outputs[0].token_ids


def _code(call) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value.code(), info.value.details()


def test_requests_run_under_the_adapter_they_name(server, tiny_model_dir, adapter_root):
    info = server.stub.GetModelInfo(pb.GetModelInfoRequest())
    assert (info.enable_lora, info.max_loras, info.max_lora_rank, info.max_cpu_loras) == \
        (True, 2, 16, 2)
    assert list(info.lora_adapters) == ["a"]
    tokens, _, _ = _collect(server.stub.Generate(pb.GenerateRequest(
        token_ids=pb.TokenIds(ids=PROMPT), lora_name="a",
        sampling=pb.SamplingOptions(temperature=0, max_tokens=8, ignore_eos=True))))
    base, _, _ = _collect(server.stub.Generate(_request(PROMPT)))
    assert tokens == _expected(tiny_model_dir, str(adapter_root / "a"))
    assert base == _expected(tiny_model_dir, None) != tokens


def test_unknown_adapter_is_not_found_naming_it(server):
    code, details = _code(lambda: _collect(server.stub.Generate(pb.GenerateRequest(
        token_ids=pb.TokenIds(ids=PROMPT), lora_name="nope",
        sampling=pb.SamplingOptions(max_tokens=2)))))
    assert code == grpc.StatusCode.NOT_FOUND and "'nope'" in details
    code, details = _code(lambda: server.stub.UnloadLoRAAdapter(
        pb.UnloadLoRAAdapterRequest(lora_name="nope")))
    assert code == grpc.StatusCode.NOT_FOUND and "'nope'" in details


def test_load_and_unload_at_run_time(server, adapter_root, tmp_path):
    load = server.stub.LoadLoRAAdapter
    assert load(pb.LoadLoRAAdapterRequest(lora_name="a2", lora_path=str(adapter_root / "a")
                                          )).loaded
    assert not load(pb.LoadLoRAAdapterRequest(lora_name="a2",
                                              lora_path=str(adapter_root / "a"))).loaded
    assert "a2" in server.stub.GetModelInfo(pb.GetModelInfoRequest()).lora_adapters
    tokens, _, _ = _collect(server.stub.Generate(pb.GenerateRequest(
        token_ids=pb.TokenIds(ids=PROMPT), lora_name="a2",
        sampling=pb.SamplingOptions(temperature=0, max_tokens=4, ignore_eos=True))))
    assert len(tokens) == 4
    server.stub.UnloadLoRAAdapter(pb.UnloadLoRAAdapterRequest(lora_name="a2"))
    assert "a2" not in server.stub.GetModelInfo(pb.GetModelInfoRequest()).lora_adapters

    # refused, and nothing changes: a path outside the directories (also through ..),
    # a rank above max_lora_rank, a corrupt file
    outside = tmp_path / "outside"
    shutil.copytree(adapter_root / "a", outside)
    corrupt = adapter_root / "corrupt"
    shutil.copytree(adapter_root / "a", corrupt)
    (corrupt / "adapter_model.safetensors").write_bytes(b"not safetensors")
    cases = {str(outside): "outside the adapter directories",
             str(adapter_root / ".." / outside.parent.name / "outside"): "outside",
             str(adapter_root / "big"): "max_lora_rank",
             str(corrupt): "not a readable safetensors"}
    for path, words in cases.items():
        code, details = _code(lambda: load(pb.LoadLoRAAdapterRequest(lora_name="bad",
                                                                    lora_path=path)))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and words in details, path
    assert list(server.stub.GetModelInfo(pb.GetModelInfoRequest()).lora_adapters) == ["a"]
    tokens, _, _ = _collect(server.stub.Generate(_request(PROMPT, max_tokens=3)))
    assert len(tokens) == 3  # still serving
