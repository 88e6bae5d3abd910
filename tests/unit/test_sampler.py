"""The sampler's batched operations, checked on hand-made distributions."""

from __future__ import annotations

import math

import pytest
import torch

from engine_worker.platform import to_host
from engine_worker.sampler import (LogprobTensors, PenaltyInputs, SamplingMetadata, _top_k_top_p,
                                   apply_penalties, draw_noise, logprob_tensors, sample_tokens)

NEG_INF = float("-inf")


def _meta(num_rows: int, **overrides) -> SamplingMetadata:
    base = dict(temperature=torch.ones(num_rows), all_greedy=False, top_k=None, top_p=None,
                min_p=None, generators={}, penalties=None, banned=(), max_num_logprobs=None)
    return SamplingMetadata(**(base | overrides))


def sample(logits, meta, default_generator):
    """What the runner does in a step, its one copy to the host included."""
    tokens, logprobs = sample_tokens(logits, meta, draw_noise(logits, meta, default_generator))
    if logprobs is None:
        return tokens, None
    return tokens, LogprobTensors(*to_host(logprobs)).to_python()


def gather_logprobs(logprobs, chosen, k):
    return LogprobTensors(*to_host(logprob_tensors(logprobs, chosen, k))).to_python()


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


def _every_option(num_rows: int, vocab: int) -> SamplingMetadata:
    """Greedy and random rows, seeded rows, top-k, top-p, min-p, penalties, bans, logprobs."""
    greedy = torch.arange(num_rows) % 3 == 0
    ids = torch.Generator().manual_seed(1)
    return _meta(
        num_rows, temperature=torch.where(greedy, 0.0, 0.8),
        top_k=torch.full((num_rows,), 5), top_p=torch.full((num_rows,), 0.9),
        min_p=torch.full((num_rows,), 0.05),
        generators={1: torch.Generator().manual_seed(7), 2: torch.Generator().manual_seed(8)},
        penalties=PenaltyInputs(
            prompt_token_ids=torch.randint(0, vocab, (num_rows, 6), generator=ids),
            output_token_ids=torch.randint(0, vocab, (num_rows, 3), generator=ids),
            repetition=torch.full((num_rows,), 1.2), presence=torch.full((num_rows,), 0.3),
            frequency=torch.full((num_rows,), 0.1)),
        banned=((0, (1, 2)), (2, (3,))), max_num_logprobs=4)


def test_the_device_part_never_reads_the_device():
    """``sample_tokens`` with every option on runs under FakeTensorMode, which raises on any
    data-dependent host read (``.item()``, ``.tolist()``, ``bool(t)``, a boolean mask): what
    the runner copies to the host (ids, logprobs) is its only read, once a step."""
    from torch._subclasses.fake_tensor import DataDependentOutputException, FakeTensorMode

    vocab = 50
    torch.manual_seed(0)
    logits = torch.randn(6, vocab)
    meta = _every_option(6, vocab)
    noise = draw_noise(logits, meta, torch.Generator().manual_seed(0))  # random kernels only
    with FakeTensorMode(allow_non_fake_inputs=True):
        tokens, logprobs = sample_tokens(logits, meta, noise)
        assert tokens.shape == (6,)
        assert logprobs.token_ids.shape == (6, 5) and logprobs.ranks.shape == (6,)
        with pytest.raises(DataDependentOutputException):
            tokens.tolist()
