"""Many LoRA adapters on one engine: greedy output token-identical (fp32) to transformers +
PEFT for each adapter alone and for batches mixing adapters and the base model; the
``max_loras`` admission rule; cache isolation per adapter; bad adapters refused at load while
the engine keeps serving."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import transformers

from engine_worker import LLM, LoRARequest, SamplingParams
from engine_worker.config import EngineArgs
from engine_worker.engine import LLMEngine
from engine_worker.lora.cache import UnknownLoRAError
from quire.kv_events import BlockStored
from tests.e2e.lora_adapters import make_adapter

PROMPTS = [[5, 100, 200, 300, 400], list(range(1000, 1040)), [42] * 17, [7],
           list(range(20000, 20037))]
MAX_TOKENS = 10


@pytest.fixture(scope="module")
def adapters(tiny_model_dir, tmp_path_factory) -> dict[str, LoRARequest]:
    root = tmp_path_factory.mktemp("lora")
    specs = {"r8": dict(r=8, seed=1),
             "r64-rslora": dict(r=64, seed=2, use_rslora=True, lora_alpha=16),
             "r8-some": dict(r=8, seed=3, targets=("q_proj", "v_proj", "down_proj"))}
    return {name: LoRARequest(name, i + 1, make_adapter(tiny_model_dir, root / name, **spec))
            for i, (name, spec) in enumerate(specs.items())}


def _hf_greedy(model_dir, lora: LoRARequest | None) -> list[list[int]]:
    """transformers + PEFT's greedy tokens for every prompt, under the adapter."""
    from peft import PeftModel

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if lora is not None:
        model = PeftModel.from_pretrained(model, lora.lora_path)
    model.generation_config.eos_token_id = None
    outputs = []
    for prompt in PROMPTS:
        out = model.generate(torch.tensor([prompt]), max_new_tokens=MAX_TOKENS,
                             do_sample=False, pad_token_id=0)
        outputs.append(out[0, len(prompt):].tolist())
    return outputs


def _llm(model_dir, **kwargs) -> LLM:
    return LLM(str(model_dir), dtype="float32", enable_lora=True,
               **({"kv_cache_memory_bytes": 1 << 24, "kernels": "torch",
                   "max_lora_rank": 64} | kwargs))


def _generate(llm: LLM, prompts, loras):
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False,
                           lora_request=loras)
    return [o.outputs[0].token_ids for o in outputs]


@pytest.fixture(scope="module")
def references(tiny_model_dir, adapters) -> dict:
    return {(name, i): tokens for name in [None, *adapters]
            for i, tokens in enumerate(_hf_greedy(tiny_model_dir, adapters.get(name)))}


@pytest.mark.parametrize("kernels", ["torch", "auto"])
def test_each_adapter_alone_matches_peft(tiny_model_dir, adapters, references, kernels):
    llm = _llm(tiny_model_dir, max_loras=1, kernels=kernels)
    for name, lora in adapters.items():
        got = _generate(llm, PROMPTS, lora)
        assert got == [references[(name, i)] for i in range(len(PROMPTS))], name
        # the adapter changes the output: the comparison is not the base model's twice
        assert got != [references[(None, i)] for i in range(len(PROMPTS))]


@pytest.mark.parametrize("max_loras", [3, 1], ids=["one-step", "admitted-by-max-loras"])
def test_a_batch_mixing_three_adapters_and_the_base_matches_peft(tiny_model_dir, adapters,
                                                                 references, max_loras):
    llm = _llm(tiny_model_dir, max_loras=max_loras, max_cpu_loras=3)
    names = [None, *adapters]
    cases = [(names[(i + j) % 4], i) for i in range(len(PROMPTS)) for j in range(2)]
    got = _generate(llm, [PROMPTS[i] for _, i in cases],
                    [adapters.get(name) for name, _ in cases])
    assert got == [references[case] for case in cases]


def test_steps_never_hold_more_than_max_loras_adapters(tiny_model_dir, adapters):
    engine = LLMEngine.from_engine_args(EngineArgs(
        model=str(tiny_model_dir), dtype="float32", kv_cache_memory_bytes=1 << 24,
        kernels="torch", enable_lora=True, max_loras=2, max_lora_rank=64))
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    for lora in adapters.values():
        engine.add_lora(lora)
    names = [*adapters, None] * 3
    for i, name in enumerate(names):
        engine.add_request(f"r{i}", {"prompt_token_ids": PROMPTS[i % 5]}, params,
                           lora_request=name)
    finished = set()
    while engine.has_unfinished_requests():
        engine.step()
        held = {engine.runner.requests[r].lora_name for r in engine.runner.requests
                if r not in finished} - {None}
        assert len(held) <= 2
        finished |= {r for r, s in engine.runner.requests.items()
                     if s.num_computed_tokens >= s.num_prompt_tokens + 3}
    assert engine.stats().scheduler.num_waiting == 0


def test_the_same_prompt_under_two_adapters_shares_no_block(tiny_model_dir, adapters):
    engine = LLMEngine.from_engine_args(EngineArgs(
        model=str(tiny_model_dir), dtype="float32", kv_cache_memory_bytes=1 << 24,
        kernels="torch", enable_lora=True, max_loras=2, max_lora_rank=64))
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    prompt = {"prompt_token_ids": list(range(3000, 3040))}  # two full blocks of 16
    stored: dict[str | None, set[int]] = {}
    cached = []
    for i, name in enumerate(["r8", "r64-rslora", None, "r8"]):
        lora = adapters[name] if name else None
        engine.add_request(f"q{i}", prompt, params, lora_request=lora)
        while engine.has_unfinished_requests():
            result = engine.step()
            cached += [o.num_cached_tokens for o in result.outputs if o.finished]
            for batch in result.kv_event_batches:
                for event in batch.events:
                    if isinstance(event, BlockStored):
                        assert event.lora_name == name
                        stored.setdefault(name, set()).update(event.block_hashes)
    assert cached == [0, 0, 0, 32]  # only the same adapter again hits the cache
    assert len(stored["r8"]) == len(stored["r64-rslora"]) == len(stored[None]) == 2
    assert not (stored["r8"] & stored["r64-rslora"]) and not (stored["r8"] & stored[None])


def _corrupt(tmp_path, source: str) -> Path:
    bad = tmp_path / "corrupt"
    bad.mkdir()
    shutil.copy(Path(source) / "adapter_config.json", bad)
    (bad / "adapter_model.safetensors").write_bytes(b"\x00" * 64)
    return bad


def test_bad_adapters_are_refused_at_load_and_the_engine_keeps_serving(
        tiny_model_dir, adapters, tmp_path):
    llm = _llm(tiny_model_dir, max_lora_rank=8)
    engine = llm.engine
    big = adapters["r64-rslora"]
    with pytest.raises(ValueError, match="^max_lora_rank: .*rank 64"):
        engine.add_lora(LoRARequest("big", 9, big.lora_path))
    source = Path(adapters["r8"].lora_path)
    lacking = tmp_path / "lacking"
    lacking.mkdir()
    config = json.loads((source / "adapter_config.json").read_text())
    config["target_modules"] = ["q_proj", "qkv_fused"]
    (lacking / "adapter_config.json").write_text(json.dumps(config))
    shutil.copy(source / "adapter_model.safetensors", lacking)
    with pytest.raises(ValueError, match="^lora_path: .*qkv_fused.*not in this model"):
        engine.add_lora(LoRARequest("lacking", 10, str(lacking)))
    with pytest.raises(ValueError, match="^lora_path: .*not a readable safetensors"):
        engine.add_lora(LoRARequest("corrupt", 11, str(_corrupt(tmp_path, big.lora_path))))
    with pytest.raises(ValueError, match="^lora_path: .*no such directory"):
        engine.add_lora(LoRARequest("missing", 12, str(tmp_path / "nowhere")))
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    with pytest.raises(UnknownLoRAError, match="^lora_name: .*'big'"):
        engine.add_request("x", {"prompt_token_ids": [5, 6]}, params, lora_request="big")
    assert engine.list_loras() == {}
    # still serving, base and adapters
    assert engine.add_lora(adapters["r8"])
    assert not engine.add_lora(adapters["r8"])  # the same adapter again: nothing to do
    with pytest.raises(ValueError, match="^lora_name: .*already loaded"):
        engine.add_lora(LoRARequest("r8", 20, big.lora_path))
    out = llm.generate([[5, 6, 7], [5, 6, 7]], params, use_tqdm=False,
                       lora_request=[None, adapters["r8"]])
    assert all(len(o.outputs[0].token_ids) == 3 for o in out)
    assert engine.remove_lora("r8") and not engine.remove_lora("r8")


def test_lora_off_refuses_adapters(tiny_model_dir, adapters):
    llm = LLM(str(tiny_model_dir), dtype="float32", kv_cache_memory_bytes=1 << 24)
    with pytest.raises(UnknownLoRAError, match="LoRA is off"):
        llm.generate([[5, 6]], SamplingParams(max_tokens=2), use_tqdm=False,
                     lora_request=adapters["r8"])
    assert EngineArgs(lora_modules="a=/x b=/y").create_engine_config().lora.lora_modules == \
        (("a", "/x"), ("b", "/y"))  # adapters at start turn LoRA on
    with pytest.raises(ValueError, match="^lora_modules: expected name=path"):
        EngineArgs(lora_modules=["a"]).create_engine_config()
    with pytest.raises(ValueError, match="^max_cpu_loras: "):
        EngineArgs(enable_lora=True, max_loras=4, max_cpu_loras=2).create_engine_config()
