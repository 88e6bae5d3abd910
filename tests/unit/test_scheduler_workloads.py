"""Whole workloads through the scheduler, scripted and random (Hypothesis).
"""

from __future__ import annotations

import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from engine_worker.request import RequestStatus
from tests.unit.scheduler_harness import EOS, assert_all_blocks_free, make_request, setup, step


# ------------------------------------------------------------------------ whole workloads
def test_mixed_workload_with_preemptions_returns_every_block():
    sched, runner = setup(num_blocks=10, block_size=4, max_num_batched_tokens=16, max_num_seqs=4)
    lengths = [(9, 12), (3, 20), (14, 6), (1, 25), (7, 7), (20, 3)]
    requests = [make_request(f"r{i}", p, max_tokens=m) for i, (p, m) in enumerate(lengths)]
    for request in requests[:3]:
        sched.add_request(request)
    num_steps = 0
    while sched.has_unfinished_requests():
        out, _ = step(sched, runner)
        assert out.total_num_scheduled_tokens <= 16
        assert sched.stats().num_running <= 4
        num_steps += 1
        if num_steps == 3:
            for request in requests[3:]:
                sched.add_request(request)
    assert sched.num_preemptions > 0
    assert [len(r.output_token_ids) for r in requests] == [m for _, m in lengths]
    assert all(r.status == RequestStatus.FINISHED_LENGTH_CAPPED for r in requests)
    assert_all_blocks_free(sched)
    assert step(sched, runner)[0].finished_req_ids  # the last ids still reach the runner
    assert runner.block_tables == {}


request_specs = st.lists(
    st.tuples(st.integers(1, 20),  # prompt tokens
              st.integers(1, 12),  # max_tokens
              st.sampled_from([0, 0, 1, 2, 4, 6]),  # arrival step
              st.integers(0, 2),  # priority
              st.one_of(st.none(), st.integers(0, 11)),  # output index that samples EOS
              st.one_of(st.none(), st.integers(0, 8)),  # step to abort at
              st.sampled_from([100, 100, 200]),  # prompt family: equal ones share prefixes
              st.sampled_from([None, "s"]),  # cache salt
              st.sampled_from([1, 1, 2, 3])),  # samples (n)
    min_size=1, max_size=8)


def sample_token(req_id: str) -> int:
    """A token of its own per sample, so no two sequences agree after their prompts."""
    parent, _, child = req_id[1:].partition("-")
    return 1000 + 10 * int(parent) + int(child or 0)


@settings(max_examples=150, deadline=None)
@given(specs=request_specs, block_size=st.sampled_from([1, 2, 4, 8]),
       extra_blocks=st.integers(0, 8), budget=st.integers(1, 24), max_num_seqs=st.integers(1, 5),
       policy=st.sampled_from(["fcfs", "priority"]), threshold=st.sampled_from([0, 3]),
       enable_prefix_caching=st.booleans())
def test_random_workloads_finish_and_return_every_block(specs, block_size, extra_blocks, budget,
                                                        max_num_seqs, policy, threshold,
                                                        enable_prefix_caching):
    # The input processor only admits requests whose peak fits in the whole cache.
    peak = max(spec[0] + spec[1] - 1 for spec in specs)
    num_blocks = -(-peak // block_size) + extra_blocks
    sched, runner = setup(num_blocks=num_blocks, block_size=block_size,
                          max_num_batched_tokens=budget, max_num_seqs=max_num_seqs,
                          policy=policy, long_prefill_token_threshold=threshold,
                          enable_prefix_caching=enable_prefix_caching)
    requests = []
    for i, (p, m, t, prio, _, _, family, salt, n) in enumerate(specs):
        n = min(n, max_num_seqs)  # the input processor rejects n > max_num_seqs
        requests.append(make_request(f"r{i}", p, max_tokens=m, priority=prio,
                                     arrival_time=float(t), first_token=family, cache_salt=salt,
                                     num_samples=n))
    samples = {r.req_id: [r.req_id] + [c for c, _ in r.fork_children] for r in requests}
    all_ids = [sample_id for ids in samples.values() for sample_id in ids]
    num_outputs = dict.fromkeys(all_ids, 0)  # per sample, from the step outputs alone
    final: dict[str, RequestStatus] = {}
    reported_finished: list[str] = []
    for step_index in range(3000):
        for request, spec in zip(requests, specs):
            arrival, abort_at = spec[2], spec[5]
            if arrival == step_index:
                sched.add_request(request)
            if abort_at == step_index and arrival <= step_index:
                for aborted in sched.finish_requests(samples[request.req_id],
                                                     RequestStatus.FINISHED_ABORTED):
                    final[aborted.req_id] = aborted.status
        if step_index > 6 and not sched.has_unfinished_requests():
            break
        eos_at = {sample_id: spec[4] for r, spec in zip(requests, specs)
                  for sample_id in samples[r.req_id]}
        tokens = {i: EOS if eos_at[i] == num_outputs[i] else sample_token(i) for i in all_ids}
        out, core = step(sched, runner, tokens)
        for output in core:
            num_outputs[output.req_id] += len(output.new_token_ids)
            if output.finish_status is not None:
                assert output.req_id not in final, f"{output.req_id} finished twice"
                final[output.req_id] = output.finish_status
        reported_finished.extend(out.finished_req_ids)
        assert out.total_num_scheduled_tokens <= budget
        assert sched.stats().num_running <= max_num_seqs
        assert not out.preempted_req_ids & set(out.num_scheduled_tokens)
        free_ids = sched.kv.pool.free_queue.block_ids()
        tables = [sched.kv.get_block_ids(i) for i in all_ids]
        held = {b for table in tables for b in table}
        assert len(free_ids) == len(set(free_ids)) and not held & set(free_ids)
        assert sorted(free_ids + sorted(held)) == list(range(num_blocks))
        for block in sched.kv.pool.blocks:  # a reference per table holding the block
            assert block.ref_cnt == sum(table.count(block.block_id) for table in tables)
        for block_hash, block in sched.kv.pool.cached.items():
            assert block.block_hash == block_hash
    else:
        pytest.fail("the workload did not finish")
    reported_finished.extend(step(sched, runner)[0].finished_req_ids)
    event(f"preempted: {sched.num_preemptions > 0}")
    event(f"copies: {runner.num_copies > 0}")
    event(f"hits: {sched.kv.stats().prefix_cache_hits > 0}")

    assert_all_blocks_free(sched)
    assert sched.requests == {} and runner.block_tables == {}
    assert sorted(reported_finished) == sorted(set(reported_finished))  # each reported once
    for request, spec in zip(requests, specs):
        max_tokens, eos_index, num_samples = spec[1], spec[4], min(spec[8], max_num_seqs)
        assert request.status.is_finished
        if request.status == RequestStatus.FINISHED_ABORTED:
            continue
        assert len(samples[request.req_id]) == num_samples
        for sample_id in samples[request.req_id]:
            if final[sample_id] == RequestStatus.FINISHED_ABORTED:
                continue
            if eos_index is not None and eos_index < max_tokens:
                assert final[sample_id] == RequestStatus.FINISHED_STOPPED
                assert num_outputs[sample_id] == eos_index + 1
            else:
                assert final[sample_id] == RequestStatus.FINISHED_LENGTH_CAPPED
                assert num_outputs[sample_id] == max_tokens
