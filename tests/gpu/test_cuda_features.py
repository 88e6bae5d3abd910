"""The features beyond one model in one process, on CUDA: the Triton LoRA pair at real shapes
against the reference, LoRA engines (each adapter alone and a batch mixing three adapters and the
base) token-identical to transformers + PEFT, speculative decoding (n-gram and a draft model)
token-identical to plain decoding with drafts accepted, embeddings equal to transformers' pooled
hidden states, and structured outputs whose grammar mask is applied to logits on the GPU.
Skipped without a GPU (`pytest -m gpu`); CI checks the same code on the CPU and the Triton
kernels in the interpreter."""

from __future__ import annotations

import json
import re

import pytest
import torch

from engine_worker import LLM, SamplingParams
from engine_worker.lora.ops import REFERENCE_OPS, LoRAGroups
from engine_worker.sampling_params import StructuredOutputsParams
from tests.conftest import build_tiny_model
from tests.e2e.test_embeddings import PROMPTS as EMBED_PROMPTS, assert_close, hf_embeddings
from tests.e2e.test_lora import PROMPTS as LORA_PROMPTS, _generate, adapters, references  # noqa: F401
from tests.e2e.test_spec_decode import NGRAM, PROMPTS as SPEC_PROMPTS, _params

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU here")]

CUDA = dict(device="cuda", dtype="float32", kv_cache_memory_bytes=1 << 26)


def _groups(token_slots: list[int]) -> LoRAGroups:
    slots = torch.tensor(token_slots, dtype=torch.int64)
    return LoRAGroups(len(token_slots), tuple((s, (slots == s).nonzero().flatten())
                                              for s in sorted(set(token_slots) - {0})), slots)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16],
                         ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("rank,k,n", [(16, 4096, 4096), (64, 4096, 11008), (8, 576, 1536)])
def test_triton_lora_pair_on_gpu_matches_the_reference(dtype, rank, k, n):
    from engine_worker.lora import triton_kernels

    g = torch.Generator().manual_seed(0)
    token_slots = [0, 1, 2, 3, 1, 0, 4, 4, 4, 2] * 5  # 50 tokens, 4 adapters and the base
    a = (torch.randn(5, rank, k, generator=g) / k ** 0.5).to(dtype)
    b = (torch.randn(5, n, rank, generator=g) * 0.05).to(dtype)
    x = torch.randn(len(token_slots), k, generator=g).to(dtype)
    y = torch.randn(len(token_slots), n, generator=g).to(dtype)
    groups = _groups(token_slots)
    h_want = REFERENCE_OPS.shrink(x.double(), a.double(), groups)
    want = y.double().clone()
    REFERENCE_OPS.expand(want, h_want, b.double(), groups)
    slots = groups.token_slots.cuda()
    h_got = triton_kernels.lora_shrink(x.cuda(), a.cuda(), slots)
    got = y.cuda()
    triton_kernels.lora_expand(got, h_got, b.cuda(), slots)
    tol = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 3e-2}[dtype]
    torch.testing.assert_close(h_got.double().cpu(), h_want, rtol=tol, atol=tol)
    torch.testing.assert_close(got.double().cpu(), want, rtol=tol, atol=tol)
    base = [t for t, s in enumerate(token_slots) if s == 0]
    assert torch.equal(got.cpu()[base], y[base])  # base tokens untouched, bit for bit


def _lora_llm(model_dir, **kwargs) -> LLM:
    return LLM(str(model_dir), enable_lora=True, max_lora_rank=64, **(CUDA | kwargs))


def test_lora_on_cuda_matches_peft_alone_and_mixed(tiny_model_dir, adapters, references,  # noqa: F811
                                                   monkeypatch):
    """Decode steps replay CUDA graphs: those with adapters the graphs that record the LoRA
    deltas, those of the base alone the graphs without."""
    llm = _lora_llm(tiny_model_dir, max_loras=3, max_cpu_loras=3)
    assert llm.engine._lora.ops.name == "triton"  # the Triton pair, not the reference
    graphs = llm.engine.runner.graphs
    assert graphs.takes_lora and {lora for _, lora in graphs.graphs} == {False, True}
    replayed = []
    run = graphs.run
    monkeypatch.setattr(graphs, "run", lambda step: replayed.append(step.lora) or run(step))
    for name, lora in adapters.items():
        got = _generate(llm, LORA_PROMPTS, lora)
        assert got == [references[(name, i)] for i in range(len(LORA_PROMPTS))], name
    names = [None, *adapters]
    cases = [(names[(i + j) % 4], i) for i in range(len(LORA_PROMPTS)) for j in range(2)]
    got = _generate(llm, [LORA_PROMPTS[i] for _, i in cases],
                    [adapters.get(name) for name, _ in cases])
    assert got == [references[case] for case in cases]
    assert True in replayed
    replayed.clear()
    assert _generate(llm, LORA_PROMPTS, None) == \
        [references[(None, i)] for i in range(len(LORA_PROMPTS))]
    assert replayed and True not in replayed


def _spec_llm(model_dir, spec=None) -> LLM:
    llm = LLM(str(model_dir), speculative_config=spec, **CUDA)
    if spec is not None:  # every request of a mixed batch drafts
        llm.engine._scheduler.speculator.step_token_limit = 1 << 16
    return llm


def _tokens(llm) -> list:
    outputs = llm.generate([{"prompt_token_ids": p} for p in SPEC_PROMPTS], _params(),
                           use_tqdm=False)
    return [[c.token_ids for c in o.outputs] for o in outputs]


@pytest.fixture(scope="module")
def plain_tokens(tiny_model_dir) -> list:
    return _tokens(_spec_llm(tiny_model_dir))


def test_ngram_speculation_on_cuda_is_token_identical(tiny_model_dir, plain_tokens):
    llm = _spec_llm(tiny_model_dir, NGRAM)
    assert _tokens(llm) == plain_tokens
    assert llm.engine.stats().scheduler.spec_decoding.num_accepted_tokens > 0


def test_draft_model_on_cuda_is_token_identical(tmp_path, tiny_model_dir, embedded_model_dir,
                                                plain_tokens):
    draft = build_tiny_model(tmp_path / "draft", embedded_model_dir, num_layers=1,
                             hidden_size=32, num_heads=2, num_kv_heads=1, seed=1)
    llm = _spec_llm(tiny_model_dir, {"model": str(draft), "num_speculative_tokens": 4,
                                     "disable_by_batch_size": 64})
    assert _tokens(llm) == plain_tokens
    self_draft = _spec_llm(tiny_model_dir, {"model": str(tiny_model_dir),
                                            "num_speculative_tokens": 4,
                                            "disable_by_batch_size": 64})
    assert _tokens(self_draft) == plain_tokens
    stats = self_draft.engine.stats().scheduler.spec_decoding
    assert stats.num_accepted_tokens == stats.num_draft_tokens > 0


@pytest.mark.parametrize("pooling_type", ["LAST", "MEAN"])
def test_embeddings_on_cuda_match_transformers(tiny_model_dir, pooling_type):
    ref = hf_embeddings(tiny_model_dir, EMBED_PROMPTS, pooling_type)
    llm = LLM(str(tiny_model_dir), pooler_config={"pooling_type": pooling_type},
              max_num_batched_tokens=64, long_prefill_token_threshold=64, **CUDA)
    out = llm.embed([{"prompt_token_ids": p} for p in EMBED_PROMPTS], use_tqdm=False)
    assert_close([o.outputs.embedding for o in out], ref)


def test_structured_outputs_on_cuda(tiny_model_dir):
    """Random weights: the grammar's mask, applied on the GPU, alone makes the output match."""
    llm = LLM(str(tiny_model_dir), **CUDA)
    schema = {"type": "object", "properties": {"n": {"type": "integer"},
                                               "ok": {"type": "boolean"}},
              "required": ["n", "ok"], "additionalProperties": False}
    params = [SamplingParams(n=3, temperature=1.0, seed=1, max_tokens=30,
                             structured_outputs=StructuredOutputsParams(regex=r"[a-c]{2}-\d{2}")),
              SamplingParams(temperature=1.0, seed=2, max_tokens=60,
                             structured_outputs=StructuredOutputsParams(json=schema)),
              SamplingParams(temperature=1.0, seed=3, max_tokens=8)]
    outs = llm.generate(["one", "two", "three"], params, use_tqdm=False)
    for c in outs[0].outputs:
        assert re.fullmatch(r"[a-c]{2}-\d{2}", c.text) and c.finish_reason == "stop"
    json_out = outs[1].outputs[0]
    if json_out.finish_reason == "stop":  # a random model may run out of tokens mid-number
        value = json.loads(json_out.text)
        assert set(value) == {"n", "ok"} and isinstance(value["ok"], bool)
    else:
        assert json_out.text.startswith("{")
    assert len(outs[2].outputs[0].token_ids) == 8
