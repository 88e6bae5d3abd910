"""The sampler's batched operations, checked on hand-made distributions."""

from __future__ import annotations

import math

import pytest
import torch

from engine_worker.sampler import (PenaltyInputs, SamplingMetadata, _top_k_top_p, apply_penalties,
                                   gather_logprobs, sample)

NEG_INF = float("-inf")


def _meta(num_rows: int, **overrides) -> SamplingMetadata:
    base = dict(temperature=torch.ones(num_rows), all_greedy=False, top_k=None, top_p=None,
                min_p=None, generators={}, penalties=None, banned=(), max_num_logprobs=None)
    return SamplingMetadata(**(base | overrides))


def _log(probs):
    return torch.tensor([[math.log(p) for p in probs]])


def test_top_k_and_top_p_keep_exactly_the_right_tokens():
    logits = _log([0.05, 0.5, 0.15, 0.3])
    kept = _top_k_top_p(logits, torch.tensor([2]), None)
    assert torch.isinf(kept[0]).tolist() == [True, False, True, False]
    # top_p=0.7: 0.5 + 0.3 reach it, 0.15 and 0.05 go
    kept = _top_k_top_p(logits, None, torch.tensor([0.7]))
    assert torch.isinf(kept[0]).tolist() == [True, False, True, False]
    # top_p=0.81 needs the 0.15 too
    kept = _top_k_top_p(logits, None, torch.tensor([0.81]))
    assert torch.isinf(kept[0]).tolist() == [True, False, False, False]
    # the kept logits are unchanged
    assert kept[0, 1].item() == logits[0, 1].item()


def test_sampling_follows_the_distribution_and_seeds_are_private():
    probs = [0.1, 0.2, 0.7]
    logits = _log(probs).repeat(4000, 1)
    generator = torch.Generator().manual_seed(0)
    tokens, _ = sample(logits, _meta(4000), generator)
    freq = torch.bincount(tokens, minlength=3).float() / 4000
    assert freq.tolist() == pytest.approx(probs, abs=0.03)
    # a seeded row draws from its own generator, whatever the other rows are
    row = _log(probs)
    a, _ = sample(torch.cat([row, row]), _meta(2, generators={1: torch.Generator().manual_seed(5)}),
                  torch.Generator().manual_seed(1))
    b, _ = sample(torch.cat([_log([0.9, 0.05, 0.05]), row]),
                  _meta(2, generators={1: torch.Generator().manual_seed(5)}),
                  torch.Generator().manual_seed(2))
    assert a[1] == b[1]


def test_min_p_drops_unlikely_tokens():
    logits = _log([0.6, 0.3, 0.07, 0.03]).repeat(500, 1)
    tokens, _ = sample(logits, _meta(500, min_p=torch.full((500,), 0.2)),
                       torch.Generator().manual_seed(0))
    assert set(tokens.tolist()) == {0, 1}


def test_greedy_rows_take_the_argmax_and_bans_apply():
    logits = torch.tensor([[1.0, 3.0, 2.0], [1.0, 3.0, 2.0]])
    meta = _meta(2, temperature=torch.tensor([0.0, 0.0]), all_greedy=True, banned=((1, (1,)),))
    tokens, _ = sample(logits, meta, None)
    assert tokens.tolist() == [1, 2]


def test_penalties_are_exact():
    vocab = 5
    logits = torch.tensor([[2.0, -1.0, 0.5, 1.0, -2.0]])
    p = PenaltyInputs(prompt_token_ids=torch.tensor([[0, vocab]]),  # token 0 in the prompt
                      output_token_ids=torch.tensor([[1, 1, 3]]),  # token 1 twice, 3 once
                      repetition=torch.tensor([2.0]), presence=torch.tensor([0.5]),
                      frequency=torch.tensor([0.25]))
    out = apply_penalties(logits, p)[0].tolist()
    assert out == pytest.approx([2.0 / 2, -1.0 * 2 - 0.5 - 0.5, 0.5, 1.0 / 2 - 0.5 - 0.25, -2.0])


def test_logprobs_ranks_and_top_k():
    logprobs = torch.log_softmax(torch.tensor([[0.0, 2.0, 1.0, 3.0]]), dim=-1)
    got = gather_logprobs(logprobs, torch.tensor([2]), 2)
    assert got.token_ids == ((2, 3, 1),)
    assert got.ranks == (3,)
    assert got.logprobs[0][0] == pytest.approx(logprobs[0, 2].item())
