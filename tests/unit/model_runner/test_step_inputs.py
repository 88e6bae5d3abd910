"""A decode step's inputs (one token per request) come from their own builder, made for the
cold caches of a decode loop: it must give exactly the tensors the mixed builder gives for
the same step. And a decode step of the same rows reuses the last step's sampling metadata
only while nothing in it can change with the tokens."""

from __future__ import annotations

import random

import torch

from engine_worker.model_runner.inputs import (DecodeInputs, build_step_inputs,
                                               decode_step_inputs, mixed_step_inputs)
from engine_worker.model_runner.runner import ModelRunner, RunnerRequestState
from engine_worker.sampling_params import SamplingParams

BLOCK = 16
CPU = torch.device("cpu")


def _state(rng: random.Random, i: int, params: SamplingParams | None = None
           ) -> RunnerRequestState:
    computed = rng.randrange(0, 200)
    num_blocks = computed // BLOCK + 1
    return RunnerRequestState(
        req_id=f"r{i}", token_ids=[rng.randrange(50_000) for _ in range(computed + 1)],
        num_prompt_tokens=min(computed + 1, rng.randrange(1, 40)),
        params=params or SamplingParams(), block_ids=rng.sample(range(1, 1000), num_blocks),
        num_computed_tokens=computed, generator=None)


def _assert_same(a, b) -> None:
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and torch.equal(a, b), (a, b)
    elif isinstance(a, tuple | list):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _assert_same(x, y)
    else:
        assert a == b


def test_decode_inputs_equal_the_mixed_builders():
    rng = random.Random(0)
    for n in (1, 2, 3, 8, 33):
        states = [_state(rng, i) for i in range(n)]
        fast = decode_step_inputs(states, BLOCK, CPU)
        mixed = mixed_step_inputs(states, [1] * n, BLOCK, CPU)
        ids, positions, meta, starts = fast
        _assert_same((ids, positions, starts), mixed[:2] + (mixed[3],))
        for field in meta.__slots__:
            _assert_same(getattr(meta, field), getattr(mixed[2], field))
        # and build_step_inputs takes this builder for decode-only steps
        assert torch.equal(build_step_inputs(states, [1] * n, BLOCK, CPU)[2].slot_mapping,
                           meta.slot_mapping)
        # one token: the request's next one, in the slot of its position
        s = states[-1]
        p = s.num_computed_tokens
        assert ids[-1].item() == s.token_ids[p]
        assert meta.slot_mapping[-1].item() == s.block_ids[p // BLOCK] * BLOCK + p % BLOCK


def _assert_same_step(got, want) -> None:
    ids, positions, meta, starts = got
    _assert_same((ids, positions, starts), want[:2] + (want[3],))
    for field in meta.__slots__:
        _assert_same(getattr(meta, field), getattr(want[2], field))


def test_decode_inputs_kept_across_steps_equal_a_fresh_build():
    """The buffers filled in place give, step after step, what a fresh build gives: as the
    requests advance (across block boundaries, where the tables widen), as requests come and
    go (the rows change), as the same requests change rows, as one takes another's row, and
    when a table is replaced by a shorter one."""
    rng = random.Random(4)
    kept = DecodeInputs()
    states = [_state(rng, i) for i in range(3)]
    for step in range(80):
        if step == 20:
            states.append(_state(rng, 3))
        if step == 30:  # the same requests, other rows: every row's table is another's
            states.reverse()
        if step == 40:
            del states[0]
        if step == 50:  # a new request in a row, the row count unchanged
            states[1] = _state(rng, 4)
        if step == 60:  # a table sent anew (e.g. after rejected drafts), shorter than before
            s = states[0]
            s.num_computed_tokens = 5
            s.block_ids = s.block_ids[:1]
        for s in states:  # the next token: a block more where the position starts one
            if s.num_computed_tokens // BLOCK >= len(s.block_ids):
                s.block_ids.append(rng.randrange(1, 1000))
            while len(s.token_ids) <= s.num_computed_tokens:
                s.token_ids.append(rng.randrange(50_000))
        got = kept.build(states, BLOCK)
        _assert_same_step(got, decode_step_inputs(states, BLOCK, CPU))
        for s in states:
            s.num_computed_tokens += 1


def test_a_step_with_a_prefill_takes_the_mixed_builder():
    rng = random.Random(1)
    states = [_state(rng, i) for i in range(3)]
    states[2].num_computed_tokens -= 4  # its last five tokens in one chunk
    ids, _, meta, starts = build_step_inputs(states, [1, 1, 5], BLOCK, CPU)
    assert ids.shape == (7,) and starts == [0, 1, 2]
    assert meta.num_decode_tokens == 2 and len(meta.prefills) == 1


def _runner() -> ModelRunner:
    return ModelRunner(model=None, kv_caches=[], block_size=BLOCK, device=CPU,
                       vocab_size=50_000, eos_token_ids=frozenset({0}), seed=0)


def test_sampling_metadata_kept_for_the_same_rows_only():
    rng = random.Random(2)
    runner = _runner()
    rows = [_state(rng, i, SamplingParams(temperature=0.7, top_p=0.9)) for i in range(3)]
    first = runner._sampling_metadata(rows, None)
    assert runner._sampling_metadata(list(rows), None) is first  # same rows, a new list
    assert runner._sampling_metadata(rows[:2], None) is not first  # a request left
    again = runner._sampling_metadata(rows[:2], None)
    other = [rows[0], _state(rng, 9, SamplingParams(temperature=0.7, top_p=0.9))]
    assert runner._sampling_metadata(other, None) is not again  # a different request
    assert torch.equal(runner._sampling_metadata(rows, None).temperature,
                       torch.tensor([0.7] * 3))


def test_sampling_metadata_rebuilt_while_it_changes_with_the_tokens():
    rng = random.Random(3)
    runner = _runner()
    penalised = [_state(rng, 0, SamplingParams(repetition_penalty=1.2))]
    assert runner._sampling_metadata(penalised, None) is not \
        runner._sampling_metadata(penalised, None)
    state = _state(rng, 1, SamplingParams(min_tokens=3, stop_token_ids=[7]))
    state.num_prompt_tokens = len(state.token_ids)  # nothing generated yet: 7 banned
    rows = [state]
    banned = runner._sampling_metadata(rows, None)
    assert [(row, sorted(ids)) for row, ids in banned.banned] == [(0, [0, 7])]
    state.token_ids += [5, 6, 8]  # min_tokens reached: the ban lifts, then the rows are kept
    lifted = runner._sampling_metadata(rows, None)
    assert lifted is not banned and lifted.banned == ()
    assert runner._sampling_metadata(rows, None) is lifted
    # a grammar's bitmask is new every step: never kept
    mask = torch.full((1, 50_000 // 32 + 1), -1, dtype=torch.int32).numpy()
    assert runner._sampling_metadata(rows, mask) is not runner._sampling_metadata(rows, mask)
