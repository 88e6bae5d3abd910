"""Draw one token per row from ``p`` truncated by top-k, top-p and min-p, with a few uniforms
per row instead of a vocabulary of noise.

Every truncation keeps an *upper set* of the vocabulary, ``{x : p_x >= floor}``:

- top-k keeps the tokens with fewer than k tokens strictly more likely (ties with the k-th
  largest probability all stay): ``floor`` is the k-th largest, from ``torch.topk``;
- min-p keeps ``p_x >= min_p * max(p)``;
- top-p keeps the tokens that the tokens strictly more likely than them weigh less than
  ``top_p`` of (over the top-k set, renormalised; min-p, applied after, does not change it). The
  most likely token always stays, and so do ties with the least likely kept token.

A token is drawn by inverse CDF: the first token whose running sum of ``p`` passes ``u`` times
the total, one uniform ``u``. Top-k and min-p floors are known, so they cost a mask. Top-p's is
found by pivot rejection (FlashInfer's idea, in plain tensor ops): draw ``x`` from the tokens
above a pivot, keep it if top-p keeps it, else raise the pivot to ``p_x`` and draw again with a
fresh uniform. The pivot always stays below the kept set, so a kept ``x`` is distributed exactly
as ``p`` restricted to it. A rejection drops ``x`` and everything less likely, which for the
peaked distributions LMs give ends in one or two rounds; rows still drawing after
``PivotRounds.max_rounds`` take the floor from a sort, also exact.

Shapes: ``probs`` [num_rows, vocab_size] fp32; running sums are float64, where the 53-bit
uniforms keep the resolution of tokens far below 2**-24 of the mass.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# The inverse CDF runs in two levels: a running sum over blocks of this many tokens picks the
# block, a running sum inside it the token. A vocabulary-long running sum is sequential on a
# CPU (~3 ms for 64 x 49,152 on a Zen 3) where block sums vectorise (~0.3 ms), and the two
# short running sums are cheap enough to take in float64.
DRAW_BLOCK = 256


@dataclass(frozen=True, slots=True)
class PivotRounds:
    """How top-p is drawn: at most ``max_rounds`` rounds of pivot rejection, then a sort for
    the rows still drawing. ``stop_early``: after each round, read on the host whether any row
    is still drawing; stop when none is, and sort only the rows left."""

    max_rounds: int
    stop_early: bool

    @property
    def num_uniforms(self) -> int:
        return self.max_rounds + 1  # one a round, then one for the sorted floor


def pivot_rounds_for(device: torch.device) -> PivotRounds:
    """On the CPU the device is the host: reading one flag a round costs a branch, and stopping
    early is what makes rejection pay (a full sort of 64 x 49,152 takes ~300 ms on a Zen 3;
    a round ~5 ms). On a GPU the read would synchronize the stream every round, and without it
    the sort cannot be skipped for the rows the rounds accepted (a ``torch.where`` computes both
    sides), so rounds would only add work to a sort that is cheap there: no rounds, the sorted
    floor for every row, then one uniform."""
    if device.type == "cpu":
        return PivotRounds(max_rounds=32, stop_early=True)
    return PivotRounds(max_rounds=0, stop_early=False)


def draw_tokens(probs: torch.Tensor, drawing: torch.Tensor, uniforms: torch.Tensor,
                rounds: PivotRounds, *, top_k: torch.Tensor | None, max_top_k: int,
                top_p: torch.Tensor | None, min_p: torch.Tensor | None) -> torch.Tensor:
    """[num_rows] int64 token ids. ``drawing`` [num_rows] bool: the rows to draw (others get
    an arbitrary id); ``uniforms`` [num_rows, rounds.num_uniforms] float64 in [0, 1);
    ``top_k`` int64, ``vocab_size`` where off, ``max_top_k`` the largest k that is on."""
    k_floor = None if top_k is None else _kth_largest(probs, top_k, max_top_k)
    floor = k_floor
    if min_p is not None:
        p_floor = min_p * probs.amax(dim=-1)
        floor = p_floor if floor is None else torch.maximum(floor, p_floor)
    weights = probs if floor is None else _at_least(probs, floor)
    sums = _block_sums(weights)
    if top_p is None:
        return _inverse_cdf(weights, sums, uniforms[:, 0])
    # top-p weighs against the top-k set's mass; a row with top_p 1 keeps everything
    if k_floor is None and min_p is not None:
        mass = _block_sums(probs).sum(dim=-1)
    elif k_floor is not None and min_p is not None:
        mass = _block_sums(_at_least(probs, k_floor)).sum(dim=-1)
    else:  # the pool is the top-k set (or everything)
        mass = sums.sum(dim=-1)
    budget = torch.where(top_p < 1, top_p * mass, float("inf"))
    tokens, drawing = _pivot_rounds(probs, weights, sums, budget, drawing, uniforms, rounds)
    if floor is None:
        floor = torch.zeros_like(budget, dtype=probs.dtype)
    return _sorted_fallback(probs, floor, budget, drawing, tokens, uniforms[:, -1], rounds)


def _pivot_rounds(probs, weights, sums, budget, drawing, uniforms, rounds: PivotRounds):
    """Returns (tokens, rows still drawing). ``weights``: ``probs`` above the pivot, 0 below;
    ``sums``: its block sums."""
    tokens = torch.zeros(probs.shape[0], dtype=torch.int64, device=probs.device)
    if not rounds.stop_early:  # every row, every round: no host read
        for r in range(rounds.max_rounds):
            x, weights, sums, kept = _round(probs, weights, sums, budget, uniforms[:, r])
            kept = drawing & kept
            tokens = torch.where(kept, x, tokens)
            drawing = drawing & ~kept
        return tokens, drawing
    # On the host (see pivot_rounds_for), each round takes only the rows still drawing: most
    # rows are kept in the first round, and the slowest of 64 rows needs a few more.
    rows = drawing.nonzero()[:, 0]
    if len(rows) < len(drawing):
        probs, weights, sums, budget = probs[rows], weights[rows], sums[rows], budget[rows]
    for r in range(rounds.max_rounds):
        if len(rows) == 0:
            break
        x, weights, sums, kept = _round(probs, weights, sums, budget, uniforms[rows, r])
        tokens[rows[kept]] = x[kept]
        left = ~kept
        rows, probs, weights, sums, budget = (rows[left], probs[left], weights[left],
                                              sums[left], budget[left])
    drawing = torch.zeros_like(drawing)
    drawing[rows] = True
    return tokens, drawing


def _round(probs, weights, sums, budget, u):
    """One pivot round: x drawn from ``weights``, the tokens strictly more likely than x (the
    next round's ``weights`` and ``sums`` if x is rejected), and whether top-p keeps x."""
    x = _inverse_cdf(weights, sums, u)
    above = torch.where(probs > probs.gather(1, x[:, None]), probs, 0.0)
    above_sums = _block_sums(above)
    return x, above, above_sums, above_sums.sum(dim=-1) < budget


def _sorted_fallback(probs, floor, budget, drawing, tokens, u, rounds: PivotRounds):
    """The rows still ``drawing`` draw from above their exact floor, from a sort."""
    if not rounds.stop_early:  # every row, then keep only the drawing rows' (no host read)
        drawn = _draw_above_sorted_floor(probs, floor, budget, u)
        return torch.where(drawing, drawn, tokens)
    rows = drawing.nonzero()[:, 0]  # a host read, as the rounds'
    if rows.numel() == 0:
        return tokens
    drawn = _draw_above_sorted_floor(probs[rows], floor[rows], budget[rows], u[rows])
    return tokens.index_put((rows,), drawn)


def _draw_above_sorted_floor(probs, floor, budget, u):
    ordered = probs.sort(dim=-1, descending=True).values
    running = ordered.cumsum(dim=-1, dtype=torch.float64)
    # mass strictly before each sorted position; its number of positions under budget is
    # the number of tokens top-p keeps, less the ties of the last one that sort after it
    before = torch.cat([torch.zeros_like(running[:, :1]), running[:, :-1]], dim=1)
    num_kept = (before < budget[:, None]).sum(dim=-1)  # >= 1: before[0] = 0 < budget
    # (0 only for a row of no finite logit, whose budget is NaN: never an index of -1, which
    # would fail the whole step; such a row is answered NO_TOKEN by the sampler)
    top_p_floor = ordered.gather(1, (num_kept - 1).clamp(min=0)[:, None])[:, 0]
    weights = _at_least(probs, torch.maximum(floor, top_p_floor))
    return _inverse_cdf(weights, _block_sums(weights), u)


def _kth_largest(probs: torch.Tensor, top_k: torch.Tensor, max_top_k: int) -> torch.Tensor:
    """[num_rows]: the k-th largest probability, 0 where top-k is off (k = vocab_size)."""
    values = probs.topk(max_top_k, dim=-1).values  # [num_rows, max_top_k], descending
    kth = values.gather(1, (top_k.clamp(max=max_top_k) - 1)[:, None])[:, 0]
    return torch.where(top_k < probs.shape[1], kth, 0.0)


def _at_least(probs: torch.Tensor, floor: torch.Tensor) -> torch.Tensor:
    return torch.where(probs >= floor[:, None], probs, 0.0)


def _block_sums(weights: torch.Tensor) -> torch.Tensor:
    """[num_rows, ceil(vocab_size / DRAW_BLOCK)] float64: each block's sum (summed in fp32)."""
    num_rows, vocab_size = weights.shape
    full = vocab_size - vocab_size % DRAW_BLOCK
    parts = []
    if full:
        parts.append(weights[:, :full].reshape(num_rows, -1, DRAW_BLOCK).sum(dim=-1))
    if full < vocab_size:
        parts.append(weights[:, full:].sum(dim=-1, keepdim=True))
    sums = parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)
    return sums.double()


def _below(x: torch.Tensor) -> torch.Tensor:
    """The largest float64 under ``x`` (x >= 0; 0 stays 0)."""
    return torch.nextafter(x, torch.zeros_like(x))


def _inverse_cdf(weights: torch.Tensor, sums: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """[num_rows]: token i with probability ``weights_i / sum(weights)`` from one uniform per
    row (``u`` [num_rows] float64 in [0, 1); ``sums`` are ``_block_sums(weights)``).

    Each search finds the first running sum strictly above its target, and each target is kept
    strictly below its total, so a token of weight 0 is never drawn: its running sum equals the
    one before it. A row whose weights are all 0 gets an arbitrary id (rows no longer drawing)."""
    num_rows, vocab_size = weights.shape
    running = sums.cumsum(dim=-1)  # [num_rows, num_blocks]
    total = running[:, -1:]
    target = torch.minimum(u[:, None] * total, _below(total))  # [num_rows, 1]
    block = torch.searchsorted(running, target, right=True).clamp_(max=running.shape[1] - 1)
    before = torch.where(block > 0, running.gather(1, (block - 1).clamp(min=0)), 0.0)
    # [num_rows, DRAW_BLOCK]: the chosen block's token ids and weights (0 past the vocabulary)
    ids = block * DRAW_BLOCK + torch.arange(DRAW_BLOCK, device=weights.device)
    inside = torch.where(ids < vocab_size, weights.gather(1, ids.clamp(max=vocab_size - 1)), 0.0)
    inside_running = inside.cumsum(dim=-1, dtype=torch.float64)
    rest = torch.minimum((target - before).clamp(min=0.0), _below(inside_running[:, -1:]))
    pos = torch.searchsorted(inside_running, rest, right=True).clamp_(max=DRAW_BLOCK - 1)
    return ids.gather(1, pos)[:, 0].clamp(max=vocab_size - 1)
