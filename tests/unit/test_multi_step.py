"""Multi-step decode (``num_scheduler_steps``, vLLM's multi-step scheduling): one scheduling
decision runs several forward passes while every request decodes and none waits.

Checked on the real engine (tiny random Llama, the torch kernels) against the same engine with
one pass a step: the same tokens and logprobs under every sampling option a pass can change
(seeds, penalties, min_tokens, stop tokens, n > 1), the runs as long as scheduled and cut where
they must be (``max_tokens``, a stop token, a new request, the engine's interrupt), and the
blocks a run fills published to the prefix cache. The scheduler's choice of a run (and of none)
is checked on the scheduler alone.
"""

from __future__ import annotations

import pytest
import torch

from engine_worker import LLM, SamplingParams
from engine_worker.kv_cache.manager import KVCacheManager
from engine_worker.request import Request
from engine_worker.scheduler.scheduler import Scheduler
from engine_worker.step_types import ModelRunnerOutput

ENGINE_ARGS = dict(dtype="float32", kernels="torch", max_model_len=256,
                   kv_cache_memory_bytes=1 << 24, max_num_batched_tokens=64, block_size=16)


@pytest.fixture(scope="module")
def llms(tiny_model_dir):
    return {steps: LLM(str(tiny_model_dir), num_scheduler_steps=steps, **ENGINE_ARGS)
            for steps in (1, 5)}


def _passes(llm, monkeypatch) -> list[int]:
    """Forward passes the runner runs from now on (one entry each)."""
    runner = llm.engine.runner
    forward, passes = runner._forward, []

    def counted(*args):
        passes.append(1)
        return forward(*args)

    monkeypatch.setattr(runner, "_forward", counted)
    return passes


def test_the_same_tokens_and_logprobs_as_one_pass_steps(llms, monkeypatch):
    passes = _passes(llms[5], monkeypatch)
    params = [SamplingParams(temperature=0, max_tokens=23, logprobs=3),
              SamplingParams(temperature=1.0, seed=7, top_k=30, top_p=0.9, max_tokens=17),
              SamplingParams(temperature=0.8, seed=11, repetition_penalty=1.3,
                             presence_penalty=0.4, frequency_penalty=0.3, min_tokens=9,
                             max_tokens=21, logprobs=1),
              SamplingParams(temperature=1.0, seed=5, n=2, max_tokens=19)]
    prompts = [{"prompt_token_ids": list(range(3, 3 + n))} for n in (40, 7, 90, 12)]
    one, multi = (llms[k].generate(prompts, params, use_tqdm=False) for k in (1, 5))
    assert len(passes) > 0
    for a, b in zip(one, multi):
        for x, y in zip(a.outputs, b.outputs):
            assert x.token_ids == y.token_ids
            assert x.finish_reason == y.finish_reason
            assert (x.logprobs is None) == (y.logprobs is None)
            for pa, pb in zip(x.logprobs or (), y.logprobs or ()):
                assert pa.keys() == pb.keys()
                for t in pa:  # fp32, batches of other shapes: a float's rounding apart
                    assert pb[t].logprob == pytest.approx(pa[t].logprob, rel=1e-4, abs=1e-4)
                    assert pb[t].rank == pa[t].rank


class _Steps:
    """Steps an engine by hand; each step's new tokens per request."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.seen: dict[str, int] = {}
        self.finished: set[str] = set()

    def one(self) -> dict[str, int]:
        new = {}
        for out in self.engine.step().outputs:
            n = len(out.outputs[0].token_ids)
            new[out.request_id] = n - self.seen.get(out.request_id, 0)
            self.seen[out.request_id] = n
            if out.finished:
                self.finished.add(out.request_id)
        return new

    def until_finished(self, req_ids: set[str]) -> list[dict[str, int]]:
        steps = []
        while not req_ids <= self.finished:
            steps.append(self.one())
        return steps


def test_runs_are_as_long_as_scheduled_and_capped_by_max_tokens(llms):
    engine = llms[5].engine
    engine.add_request("a", {"prompt_token_ids": list(range(3, 20))},
                       SamplingParams(temperature=0, max_tokens=13, ignore_eos=True))
    # the prefill's token, then two runs of 5, then the 2 that max_tokens leaves
    assert _Steps(engine).until_finished({"a"}) == [{"a": 1}, {"a": 5}, {"a": 5}, {"a": 2}]


def test_a_stop_token_ends_the_run_at_it(llms, monkeypatch):
    prompt = {"prompt_token_ids": list(range(30, 50))}
    free = llms[1].generate([prompt], SamplingParams(temperature=0, max_tokens=12),
                            use_tqdm=False)[0].outputs[0].token_ids
    stop = free[6]
    first = free.index(stop)
    passes = _passes(llms[5], monkeypatch)
    out = llms[5].generate([prompt], SamplingParams(temperature=0, max_tokens=12,
                                                    stop_token_ids=[stop]),
                           use_tqdm=False)[0].outputs[0]
    assert out.token_ids == free[:first + 1] and out.finish_reason == "stop"
    # a lone request's run stops at the pass that sampled its stop token: no pass wasted
    # (the prefill's pass samples the first token)
    assert len(passes) == len(out.token_ids)


def test_a_new_request_waits_one_step_and_is_not_kept_behind_a_run(llms):
    engine = llms[5].engine
    greedy = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    steps = _Steps(engine)
    engine.add_request("long", {"prompt_token_ids": list(range(3, 20))}, greedy)
    assert [steps.one(), steps.one()] == [{"long": 1}, {"long": 5}]
    engine.add_request("late", {"prompt_token_ids": list(range(50, 58))}, greedy)
    # the step after its arrival is one pass: the late prompt's prefill beside one decode
    assert steps.one() == {"long": 1, "late": 1}
    assert steps.one() == {"long": 5, "late": 5}  # both decode: runs again
    engine.abort_request(["long", "late"])
    steps.one()
    assert not engine.has_unfinished_requests()


def test_the_interrupt_ends_a_run_after_its_first_pass(llms):
    engine = llms[5].engine
    engine.add_request("i", {"prompt_token_ids": list(range(3, 11))},
                       SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    engine.set_step_interrupt(lambda: True)
    try:
        assert _Steps(engine).until_finished({"i"}) == [{"i": 1}] * 6
    finally:
        engine.set_step_interrupt(None)


@pytest.mark.parametrize("max_tokens", [31, 40])
def test_blocks_a_run_fills_are_found_by_the_next_request(llms, max_tokens):
    """A run's tokens are unknown when its slots are given, so the blocks it fills are
    registered after it, once they are known: a follow-up request over the whole conversation
    hits them, as with one pass a step. With 31 tokens the request's last run fills its
    third block (positions 43-47) and ends the request."""
    prompt = list(range(3, 21))
    hits = {}
    for steps, llm in llms.items():
        assert llm.engine.reset_prefix_cache()
        out = llm.generate([{"prompt_token_ids": prompt}],
                           SamplingParams(temperature=0, max_tokens=max_tokens,
                                          ignore_eos=True), use_tqdm=False)[0].outputs[0]
        follow = prompt + list(out.token_ids) + [5, 6, 7]
        hits[steps] = llm.generate([{"prompt_token_ids": follow}],
                                   SamplingParams(temperature=0, max_tokens=1),
                                   use_tqdm=False)[0].num_cached_tokens
    # 18 + 31 or 40 tokens, the last sampled one never computed: 48 or 57 computed, 3 full
    # blocks of 16
    assert hits[5] == hits[1] == 48


# ------------------------------------------------------------------ the scheduler alone
def _scheduler(num_blocks: int = 64, steps: int = 4) -> Scheduler:
    kv = KVCacheManager(num_blocks, 4, enable_prefix_caching=False)
    return Scheduler(kv_cache_manager=kv, max_num_batched_tokens=64, max_num_seqs=8,
                     max_model_len=1024, num_scheduler_steps=steps)


def _request(req_id: str, num_prompt: int, max_tokens: int = 32) -> Request:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    return Request(req_id, list(range(10, 10 + num_prompt)), params, frozenset({2}),
                   max_tokens)


def _run(scheduler: Scheduler, out, token: int = 7):
    """What a runner would answer: every pass of a run one token a request; a prefill chunk
    that completes its prompt one token."""
    sampled = {}
    for req_id, n in out.num_scheduled_tokens.items():
        request = scheduler.requests[req_id]
        if request.num_computed_tokens + n >= request.num_tokens:
            sampled[req_id] = (token,) * out.num_steps
    return scheduler.update_from_output(out, ModelRunnerOutput(sampled, {}, {}))


def test_the_scheduler_runs_only_decodes_with_nothing_waiting():
    scheduler = _scheduler()
    scheduler.add_request(_request("a", 6))
    first = scheduler.schedule()
    assert first.num_steps == 1 and first.num_scheduled_tokens == {"a": 6}
    _run(scheduler, first)
    run = scheduler.schedule()
    assert run.num_steps == 4 and run.num_scheduled_tokens == {"a": 1}
    # slots for every pass: 6 prompt tokens + the 1 sampled + 3 more computed = 10 -> 3 blocks
    assert len(scheduler.kv.get_block_ids("a")) == 3
    _run(scheduler, run)
    assert scheduler.requests["a"].num_computed_tokens == 10
    assert scheduler.requests["a"].num_tokens == 11
    scheduler.add_request(_request("b", 3))
    mixed = scheduler.schedule()  # something waits: one pass, its prefill beside the decode
    assert mixed.num_steps == 1 and mixed.num_scheduled_tokens == {"a": 1, "b": 3}


def test_a_run_is_cut_to_what_max_tokens_leaves_and_needs_free_blocks():
    scheduler = _scheduler(steps=8)
    scheduler.add_request(_request("a", 4, max_tokens=4))
    _run(scheduler, scheduler.schedule())
    assert scheduler.schedule().num_steps == 3  # 1 of 4 tokens out: 3 left

    tight = _scheduler(num_blocks=5, steps=8)  # blocks of 4 slots
    tight.add_request(_request("a", 4))
    tight.add_request(_request("b", 4))
    _run(tight, tight.schedule())  # one block each, 3 free
    # 8 passes would need 2 more blocks each (4 + 8 slots), 4 > 3: one pass, 1 block each
    out = tight.schedule()
    assert out.num_steps == 1 and out.num_scheduled_tokens == {"a": 1, "b": 1}


def test_a_run_checks_what_it_may_not_cover():
    # a request mid-prompt (chunked prefill) runs one pass a step
    scheduler = Scheduler(kv_cache_manager=KVCacheManager(64, 4, enable_prefix_caching=False),
                          max_num_batched_tokens=4, max_num_seqs=8, max_model_len=1024,
                          num_scheduler_steps=4)
    scheduler.add_request(_request("a", 10))
    for _ in range(3):
        out = scheduler.schedule()
        assert out.num_steps == 1
        _run(scheduler, out)
    assert scheduler.schedule().num_steps == 4  # its prompt done: decodes from here on
    # one pass a step is the default's opposite only where asked: steps=1 never runs more
    single = _scheduler(steps=1)
    single.add_request(_request("a", 3))
    _run(single, single.schedule())
    assert single.schedule().num_steps == 1


def test_logprobs_of_a_run_are_one_position_a_token(llms):
    out = llms[5].generate([{"prompt_token_ids": list(range(3, 12))}],
                           SamplingParams(temperature=0, max_tokens=12, logprobs=2,
                                          ignore_eos=True), use_tqdm=False)[0].outputs[0]
    assert len(out.logprobs) == len(out.token_ids) == 12
    for token, position in zip(out.token_ids, out.logprobs):
        assert token in position
        assert position[token].rank == 1  # greedy: the sampled token is the top one
        assert torch.isfinite(torch.tensor(position[token].logprob))
