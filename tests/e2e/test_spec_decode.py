"""Speculative decoding end to end: greedy fp32 output is token-identical with and without it
(alone, in mixed batches, with prefix caching, chunked prefill, preemption, n > 1, stop tokens
and logprobs), drafts are actually accepted, and sampled output is distributed as the target's
(a chi-square test against the exact distribution, with forced proposals)."""

from __future__ import annotations

import math
import re

import numpy as np
import pytest
import torch

from engine_worker import LLM, SamplingParams
from engine_worker.sampling_params import StructuredOutputsParams
from engine_worker.metrics import EngineMetrics
from engine_worker.spec_decode.speculator import Speculator

pytestmark = pytest.mark.slow

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3,
         "prompt_lookup_min": 1, "disable_by_batch_size": 64}
# repetitive prompts (proposals from the prompt) and plain ones; a random model's greedy output
# soon loops, so the plain ones get proposals from their output
PROMPTS = ([list(range(300, 320)) * 3 + [300, 301],
            [5, 6, 7, 8, 9] * 6 + list(range(400, 430)) + [5, 6, 7],
            list(range(100, 140))] +
           [list(range(1000 + 37 * i, 1000 + 37 * i + n)) for i, n in enumerate([3, 17, 64, 9])])
MAX_TOKENS = [40, 33, 48, 25, 40, 19, 36]


def _params(**kw) -> list[SamplingParams]:
    return [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True, **kw)
            for m in MAX_TOKENS]


def _llm(model_dir, spec=None, **kw) -> LLM:
    llm = LLM(str(model_dir), dtype="float32", speculative_config=spec,
              **({"kv_cache_memory_bytes": 1 << 24} | kw))
    if spec is not None:  # every request of a mixed batch drafts (not only the CPU's 8 tokens)
        llm.engine._scheduler.speculator.step_token_limit = 1 << 16
    return llm


def _tokens(llm, prompts=PROMPTS, params=None):
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params or _params(),
                           use_tqdm=False)
    return [[c.token_ids for c in o.outputs] for o in outputs]


@pytest.fixture(scope="module")
def baseline(tiny_model_dir):
    return _llm(tiny_model_dir)


@pytest.fixture(scope="module")
def speculative(tiny_model_dir):
    return _llm(tiny_model_dir, NGRAM)


def test_greedy_is_token_identical_alone_batched_and_with_prefix_caching(baseline, speculative):
    expected = _tokens(baseline)
    assert _tokens(speculative) == expected  # one mixed batch, nothing cached
    stats = speculative.engine.stats()
    assert stats.scheduler.spec_decoding.num_accepted_tokens > 0
    assert _tokens(speculative) == expected  # again: prompts now hit the prefix cache
    assert speculative.engine.stats().kv_cache.prefix_cache_hits > 0
    for prompt, params, want in zip(PROMPTS[:3], _params(), expected):  # alone
        assert _tokens(speculative, [prompt], [params]) == [want]
    free = speculative.engine.stats().kv_cache
    assert free.num_free_blocks == free.num_blocks  # every block came back


def test_greedy_n2_stop_tokens_and_logprobs_match(baseline, speculative):
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True, n=2, logprobs=2)
              for m in MAX_TOKENS]
    want = baseline.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    got = speculative.generate([{"prompt_token_ids": p} for p in PROMPTS], params,
                               use_tqdm=False)
    for w, g in zip(want, got):
        for wc, gc in zip(w.outputs, g.outputs):
            assert gc.token_ids == wc.token_ids
            for wl, gl in zip(wc.logprobs, gc.logprobs):
                assert wl.keys() == gl.keys()
                for t in wl:
                    assert gl[t].logprob == pytest.approx(wl[t].logprob, abs=1e-4)
            assert gc.cumulative_logprob == pytest.approx(wc.cumulative_logprob, abs=1e-3)
    # a stop token inside an accepted run of drafts ends the output exactly there
    first = _tokens(baseline)
    stop_ids = [out[0][len(out[0]) // 2] for out in first]
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True, stop_token_ids=[s],
                             logprobs=1) for m, s in zip(MAX_TOKENS, stop_ids)]
    want = baseline.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    got = speculative.generate([{"prompt_token_ids": p} for p in PROMPTS], params,
                               use_tqdm=False)
    for w, g in zip(want, got):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        assert len(g.outputs[0].logprobs) == len(g.outputs[0].token_ids)
        assert g.outputs[0].finish_reason == w.outputs[0].finish_reason


@pytest.mark.parametrize("engine_kw", [
    {"max_num_batched_tokens": 8},  # chunked prefill; drafts compete for the 8 tokens
    # 14 blocks of 16 tokens for requests needing up to 7: preemption is forced
    {"kv_cache_memory_bytes": 14 * 3 * 2 * 16 * 2 * 16 * 4},
], ids=["chunked", "preempted"])
def test_greedy_is_token_identical_chunked_and_preempted(tiny_model_dir, baseline, engine_kw):
    llm = _llm(tiny_model_dir, NGRAM, **engine_kw)
    assert _tokens(llm) == _tokens(baseline)
    stats = llm.engine.stats()
    assert stats.scheduler.spec_decoding.num_accepted_tokens > 0
    if "kv_cache_memory_bytes" in engine_kw:
        assert stats.scheduler.num_preemptions > 0
    assert stats.kv_cache.num_free_blocks == stats.kv_cache.num_blocks


def test_embedded_model_repeats_a_passage_identically_and_accepts_drafts(embedded_model_dir):
    passage = ("The old bridge over the river was built of grey stone in the year the town "
               "was founded, and for two hundred years every cart and coach crossed it.")
    messages = [{"role": "user", "content": f"Repeat this sentence exactly: {passage}"}]
    outputs = {}
    for label, spec in (("off", None), ("on", dict(NGRAM, prompt_lookup_min=2))):
        llm = LLM(str(embedded_model_dir), dtype="float32", kv_cache_memory_bytes=1 << 26,
                  speculative_config=spec)
        out = llm.chat([messages, messages[:1]], SamplingParams(temperature=0, max_tokens=48),
                       use_tqdm=False)
        outputs[label] = [o.outputs[0].token_ids for o in out]
        if spec is not None:
            metrics = EngineMetrics("m", llm.info)
            stats = llm.engine.stats()
            metrics.observe_step(num_running=0, num_waiting=0, kv_cache_usage=0.0,
                                 prefix_cache_queries=0, prefix_cache_hits=0, num_preemptions=0,
                                 spec_decoding=stats.scheduler.spec_decoding)
            text = metrics.render().decode()
            accepted = _sample(text, "vllm:spec_decode_num_accepted_tokens_total")
            assert accepted > 0 and _sample(text, "vllm:spec_decode_num_drafts_total") > 0
            assert 'vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",' \
                   'position="0"}' in text
        del llm
    assert outputs["on"] == outputs["off"]


def _sample(text: str, name: str) -> float:
    line = next(ln for ln in text.splitlines() if ln.startswith(name + "{"))
    return float(line.rsplit(" ", 1)[1])


# ------------------------------------------------------------------- sampled: exact in law
class _ForcedProposer:
    """Always proposes the same tokens (whatever the request holds)."""

    def __init__(self, draft: tuple[int, ...]) -> None:
        self.draft = draft

    def propose(self, req_id, tokens, max_num_tokens):
        return self.draft[:max_num_tokens]

    def forget(self, req_id, output_token_ids=()):
        pass


def _chi2_sf(stat: float, df: int) -> float:
    """P(chi2_df > stat): the regularised upper incomplete gamma function."""
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


def _topk_distribution(llm, prompt, params: SamplingParams) -> dict[int, float]:
    """The exact distribution the sampler draws from after ``prompt`` (top-k / top-p applied to
    the softmax of the raw logits), from the engine's own logprobs."""
    probe = SamplingParams(temperature=1.0, max_tokens=1, logprobs=20, seed=0)
    out = llm.generate({"prompt_token_ids": prompt}, probe, use_tqdm=False)[0]
    logprobs = out.outputs[0].logprobs[0]
    ranked = sorted(((lp.logprob, t) for t, lp in logprobs.items()), reverse=True)
    p = torch.tensor([lp for lp, _ in ranked], dtype=torch.float64).exp()
    p = p[:params.top_k] / p[:params.top_k].sum()
    keep = len(p)
    if params.top_p < 1:  # tokens whose more-likely mass is below top_p stay
        before = torch.cumsum(p, 0) - p
        keep = int((before < params.top_p).sum())
    p = p[:keep] / p[:keep].sum()
    return {ranked[i][1]: float(p[i]) for i in range(keep)}


@pytest.mark.parametrize("top_k, top_p", [(6, 1.0), (10, 0.8)])
def test_sampled_output_is_distributed_as_the_target(tiny_model_dir, baseline, top_k, top_p):
    """Requests of max_tokens 3: the first token t1 is sampled as usual, then t2 is verified
    against a forced draft ``x`` (and t3 against ``y``). The law of t2 given t1 must be the
    target's exact p(. | prompt, t1) whatever the draft: one chi-square test over all
    (t1, t2) cells with t1's observed counts, cells with an expected count below 5 merged per
    t1. The threshold 1e-3 on the p-value gives a false-failure rate of 0.1% for a random seed;
    the seeds here are fixed, so the outcome is deterministic."""
    prompt = list(range(500, 512))
    params = SamplingParams(temperature=1.0, top_k=top_k, top_p=top_p, max_tokens=3,
                            ignore_eos=True)
    first = _topk_distribution(baseline, prompt, params)
    likely = max(first, key=first.get)
    second_of_likely = _topk_distribution(baseline, prompt + [likely], params)
    # draft the second most likely t2 after the most likely t1: accepted only sometimes
    x = sorted(second_of_likely, key=second_of_likely.get)[-2]
    llm = _llm(tiny_model_dir, dict(NGRAM, disable_by_batch_size=1024), max_num_seqs=512,
               seed=1234)
    scheduler = llm.engine._scheduler
    scheduler.speculator = Speculator(scheduler.speculator.config, _ForcedProposer((x, x)),
                                      step_token_limit=1 << 16)
    num_samples = 3000
    outs = llm.generate([{"prompt_token_ids": prompt}] * num_samples, params, use_tqdm=False)
    pairs = [tuple(o.outputs[0].token_ids[:2]) for o in outs]
    stats = llm.engine.stats().scheduler.spec_decoding
    assert stats.num_drafts == num_samples and 0 < stats.num_accepted_tokens < num_samples
    stat, df = 0.0, 0
    for t1 in sorted({a for a, _ in pairs}):
        seconds = [b for a, b in pairs if a == t1]
        law = _topk_distribution(baseline, prompt + [t1], params)
        assert set(seconds) <= set(law), "a token outside the target's support"
        expected = {t: len(seconds) * p for t, p in law.items()}
        observed = {t: seconds.count(t) for t in law}
        cells, pool_e, pool_o = [], 0.0, 0
        for t in sorted(law, key=law.get, reverse=True):
            if expected[t] >= 5:
                cells.append((observed[t], expected[t]))
            else:
                pool_e += expected[t]
                pool_o += observed[t]
        if pool_e > 0:
            cells.append((pool_o, pool_e))
        if len(cells) < 2:
            continue
        stat += sum((o - e) ** 2 / e for o, e in cells)
        df += len(cells) - 1
    assert df >= 3
    assert _chi2_sf(stat, df) > 1e-3, f"chi2 {stat:.1f} on {df} degrees of freedom"
    # and t1, sampled without drafts, also follows the target's law (a check of the check)
    counts = np.array([sum(1 for a, _ in pairs if a == t) for t in first])
    expected = np.array([num_samples * first[t] for t in first])
    big = expected >= 5
    stat1 = float((((counts - expected) ** 2 / expected)[big]).sum())
    assert _chi2_sf(stat1, int(big.sum()) - 1) > 1e-3
    assert math.isclose(sum(first.values()), 1.0)


def test_seeded_sampling_is_token_identical_with_and_without_drafts(baseline, speculative):
    """Position i always takes the i-th draw of a seeded request's stream, and a draft is
    accepted exactly when that draw picks it: the same tokens as without speculation."""
    params = [SamplingParams(temperature=0.8, top_p=0.95, top_k=40, seed=7 + i, max_tokens=m,
                             ignore_eos=True, repetition_penalty=1.1, logprobs=1)
              for i, m in enumerate(MAX_TOKENS)]
    before = speculative.engine.stats().scheduler.spec_decoding.num_drafts
    assert _tokens(speculative, params=params) == _tokens(baseline, params=params)
    assert speculative.engine.stats().scheduler.spec_decoding.num_drafts > before


def test_a_grammar_request_beside_drafting_ones_matches_no_speculation(baseline, speculative):
    """A request under a grammar (which the scheduler gives no drafts: its matcher cannot roll
    back rejected ones) decodes exactly as without speculation and ends where its grammar
    does, while the plain requests of the same steps still draft and accept."""
    regex = "(ab|cd|ef)( (ab|cd|ef)){2,12}"
    params = _params()
    params[1] = SamplingParams(temperature=0, max_tokens=48,
                               structured_outputs=StructuredOutputsParams(regex=regex))
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    want = baseline.generate(prompts, params, use_tqdm=False)
    before = speculative.engine.stats().scheduler.spec_decoding
    got = speculative.generate(prompts, params, use_tqdm=False)
    after = speculative.engine.stats().scheduler.spec_decoding
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert re.fullmatch(regex, got[1].outputs[0].text), got[1].outputs[0].text
    assert got[1].outputs[0].finish_reason == "stop"
    assert after.num_drafts > before.num_drafts
    assert after.num_accepted_tokens > before.num_accepted_tokens


def test_grpc_model_info_and_metrics_report_speculation(tiny_model_dir):
    import urllib.request

    from engine_worker.engine import LLMEngine
    from engine_worker.config import EngineArgs
    from engine_worker.server.config import ServerConfig
    from quire.v1 import engine_pb2 as pb
    from tests.e2e.test_engine_server import RunningServer, _collect, _request

    engine = LLMEngine.from_engine_args(EngineArgs(
        model=str(tiny_model_dir), dtype="float32", kv_cache_memory_bytes=1 << 24,
        speculative_config='{"method": "ngram", "num_speculative_tokens": 3, '
                           '"prompt_lookup_min": 1}'))
    running = RunningServer(engine, ServerConfig(host="127.0.0.1", port=0, metrics_port=0))
    try:
        tokens, _, _ = _collect(running.stub.Generate(_request(PROMPTS[0], max_tokens=30)))
        assert len(tokens) == 30
        info = running.stub.GetModelInfo(pb.GetModelInfoRequest())
        assert '"method": "ngram"' in info.speculative_config
        assert '"num_speculative_tokens": 3' in info.speculative_config
        assert info.spec_decode_num_drafts > 0 and info.spec_decode_num_accepted_tokens > 0
        assert info.spec_decode_num_draft_tokens >= info.spec_decode_num_accepted_tokens
        assert len(info.spec_decode_num_accepted_tokens_per_pos) == 3
        assert info.spec_decode_num_accepted_tokens_per_pos[0] > 0
        port = running.server.metrics_server.port
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
            text = response.read().decode()
        for name in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
            assert _sample(text, f"vllm:spec_decode_{name}_total") > 0
        assert _sample(text, "vllm:spec_decode_num_accepted_tokens_total") == \
            info.spec_decode_num_accepted_tokens
    finally:
        running.close()


def test_suffix_method_is_token_identical_and_learns_from_finished_outputs(tiny_model_dir,
                                                                          baseline):
    llm = _llm(tiny_model_dir, {"method": "suffix", "num_speculative_tokens": 4,
                                "disable_by_batch_size": 64})
    expected = _tokens(baseline)
    assert _tokens(llm) == expected
    first = llm.engine.stats().scheduler.spec_decoding
    assert first.num_accepted_tokens > 0
    assert _tokens(llm) == expected  # again: the first run's outputs are proposed from
    second = llm.engine.stats().scheduler.spec_decoding
    assert second.num_accepted_tokens - first.num_accepted_tokens > first.num_accepted_tokens
