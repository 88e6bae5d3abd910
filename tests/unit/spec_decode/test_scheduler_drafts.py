"""The scheduler with a speculator, driven by hand: drafts are budgeted as tokens of the
request's step, rejected drafts' blocks go back to the pool (and the runner gets the whole
table again), nothing but the request's own tokens is ever hashed into the prefix cache, drafts
give way before a preemption, and the batch rule turns drafts off."""

from __future__ import annotations

from engine_worker.kv_cache.manager import KVCacheManager
from engine_worker.scheduler.scheduler import Scheduler
from engine_worker.spec_decode.config import SpeculativeConfig
from engine_worker.spec_decode.methods import build_speculator
from engine_worker.step_types import ModelRunnerOutput
from tests.unit.scheduler_harness import make_request


def _scheduler(num_blocks=16, k=4, disable_by_batch_size=4, **kw) -> Scheduler:
    kv = KVCacheManager(num_blocks, 4, enable_prefix_caching=True)
    spec = build_speculator(SpeculativeConfig("ngram", k, prompt_lookup_max=3,
                                              prompt_lookup_min=1,
                                              disable_by_batch_size=disable_by_batch_size))
    return Scheduler(kv_cache_manager=kv, max_num_batched_tokens=kw.get("budget", 64),
                     max_num_seqs=8, max_model_len=1024, speculator=spec)


def _sampled(**tokens) -> ModelRunnerOutput:
    return ModelRunnerOutput({r: tuple(t) for r, t in tokens.items()}, {}, {})


def _request(req_id="r", prompt=(11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 11), max_tokens=20):
    request = make_request(req_id, len(prompt), max_tokens=max_tokens)
    request.prompt_token_ids = list(prompt)
    return request


def test_drafts_are_budgeted_and_rejected_blocks_come_back():
    sched = _scheduler()
    sched.add_request(_request())
    out = sched.schedule()  # the prompt
    assert out.num_scheduled_tokens == {"r": 11} and not out.spec_token_ids
    sched.update_from_output(out, _sampled(r=[12]))  # ... 20 11 12: "11 12" recurs
    free_before = sched.kv.pool.num_free_blocks
    out = sched.schedule()
    assert out.spec_token_ids == {"r": (13, 14, 15, 16)}
    assert out.num_scheduled_tokens == {"r": 5} and out.total_num_scheduled_tokens == 5
    assert len(sched.kv.get_block_ids("r")) == 4  # 16 slots: 12 tokens + 4 drafts
    assert sched.kv.pool.num_free_blocks == free_before - 1
    sched.update_from_output(out, _sampled(r=[50]))  # every draft rejected
    request = sched.requests["r"]
    assert request.num_computed_tokens == 12 and request.output_token_ids == [12, 50]
    assert len(sched.kv.get_block_ids("r")) == 3  # the drafts' block is back
    assert sched.kv.pool.num_free_blocks == free_before
    # only blocks of the request's own tokens were ever cached: 3 full blocks of 12 tokens
    assert len(sched.kv.pool.cached) == 3
    out = sched.schedule()  # the table shrank: the runner gets it whole
    (cached,) = out.cached_requests
    assert cached.replace_block_table and len(cached.block_ids) == len(
        sched.kv.get_block_ids("r"))
    stats = sched.stats().spec_decoding
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (1, 4, 0)


def test_accepted_drafts_count_as_computed_and_the_next_draft_shrinks():
    sched = _scheduler()
    sched.add_request(_request())
    sched.update_from_output(sched.schedule(), _sampled(r=[12]))
    out = sched.schedule()
    assert out.spec_token_ids == {"r": (13, 14, 15, 16)}
    sched.update_from_output(out, _sampled(r=[13, 14, 77]))  # two accepted, then the target's
    request = sched.requests["r"]
    assert request.output_token_ids == [12, 13, 14, 77] and request.num_computed_tokens == 14
    assert sched.stats().spec_decoding.num_accepted_tokens_per_pos == (1, 1, 0, 0)
    out = sched.schedule()  # "77" never appeared before: no draft
    assert not out.spec_token_ids and out.num_scheduled_tokens == {"r": 1}


def test_drafts_stop_at_max_tokens_and_give_way_to_blocks_and_batches():
    sched = _scheduler()
    sched.add_request(_request(max_tokens=3))
    sched.update_from_output(sched.schedule(), _sampled(r=[12]))
    assert sched.schedule().spec_token_ids == {"r": (13,)}  # 2 outputs left: 1 draft + 1
    # no free block for the drafts: verify none rather than preempt anything
    sched = _scheduler(num_blocks=3)
    sched.add_request(_request())
    sched.update_from_output(sched.schedule(), _sampled(r=[12]))
    out = sched.schedule()
    assert not out.spec_token_ids and out.num_scheduled_tokens == {"r": 1}
    assert not out.preempted_req_ids
    # two requests on a CPU: 6 draft tokens in all, the first request's 4 then 2
    sched = _scheduler()
    for r in ("a", "b"):
        sched.add_request(_request(r))
    sched.update_from_output(sched.schedule(), _sampled(a=[12], b=[12]))
    assert sched.schedule().spec_token_ids == {"a": (13, 14, 15, 16), "b": (13, 14)}
    # more running requests than disable_by_batch_size: no drafts
    sched = _scheduler(disable_by_batch_size=1)
    for r in ("a", "b"):
        sched.add_request(_request(r))
    sched.update_from_output(sched.schedule(), _sampled(a=[12], b=[12]))
    out = sched.schedule()
    assert not out.spec_token_ids and out.total_num_scheduled_tokens == 2
