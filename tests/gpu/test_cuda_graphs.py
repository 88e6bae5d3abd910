"""CUDA graphs and the profiled KV-cache size on a real GPU: the decode graphs replay what the
eager forward computes, an engine with graphs samples the same tokens as one with
``enforce_eager``, a step syncs only in its one copy to the host, and the KV cache sized from
the profile is what the arithmetic says and holds in use. Skipped without a GPU (these
machines and CI have none); run with `pytest -m gpu tests/gpu` on one."""

from __future__ import annotations

import pytest
import torch

from engine_worker import LLM, SamplingParams
from engine_worker.kv_cache.sizing import profiled_kv_budget_bytes
from engine_worker.model_runner import runner as runner_module
from engine_worker.model_runner.runner import RunnerRequestState

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU here")]

pytest.importorskip("triton")

BLOCK_SIZE = 16
PROMPTS = [list(range(100 + i, 100 + i + n)) for i, n in enumerate((3, 17, 40, 5, 64, 9, 33))]


def _llm(tiny_model_dir, **kwargs) -> LLM:
    args = {"dtype": "float32", "device": "cuda", "max_model_len": 256, "max_num_seqs": 16}
    return LLM(str(tiny_model_dir), **(args | kwargs))


@pytest.fixture(scope="module")
def graphed(tiny_model_dir) -> LLM:
    # no prefix caching: the replay test writes K/V into blocks no request owns, which a
    # cached prefix must never read
    return _llm(tiny_model_dir, kv_cache_memory_bytes=1 << 26, enable_prefix_caching=False)


def _state(i: int, length: int, block_ids: list[int]) -> RunnerRequestState:
    return RunnerRequestState(req_id=str(i), token_ids=list(range(7, 7 + length)),
                              num_prompt_tokens=length, params=SamplingParams(),
                              block_ids=block_ids, num_computed_tokens=length - 1,
                              generator=None)


def test_graphs_are_on_with_triton_attention(graphed):
    engine = graphed.engine
    assert engine.info.attention == "triton"
    assert engine.info.cuda_graphs == "on (5 batch sizes, 1 to 16)"
    assert sorted(engine.runner.graphs.graphs) == [(n, False) for n in (1, 2, 4, 8, 16)]


@pytest.mark.parametrize("num_seqs", [1, 3, 5, 8, 13, 16])
def test_a_replayed_decode_equals_the_eager_forward(graphed, num_seqs):
    """The graph of the padded size, replayed on the buffers, gives the hidden states the
    recorded function computes eagerly on the same buffers (the same kernels: equal up to
    cuBLAS's choice of algorithm)."""
    runner = graphed.engine.runner
    decoder = runner.graphs
    states = [_state(i, 1 + 11 * i, [i * 8 + j for j in range(-(-(1 + 11 * i) // BLOCK_SIZE))])
              for i in range(num_seqs)]
    with torch.inference_mode():
        step = decoder.prepare(states, [1] * num_seqs)
        assert step.padded == min(s for s in decoder.sizes if s >= num_seqs)
        replayed = decoder.run(step).clone()
        eager = decoder.eager(step, runner.kv_caches)[:num_seqs]
    torch.testing.assert_close(replayed, eager, atol=1e-5, rtol=1e-5)


def test_enforce_eager_gives_the_same_tokens(tiny_model_dir, graphed, monkeypatch):
    replays = []
    run = graphed.engine.runner.graphs.run
    monkeypatch.setattr(graphed.engine.runner.graphs, "run",
                        lambda step: replays.append(step.padded) or run(step))
    eager = _llm(tiny_model_dir, kv_cache_memory_bytes=1 << 26, enable_prefix_caching=False,
                 enforce_eager=True)
    assert eager.info.cuda_graphs == "off (enforce_eager)"
    assert eager.engine.runner.graphs is None
    params = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
              SamplingParams(temperature=0.8, seed=11, max_tokens=24, ignore_eos=True)]
    for p in params:
        prompts = [{"prompt_token_ids": t} for t in PROMPTS]
        got = [o.outputs[0].token_ids for o in graphed.generate(prompts, p, use_tqdm=False)]
        want = [o.outputs[0].token_ids for o in eager.generate(prompts, p, use_tqdm=False)]
        assert got == want
    assert 8 in replays  # 7 decodes padded to 8: the graphs ran


def test_a_step_syncs_only_in_its_one_copy(graphed, monkeypatch):
    """torch's sync debug mode raises on any synchronizing call (``.item()``, a blocking
    copy, ``nonzero``...) made by the step outside ``platform.to_host``."""
    runner = graphed.engine.runner
    execute, to_host = runner.execute, runner_module.to_host
    copies = []

    def strict_execute(out):
        torch.cuda.set_sync_debug_mode("error")
        try:
            return execute(out)
        finally:
            torch.cuda.set_sync_debug_mode("default")

    def allowed_to_host(tensors):
        copies.append(len(tensors))
        torch.cuda.set_sync_debug_mode("default")
        try:
            return to_host(tensors)
        finally:
            torch.cuda.set_sync_debug_mode("error")

    monkeypatch.setattr(runner, "execute", strict_execute)
    monkeypatch.setattr(runner_module, "to_host", allowed_to_host)
    params = SamplingParams(temperature=0.7, top_k=20, top_p=0.9, min_p=0.01, seed=3,
                            repetition_penalty=1.1, min_tokens=2, max_tokens=8, logprobs=3,
                            ignore_eos=True)
    outputs = graphed.generate([{"prompt_token_ids": t} for t in PROMPTS], params,
                               use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 8 for o in outputs)
    assert len(copies) >= 8


def test_the_profiled_kv_cache_is_the_arithmetic_and_holds(tiny_model_dir):
    torch.cuda.empty_cache()
    llm = _llm(tiny_model_dir, gpu_memory_utilization=0.5, max_num_batched_tokens=512,
               max_model_len=512)
    engine = llm.engine
    profile = engine.info.memory_profile
    total = torch.cuda.mem_get_info()[1]
    assert profile.total_bytes == total
    weights = sum(p.numel() * p.element_size() for p in engine.runner.model.parameters())
    assert profile.weights_bytes >= weights
    assert 0 < profile.peak_activation_bytes < total // 4
    assert profile.cuda_graph_bytes > 0  # graphs are on, and counted
    block_bytes = engine.runner.kv_caches[0][:, :1].numel() * 4 * len(engine.runner.kv_caches)
    assert engine.info.num_kv_blocks == profiled_kv_budget_bytes(profile, 0.5) // block_bytes
    kv_bytes = engine.info.num_kv_blocks * block_bytes
    # what was counted holds: the largest steps stay within weights + KV + peak + graphs
    torch.cuda.reset_peak_memory_stats()
    long_prompts = [{"prompt_token_ids": list(range(1000 + i, 1000 + i + 200))}
                    for i in range(16)]
    llm.generate(long_prompts, SamplingParams(temperature=0.9, top_p=0.9, logprobs=5,
                                              max_tokens=16, ignore_eos=True), use_tqdm=False)
    budget = (profile.weights_bytes + kv_bytes + profile.peak_activation_bytes
              + profile.cuda_graph_bytes)
    assert torch.cuda.max_memory_allocated() <= budget * 1.05
    used = total - torch.cuda.mem_get_info()[0]
    assert used <= total * 0.5 + (1 << 30)  # the fraction, with slack for the first engine
