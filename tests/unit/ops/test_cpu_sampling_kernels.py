"""The compiled CPU sampling kernels (csrc/cpu/sampling.cpp): the greedy argmax and the
untruncated temperature draw, against torch's argmax and multinomial and against the
sampler's own tensor draw.

Each test runs once per instruction-set variant (``cpu_kernels`` in conftest.py); a variant
this CPU cannot run, or that does not build here, is skipped with the reason.
"""

from __future__ import annotations

import pytest
import torch

from tests.unit.ops.test_cpu_kernels import LANES

pytestmark = pytest.mark.usefixtures("cpu_kernels")  # once per variant


# ---------------------------------------------------------------- the sampler's argmax

def _argmax_rows_cases(width: int) -> torch.Tensor:
    """Rows torch.argmax must agree on: plain, ties (first one wins), NaN, infinities."""
    g = torch.Generator().manual_seed(width)
    x = torch.randn(12, width, generator=g)
    top = float(x.max()) + 1
    x[1, width // 3] = x[1, width - 1] = top  # a tie, the second in the tail
    x[2, :] = top  # all equal: index 0
    x[3, width // 2] = float("nan")
    x[3, width - 1] = float("inf")  # a NaN beats +inf
    x[4, :] = -float("inf")
    x[5, width - 1] = float("inf")
    x[6, width - 1] = float("nan")  # a NaN in the tail only
    x[7, :] = float("nan")
    x[8].clamp_(max=0.5)  # many equal maxima spread over every vector
    x[9, ::3] = top  # ties in every vector; the first at 0
    x[10, 1::5] = top
    x[11] = x[11].to(torch.bfloat16).float()  # coarse values: near-ties
    return x


@pytest.mark.parametrize("width", [1, 7, 16, 17, 100, 49152, 49157])
def test_argmax_rows_is_torch_argmax(width, cpu_kernels):
    x = _argmax_rows_cases(width)
    assert torch.equal(cpu_kernels.ops.argmax_rows(x), x.argmax(dim=-1))
    wide = torch.cat([x, x.flip(1)], dim=1)[:, :width]  # rows of a wider tensor
    assert torch.equal(cpu_kernels.ops.argmax_rows(wide), wide.argmax(dim=-1))


def test_backend_argmax_takes_what_the_kernel_cannot(cpu_kernels):
    x = torch.randn(3, 49)
    for logits in (x, x.to(torch.bfloat16), x.t().contiguous().t(), x[:, :0]):
        if logits.numel() == 0:  # torch refuses an empty row as well
            with pytest.raises((RuntimeError, IndexError)):
                cpu_kernels.backend.sampling.argmax(logits)
            continue
        assert torch.equal(cpu_kernels.backend.sampling.argmax(logits), logits.argmax(dim=-1))


# ---------------------------------------------------------------- the sampler's draw

def _sample_with(kernels, logits, meta, generator):
    from engine_worker.sampler import draw_uniforms, sample_tokens

    return sample_tokens(logits, meta, draw_uniforms(logits, meta, generator), kernels)[0]


@pytest.mark.parametrize("temperature", [0.7, 1.0])
@pytest.mark.parametrize("vocab", [300, 4099])  # neither a multiple of the draw's blocks
def test_draw_rows_matches_multinomial(vocab, temperature, cpu_kernels):
    from tests.unit.test_sampler import (NUM_DRAWS, _assert_same_distribution, _meta,
                                         _reference, _zipf_like_logits)

    logits = _zipf_like_logits(vocab, seed=40)
    meta = _meta(NUM_DRAWS, temperature=torch.full((NUM_DRAWS,), temperature))
    tokens = _sample_with(cpu_kernels.backend.sampling, logits.repeat(NUM_DRAWS, 1), meta,
                          torch.Generator().manual_seed(41))
    _assert_same_distribution(tokens, _reference(torch.softmax(logits.double() / temperature,
                                                               dim=-1)), seed=42)


def test_draw_rows_is_the_samplers_own_draw(cpu_kernels):
    """Same logits, same uniforms: the kernel and the sampler's tensor ops pick the same token
    but where a running sum lands within rounding of its target (none expected in 2,000)."""
    from engine_worker.sampling_draw import PivotRounds, draw_tokens

    g = torch.Generator().manual_seed(43)
    rows, vocab = 2000, 1000
    logits = 3 * torch.randn(rows, vocab, generator=g) - torch.arange(vocab).log1p()
    temperature = 0.25 + 1.5 * torch.rand(rows, generator=g)
    u = torch.rand(rows, dtype=torch.float64, generator=g)
    ours = cpu_kernels.ops.draw_rows(logits, temperature, u)
    probs = torch.softmax(logits / temperature[:, None], dim=-1)
    theirs = draw_tokens(probs, torch.ones(rows, dtype=torch.bool), u[:, None],
                         PivotRounds(0, True), top_k=None, max_top_k=0, top_p=None, min_p=None)
    assert (ours != theirs).sum() <= 2


def test_draw_rows_never_draws_a_masked_token(cpu_kernels):
    """-inf first, last, at block edges and over a whole block, uniforms at both ends of [0, 1)
    and between; rows at temperature 0 and rows with nothing left are skipped (id 0)."""
    vocab = 3 * 256 + 17
    masked = torch.zeros(vocab, dtype=torch.bool)
    masked[[0, 1, 255, 256, 511, vocab - 2, vocab - 1]] = True
    masked[512:768] = True
    g = torch.Generator().manual_seed(44)
    rows = 2000
    logits = torch.randn(rows, vocab, generator=g).masked_fill(masked, float("-inf"))
    u = torch.rand(rows, dtype=torch.float64, generator=g)
    u[0], u[1] = 0.0, 1.0 - 2.0 ** -53
    temperature = torch.full((rows,), 0.8)
    tokens = cpu_kernels.ops.draw_rows(logits, temperature, u)
    assert not masked[tokens].any()
    temperature[5] = 0.0
    logits[6] = float("-inf")
    tokens = cpu_kernels.ops.draw_rows(logits, temperature, u)
    assert tokens[5] == 0 and tokens[6] == 0


def test_draw_rows_leaves_nans_out_and_takes_infinities(cpu_kernels):
    """A NaN right after the maximum in the same vector lane must not hide the maximum (a
    NaN is never drawn, nor a masked token); +inf logits take all the mass (the first)."""
    from tests.unit.test_sampler import NUM_DRAWS, _assert_same_distribution

    lanes = LANES[cpu_kernels.isa]
    g = torch.Generator().manual_seed(49)
    vocab = 300
    row = torch.randn(vocab, generator=g)
    row[5] = 6.0  # the maximum, then NaNs in its lane of later vectors, the last ones
    row[5 + lanes] = row[5 + 4 * lanes] = row[261] = row[277] = float("nan")
    row[0] = float("-inf")
    u = torch.rand(NUM_DRAWS, dtype=torch.float64, generator=g)
    tokens = cpu_kernels.ops.draw_rows(row.repeat(NUM_DRAWS, 1), torch.ones(NUM_DRAWS), u)
    expected = torch.softmax(row.nan_to_num(nan=float("-inf")).double(), dim=-1)
    _assert_same_distribution(tokens, expected, seed=50)
    inf_row = torch.randn(1, vocab, generator=g)
    inf_row[0, [7, 100]] = float("inf")
    assert cpu_kernels.ops.draw_rows(inf_row, torch.ones(1), u[:1]).item() == 7


def test_draw_rows_reads_strided_rows_and_uniforms(cpu_kernels):
    g = torch.Generator().manual_seed(51)
    wide = torch.randn(64, 2 * 1000, generator=g)
    uu = torch.rand(64, 2, dtype=torch.float64, generator=g)
    temperature = torch.full((64,), 0.9)
    strided = cpu_kernels.ops.draw_rows(wide[:, :1000], temperature, uu[:, 0])
    packed = cpu_kernels.ops.draw_rows(wide[:, :1000].contiguous(), temperature,
                                       uu[:, 0].contiguous())
    assert torch.equal(strided, packed)


def test_the_sampler_sends_exactly_the_untruncated_random_rows_to_the_draw(cpu_kernels):
    """Rows with top-p go through the tensor ops, greedy rows take the argmax, the rest
    take the backend's draw: a stand-in draw that answers a token no other path can give
    (logit -inf) shows which rows took it."""
    from engine_worker.backends.base import SamplingKernels
    from tests.unit.test_sampler import _meta, _zipf_like_logits

    vocab = 500
    logits = torch.stack([_zipf_like_logits(vocab, seed=52 + i) for i in range(6)])
    logits[:, vocab - 1] = float("-inf")
    seen = []

    def stand_in(x, temperature, u):
        seen.append(temperature.clone())
        return torch.full((x.shape[0],), vocab - 1)

    kernels = SamplingKernels(argmax=cpu_kernels.backend.sampling.argmax, draw=stand_in)
    temperature = torch.tensor([1.0, 0.7, 0.0, 1.0, 1.2, 0.0])
    top_p = torch.tensor([1.0, 0.9, 1.0, 0.5, 1.0, 0.9])
    meta = _meta(6, temperature=temperature, top_p=top_p, any_greedy=True)
    tokens = _sample_with(kernels, logits, meta, torch.Generator().manual_seed(58))
    assert len(seen) == 1
    assert (seen[0] > 0).tolist() == [True, False, False, False, True, False]
    assert tokens[[0, 4]].tolist() == [vocab - 1] * 2
    assert (tokens[[1, 3]] != vocab - 1).all()
    assert tokens[[2, 5]].tolist() == logits[[2, 5]].argmax(dim=-1).tolist()


def _seeded_row_tokens(kernels, logits, row_index, **columns) -> list[int]:
    """Five steps' tokens of row ``row_index``, seeded (its own generator), the other rows
    drawing from the engine's; ``columns``: the rows' sampling parameters."""
    from tests.unit.test_sampler import _meta

    n = logits.shape[0]
    generators = {row_index: torch.Generator().manual_seed(47)}
    engine = torch.Generator().manual_seed(48 + n)
    return [_sample_with(kernels, logits, _meta(n, generators=generators, **columns),
                         engine)[row_index].item() for _ in range(5)]


def test_a_seeded_untruncated_row_draws_the_same_tokens_alone_and_in_a_batch(cpu_kernels):
    """The kernel's rows and the tensor ops' rows side by side: a row goes to the kernel by
    its own parameters, so its tokens do not depend on what else the step holds."""
    from tests.unit.test_sampler import _zipf_like_logits

    vocab = 1000
    row = _zipf_like_logits(vocab, seed=45)
    others = torch.stack([_zipf_like_logits(vocab, seed=46 + i) * s
                          for i, s in enumerate((0.1, 0.5, 3.0))])

    def run(logits, row_index, truncate_others):
        top_p = torch.full((logits.shape[0],), 0.9 if truncate_others else 1.0)
        top_p[row_index] = 1.0
        return _seeded_row_tokens(cpu_kernels.backend.sampling, logits, row_index, top_p=top_p)

    alone = run(row[None], 0, False)
    assert run(torch.cat([others, row[None]]), 3, True) == alone
    assert run(torch.cat([others[:1], row[None], others[1:]]), 1, False) == alone


# ---------------------------------------------------------------- top-p, one row at a time

@pytest.mark.parametrize("top_p, temperature, rounds", [(0.9, 1.0, 32), (0.5, 0.7, 32),
                                                        (0.5, 1.3, 1), (0.8, 1.0, 0)],
                         ids=["p0.9", "p0.5-cold", "one-round", "sort-only"])
@pytest.mark.parametrize("vocab", [300, 4099])
def test_draw_top_p_rows_matches_multinomial(vocab, top_p, temperature, rounds, cpu_kernels):
    """Against torch.multinomial on the truncated distribution from its definition; one
    round and none send many rows to the sorted floor."""
    from tests.unit.test_sampler import (NUM_DRAWS, _assert_same_distribution, _reference,
                                         _zipf_like_logits)

    logits = 0.5 * _zipf_like_logits(vocab, seed=60)  # flat enough to reject first draws
    u = torch.rand(NUM_DRAWS, rounds + 1, dtype=torch.float64,
                   generator=torch.Generator().manual_seed(61))
    tokens = cpu_kernels.ops.draw_top_p_rows(
        logits.repeat(NUM_DRAWS, 1), torch.full((NUM_DRAWS,), temperature),
        torch.full((NUM_DRAWS,), top_p), u, rounds)
    expected = _reference(torch.softmax(logits.double() / temperature, dim=-1), top_p=top_p)
    _assert_same_distribution(tokens, expected, seed=62)


@pytest.mark.parametrize("rounds", [32, 2, 0])
def test_draw_top_p_rows_is_the_samplers_own_draw(rounds, cpu_kernels):
    """Same logits, same uniforms: the kernel and the tensor ops' pivot rounds (and sorted
    floor) pick the same token but where a running sum lands within rounding of its target."""
    from engine_worker.sampling_draw import PivotRounds, draw_tokens

    g = torch.Generator().manual_seed(63)
    rows, vocab = 2000, 1000
    logits = 2 * torch.randn(rows, vocab, generator=g) - torch.arange(vocab).log1p()
    temperature = 0.5 + torch.rand(rows, generator=g)
    top_p = 0.3 + 0.69 * torch.rand(rows, generator=g)
    u = torch.rand(rows, rounds + 1, dtype=torch.float64, generator=g)
    ours = cpu_kernels.ops.draw_top_p_rows(logits, temperature, top_p, u, rounds)
    probs = torch.softmax(logits / temperature[:, None], dim=-1)
    theirs = draw_tokens(probs, torch.ones(rows, dtype=torch.bool), u,
                         PivotRounds(rounds, True), top_k=None, max_top_k=0, top_p=top_p,
                         min_p=None)
    assert (ours != theirs).sum() <= 4


def test_draw_top_p_rows_keeps_ties_masks_and_skips(cpu_kernels):
    """Ties with the last kept token stay; -inf and NaN logits are never drawn; a row of -inf
    only or at temperature 0 is skipped (id 0); a row with +inf takes the first of them."""
    n = 2000
    u = torch.rand(n, 2, dtype=torch.float64, generator=torch.Generator().manual_seed(64))
    tied = torch.log(torch.tensor([0.1, 0.4, 0.2, 0.2, 0.1, float("nan"), 0.0]))
    tokens = cpu_kernels.ops.draw_top_p_rows(tied.repeat(n, 1), torch.ones(n),
                                             torch.full((n,), 0.5), u, 1)
    assert set(tokens.tolist()) == {1, 2, 3}  # 0.4 < 0.5, so both 0.2s stay
    special = torch.tensor([[float("-inf")] * 4, [0.0, float("inf"), 1.0, float("inf")],
                            [0.0, 1.0, 2.0, 3.0]])
    out = cpu_kernels.ops.draw_top_p_rows(special, torch.tensor([1.0, 1.0, 0.0]),
                                          torch.full((3,), 0.9), u[:3], 1)
    assert out.tolist() == [0, 1, 0]


def test_the_sampler_sends_rows_with_top_p_alone_to_the_top_p_draw(cpu_kernels):
    """Untruncated rows take the draw, rows with top-p alone the top-p draw, rows with top-k
    or min-p the tensor ops, greedy rows the argmax: stand-ins answering tokens no other path
    gives (logit -inf) show which rows took which."""
    from engine_worker.backends.base import SamplingKernels
    from tests.unit.test_sampler import _meta, _zipf_like_logits

    vocab = 500
    logits = torch.stack([_zipf_like_logits(vocab, seed=65 + i) for i in range(6)])
    logits[:, vocab - 2:] = float("-inf")
    seen = {}

    def draw(x, temperature, u):
        seen["draw"] = temperature.clone()
        return torch.full((x.shape[0],), vocab - 1)

    def draw_top_p(x, temperature, top_p, u, rounds):
        seen["top_p"] = temperature.clone()
        return torch.full((x.shape[0],), vocab - 2)

    kernels = SamplingKernels(argmax=cpu_kernels.backend.sampling.argmax, draw=draw,
                              draw_top_p=draw_top_p)
    temperature = torch.tensor([1.0, 0.7, 0.0, 1.0, 1.2, 0.8])
    top_p = torch.tensor([1.0, 0.9, 0.9, 0.5, 1.0, 0.9])
    min_p = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.0, 0.05])
    meta = _meta(6, temperature=temperature, top_p=top_p, min_p=min_p, any_greedy=True)
    tokens = _sample_with(kernels, logits, meta, torch.Generator().manual_seed(71))
    assert (seen["draw"] > 0).tolist() == [True, False, False, False, True, False]
    assert (seen["top_p"] > 0).tolist() == [False, True, False, True, False, False]
    assert tokens[[0, 4]].tolist() == [vocab - 1] * 2
    assert tokens[[1, 3]].tolist() == [vocab - 2] * 2
    assert tokens[5] < vocab - 2
    assert tokens[2] == logits[2].argmax()


def test_a_seeded_top_p_row_draws_the_same_tokens_alone_and_in_a_batch(cpu_kernels):
    """Beside rows with top-k (the tensor ops) or top-p alone (the kernel)."""
    from tests.unit.test_sampler import _zipf_like_logits

    vocab = 1000
    row = _zipf_like_logits(vocab, seed=72)
    others = torch.stack([_zipf_like_logits(vocab, seed=73 + i) * s
                          for i, s in enumerate((0.1, 0.5, 3.0))])

    def run(logits, row_index, others_top_k):
        n = logits.shape[0]
        top_k = torch.full((n,), others_top_k)
        top_k[row_index] = vocab
        return _seeded_row_tokens(cpu_kernels.backend.sampling, logits, row_index,
                                  top_p=torch.full((n,), 0.8), top_k=top_k)

    alone = run(row[None], 0, vocab)
    assert run(torch.cat([others, row[None]]), 3, 20) == alone
    assert run(torch.cat([others[:1], row[None], others[1:]]), 1, vocab) == alone
