"""The sampler's batched operations, checked on hand-made distributions."""

from __future__ import annotations

import math

import pytest
import torch

from engine_worker.platform import to_host
from engine_worker.sampler import (LogprobTensors, PenaltyInputs, SamplingMetadata,
                                   apply_penalties, draw_uniforms, logprob_tensors, sample_tokens)
from engine_worker.sampling_draw import PivotRounds, draw_tokens

NEG_INF = float("-inf")


CPU_ROUNDS = PivotRounds(max_rounds=32, stop_early=True)
DEVICE_ROUNDS = PivotRounds(max_rounds=4, stop_early=False)  # no host read


def _meta(num_rows: int, **overrides) -> SamplingMetadata:
    base = dict(temperature=torch.ones(num_rows), all_greedy=False, any_greedy=False,
                top_k=None, max_top_k=0, top_p=None, min_p=None, generators={},
                penalties=None, banned=(), max_num_logprobs=None, rounds=CPU_ROUNDS)
    if overrides.get("top_k") is not None and "max_top_k" not in overrides:
        base["max_top_k"] = int(overrides["top_k"].max())
    return SamplingMetadata(**(base | overrides))


def sample(logits, meta, default_generator):
    """What the runner does in a step, its one copy to the host included."""
    tokens, logprobs = sample_tokens(logits, meta, draw_uniforms(logits, meta, default_generator))
    if logprobs is None:
        return tokens, None
    return tokens, LogprobTensors(*to_host(logprobs)).to_python()


def gather_logprobs(logprobs, chosen, k):
    return LogprobTensors(*to_host(logprob_tensors(logprobs, chosen, k))).to_python()


def _log(probs):
    return torch.tensor([[math.log(p) for p in probs]])


def _kept(probs, rounds=CPU_ROUNDS, **options):
    """The tokens a row keeps: the set its draws take over many uniforms."""
    num_draws = 400
    probs = torch.tensor([probs]).repeat(num_draws, 1)
    generator = torch.Generator().manual_seed(0)
    uniforms = torch.rand(num_draws, rounds.num_uniforms, dtype=torch.float64,
                          generator=generator)
    options = {"top_k": None, "max_top_k": 0, "top_p": None, "min_p": None} | {
        name: torch.tensor([value]).repeat(num_draws) for name, value in options.items()}
    if options["top_k"] is not None:
        options["max_top_k"] = int(options["top_k"][0])
    tokens = draw_tokens(probs, torch.ones(num_draws, dtype=torch.bool), uniforms, rounds,
                         **options)
    return set(tokens.tolist())


@pytest.mark.parametrize("rounds", [CPU_ROUNDS, DEVICE_ROUNDS, PivotRounds(0, False)])
def test_top_k_top_p_and_min_p_keep_exactly_the_right_tokens(rounds):
    probs = [0.05, 0.5, 0.15, 0.3]
    assert _kept(probs, rounds, top_k=2) == {1, 3}
    # top_p=0.7: 0.5 + 0.3 reach it, 0.15 and 0.05 go
    assert _kept(probs, rounds, top_p=0.7) == {1, 3}
    # top_p=0.81 needs the 0.15 too
    assert _kept(probs, rounds, top_p=0.81) == {1, 2, 3}
    # top-p over the top-k set renormalised: 0.5 / 0.8 < 0.7, so 0.3 stays
    assert _kept(probs, rounds, top_k=2, top_p=0.7) == {1, 3}
    assert _kept(probs, rounds, top_k=2, top_p=0.6) == {1}
    # the most likely token always stays
    assert _kept(probs, rounds, top_p=1e-6) == {1}
    # min-p: at least 0.4 * 0.5
    assert _kept(probs, rounds, min_p=0.4) == {1, 3}
    # ties with the boundary token all stay (top-k counts only strictly more likely tokens)
    tied = [0.1, 0.3, 0.3, 0.3]
    assert _kept(tied, rounds, top_k=1) == {1, 2, 3}
    assert _kept(tied, rounds, top_p=0.5) == {1, 2, 3}


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
    meta = _meta(2, temperature=torch.tensor([0.0, 0.0]), all_greedy=True, any_greedy=True,
                 banned=((1, (1,)),))
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
        num_rows, temperature=torch.where(greedy, 0.0, 0.8), any_greedy=True,
        top_k=torch.full((num_rows,), 5), top_p=torch.full((num_rows,), 0.9),
        min_p=torch.full((num_rows,), 0.05),
        generators={1: torch.Generator().manual_seed(7), 2: torch.Generator().manual_seed(8)},
        penalties=PenaltyInputs(
            prompt_token_ids=torch.randint(0, vocab, (num_rows, 6), generator=ids),
            output_token_ids=torch.randint(0, vocab, (num_rows, 3), generator=ids),
            repetition=torch.full((num_rows,), 1.2), presence=torch.full((num_rows,), 0.3),
            frequency=torch.full((num_rows,), 0.1)),
        banned=((0, (1, 2)), (2, (3,))), max_num_logprobs=4, rounds=DEVICE_ROUNDS)


def test_the_device_part_never_reads_the_device():
    """``sample_tokens`` with every option on runs under FakeTensorMode, which raises on any
    data-dependent host read (``.item()``, ``.tolist()``, ``bool(t)``, a boolean mask): what
    the runner copies to the host (ids, logprobs) is its only read, once a step."""
    from torch._subclasses.fake_tensor import DataDependentOutputException, FakeTensorMode

    vocab = 50
    torch.manual_seed(0)
    logits = torch.randn(6, vocab)
    meta = _every_option(6, vocab)
    uniforms = draw_uniforms(logits, meta, torch.Generator().manual_seed(0))  # random kernels
    with FakeTensorMode(allow_non_fake_inputs=True):
        tokens, logprobs = sample_tokens(logits, meta, uniforms)
        assert tokens.shape == (6,)
        assert logprobs.token_ids.shape == (6, 5) and logprobs.ranks.shape == (6,)
        with pytest.raises(DataDependentOutputException):
            tokens.tolist()


# ------------------------------------------------------------------ the draw's distribution
NUM_DRAWS = 20_000


def _reference(probs: torch.Tensor, top_k=None, top_p=None, min_p=None) -> torch.Tensor:
    """The truncated, renormalised distribution, in float64, straight from the definitions:
    top-k keeps tokens with fewer than k strictly more likely, top-p (over the top-k set)
    tokens whose strictly more likely tokens weigh less than top_p of it, min-p tokens at least
    min_p times the most likely."""
    p = probs.double()
    more_likely = p[None, :] > p[:, None]  # [x, y]: y is strictly more likely than x
    keep = torch.ones_like(p, dtype=torch.bool)
    if top_k is not None:
        keep &= more_likely.sum(dim=1) < top_k
    if top_p is not None:
        in_k = torch.where(keep, p, 0.0)
        keep &= (more_likely * in_k[None, :]).sum(dim=1) < top_p * in_k.sum()
    if min_p is not None:
        keep &= p >= min_p * p.max()
    q = torch.where(keep, p, 0.0)
    return q / q.sum()


def _chi_square_bound(df: int) -> float:
    """The chi-square quantile at 1 - 1e-4 (Wilson-Hilferty; no scipy here)."""
    z = 3.719
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def _assert_same_distribution(tokens: torch.Tensor, expected: torch.Tensor, seed: int) -> None:
    """``tokens`` never leave ``expected``'s support, and a two-sample chi-square test against
    ``torch.multinomial`` on ``expected`` does not reject (bins of tokens with an expected
    count under 10 merged)."""
    ours = torch.bincount(tokens, minlength=len(expected)).double()
    assert ours[expected == 0].sum() == 0, "drew a token the truncation drops"
    generator = torch.Generator().manual_seed(seed)
    theirs = torch.bincount(torch.multinomial(expected, NUM_DRAWS, replacement=True,
                                              generator=generator),
                            minlength=len(expected)).double()
    big = expected * NUM_DRAWS >= 10
    a = torch.cat([ours[big], ours[~big].sum()[None]])
    b = torch.cat([theirs[big], theirs[~big].sum()[None]])
    used = (a + b) > 0
    a, b = a[used], b[used]
    statistic = ((a - b) ** 2 / (a + b)).sum().item()
    assert statistic < _chi_square_bound(len(a) - 1), (statistic, len(a))


def _zipf_like_logits(vocab: int, seed: int) -> torch.Tensor:
    # a long tail below a few likely tokens, as an LM's; 300 is not a multiple of DRAW_BLOCK
    generator = torch.Generator().manual_seed(seed)
    return 2.0 * torch.randn(vocab, generator=generator) - 0.5 * torch.arange(vocab).log1p()


OPTIONS = {
    "temperature": {},
    "top_p": {"top_p": 0.9},
    "top_k": {"top_k": 20},
    "min_p": {"min_p": 0.05},
    "all": {"top_k": 50, "top_p": 0.8, "min_p": 0.02},
}


@pytest.mark.parametrize("rounds", [CPU_ROUNDS, DEVICE_ROUNDS], ids=["cpu", "device"])
@pytest.mark.parametrize("name", OPTIONS)
def test_the_draw_matches_multinomial(name, rounds):
    options = OPTIONS[name]
    logits = _zipf_like_logits(300, seed=1)
    temperature = 0.7
    meta = _meta(NUM_DRAWS, temperature=torch.full((NUM_DRAWS,), temperature), rounds=rounds,
                 **{k: torch.full((NUM_DRAWS,), v) for k, v in options.items()})
    tokens, _ = sample(logits.repeat(NUM_DRAWS, 1), meta, torch.Generator().manual_seed(2))
    expected = _reference(torch.softmax(logits.double() / temperature, dim=-1), **options)
    _assert_same_distribution(tokens, expected, seed=3)


@pytest.mark.parametrize("rounds", [PivotRounds(0, False), PivotRounds(0, True),
                                    PivotRounds(1, True), PivotRounds(2, False)],
                         ids=["sort-only", "sort-only-host", "one-round", "two-rounds"])
def test_rows_left_after_the_rounds_are_still_exact(rounds):
    """A flat distribution with top_p 0.5 rejects about half of the first draws, so the sorted
    fallback takes many rows, alone or after rounds that accepted others."""
    logits = 0.3 * _zipf_like_logits(300, seed=4)
    options = {"top_p": 0.5, "top_k": 200}
    meta = _meta(NUM_DRAWS, rounds=rounds,
                 **{k: torch.full((NUM_DRAWS,), v) for k, v in options.items()})
    tokens, _ = sample(logits.repeat(NUM_DRAWS, 1), meta, torch.Generator().manual_seed(5))
    _assert_same_distribution(tokens, _reference(torch.softmax(logits.double(), dim=-1),
                                                 **options), seed=6)


@pytest.mark.parametrize("rounds", [CPU_ROUNDS, DEVICE_ROUNDS, PivotRounds(0, False)])
def test_a_token_of_probability_zero_is_never_drawn(rounds):
    """Zeros first, last, at block edges and in whole blocks, with uniforms at both ends of
    [0, 1) as well as random ones."""
    vocab = 3 * 256 + 17
    probs = torch.rand(vocab, generator=torch.Generator().manual_seed(7))
    zero = torch.zeros(vocab, dtype=torch.bool)
    zero[[0, 1, 255, 256, 511, vocab - 2, vocab - 1]] = True
    zero[512:768] = True  # a whole block
    probs = torch.where(zero, 0.0, probs)
    probs = probs / probs.sum()
    num_rows = 2000
    u = torch.rand(num_rows, rounds.num_uniforms, dtype=torch.float64,
                   generator=torch.Generator().manual_seed(8))
    u[0], u[1] = 0.0, 1.0 - 2.0 ** -53  # the ends of [0, 1)
    batch = probs.repeat(num_rows, 1)
    for options in ({}, {"top_p": 0.95}, {"min_p": 1e-3}, {"top_k": 600, "top_p": 0.99}):
        columns = {"top_k": None, "max_top_k": 0, "top_p": None, "min_p": None} | {
            k: torch.full((num_rows,), v) for k, v in options.items()}
        if "top_k" in options:
            columns["max_top_k"] = options["top_k"]
        tokens = draw_tokens(batch, torch.ones(num_rows, dtype=torch.bool), u, rounds,
                             **columns)
        assert not zero[tokens].any(), options


@pytest.mark.parametrize("rounds", [CPU_ROUNDS, DEVICE_ROUNDS], ids=["cpu", "device"])
def test_a_seeded_row_draws_the_same_tokens_alone_and_in_a_batch(rounds):
    """Step after step, whatever the other rows are (greedy, flat, peaked) and however many
    rounds they need."""
    vocab = 1000
    row = _zipf_like_logits(vocab, seed=9)
    others = torch.stack([_zipf_like_logits(vocab, seed=10 + i) * s
                          for i, s in enumerate((0.1, 0.5, 3.0))])
    options = dict(top_p=0.9, top_k=100, min_p=0.01)

    def run(logits, row_index):
        n = logits.shape[0]
        generators = {row_index: torch.Generator().manual_seed(11)}
        temperature = torch.ones(n)
        temperature[0] = 0.0 if row_index != 0 else 1.0  # row 0 greedy unless it is ours
        engine = torch.Generator().manual_seed(12 + n)
        tokens = []
        for _ in range(5):  # the generators carry over from step to step
            meta = _meta(n, temperature=temperature, any_greedy=bool((temperature == 0).any()),
                         generators=generators, rounds=rounds,
                         **{k: torch.full((n,), v) for k, v in options.items()})
            tokens.append(sample(logits, meta, engine)[0][row_index].item())
        return tokens

    alone = run(row[None], 0)
    assert run(torch.cat([others, row[None]]), 3) == alone
    assert run(torch.cat([others[:1], row[None], others[1:]]), 1) == alone


def test_stopping_early_changes_no_token():
    """The CPU's early stop (rounds over the rows still drawing only) draws what every round
    over every row draws, from the same uniforms."""
    num_rows, vocab = 64, 700
    logits = torch.stack([_zipf_like_logits(vocab, seed=20 + i) * (0.2 + 0.05 * i)
                          for i in range(num_rows)])
    probs = torch.softmax(logits, dim=-1)
    columns = dict(top_k=torch.full((num_rows,), 400), max_top_k=400,
                   top_p=torch.linspace(0.3, 1.0, num_rows), min_p=None)
    drawing = torch.arange(num_rows) % 5 != 0
    u = torch.rand(num_rows, 33, dtype=torch.float64, generator=torch.Generator().manual_seed(30))
    early = draw_tokens(probs, drawing, u, PivotRounds(32, True), **columns)
    every = draw_tokens(probs, drawing, u, PivotRounds(32, False), **columns)
    assert torch.equal(early[drawing], every[drawing])


@pytest.mark.parametrize("mode", ["greedy", "random", "top_p"])
def test_a_row_its_grammar_and_bans_leave_no_token_samples_no_token(mode):
    """A grammar that allows only token 5 and a ban on token 5 (bad_words), or an allowed
    list that bad_words ban whole: the row has no token to take. It samples NO_TOKEN (its request
    ends with an error naming the fields), and the other rows sample as usual; with top-p the
    draw used to index -1 and fail the whole step."""
    from engine_worker.step_types import NO_TOKEN

    vocab, rows = 64, 4
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(3))
    bitmask = torch.full((rows, 2), -1, dtype=torch.int32)
    bitmask[0] = 0
    bitmask[0, 0] = 1 << 5  # row 0: the grammar allows token 5 only
    bitmask[1] = 0
    bitmask[1, 0] = (1 << 5) | (1 << 9)  # row 1: 5 or 9
    greedy = mode == "greedy"
    meta = _meta(rows, temperature=torch.zeros(rows) if greedy else torch.ones(rows),
                 all_greedy=greedy, token_bitmask=bitmask,
                 top_p=torch.full((rows,), 0.9) if mode == "top_p" else None,
                 bad_words=((0, (5,)), (1, (5,)), (3, (7,))), max_num_logprobs=1,
                 allowed=((2, (7, 8)), (3, (7,))))
    tokens, logprobs = sample(logits, meta, torch.Generator().manual_seed(0))
    tokens = to_host([tokens])[0].tolist()
    assert tokens[0] == NO_TOKEN
    assert tokens[1] == 9  # the one token its grammar and bans leave
    assert tokens[2] in (7, 8)  # no grammar: its allowed list as before
    assert tokens[3] == NO_TOKEN  # bad_words ban all it allows (min_tokens' bans would not)
    assert len(logprobs.ranks) == rows  # logprobs were still taken for every row
