"""Batched sampling: one set of tensor ops for every row, no Python loop over the vocabulary.

Order (as vLLM and Hugging Face apply them): a structured output's grammar masks the logits
(tokens it does not allow get -inf), then logprobs of that distribution are taken (so they are
those before everything after, as vLLM's default ``raw_logprobs``); then min_tokens and
bad_words masking, allowed_token_ids, logit_bias, repetition / presence / frequency
penalties, then greedy rows take the argmax and random rows go through temperature, then
top-k, top-p and min-p with an exact draw of a few uniforms per row (``sampling_draw``).
Seeded rows draw their uniforms from their own generator, the same number every step, so
their tokens do not depend on the batch. A backend
may bring its own argmax and untruncated draw (``Backend.sampling``: the CPU kernels scan a
row in two vector passes), the same functions of the logits and uniforms.

The device part never reads a device value on the host: ``draw_uniforms`` (random kernels only)
and ``sample_tokens`` (tensors in, tensors out) queue work and return; the caller copies the
sampled ids, and the logprobs where asked for, to the host once per step
(``platform.to_host``). The one exception is the CPU's top-p draw, which reads one flag a
round on the host, where it is no device read (``sampling_draw.pivot_rounds_for``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from engine_worker.backends.base import SamplingKernels
from engine_worker.platform import to_device
from engine_worker.sampling_draw import PivotRounds, draw_tokens
from engine_worker.step_types import NO_TOKEN, SampledLogprobs


@dataclass(frozen=True, slots=True)
class PenaltyInputs:
    prompt_token_ids: torch.Tensor  # [num_rows, max_prompt_len], padded with vocab_size
    output_token_ids: torch.Tensor  # [num_rows, max_output_len], padded with vocab_size
    repetition: torch.Tensor  # [num_rows]
    presence: torch.Tensor  # [num_rows]
    frequency: torch.Tensor  # [num_rows]


@dataclass(frozen=True, slots=True)
class SamplingMetadata:
    """Everything the sampler needs for one step's rows. Optional parts are None when no row
    uses them, so the common case pays nothing."""

    temperature: torch.Tensor  # [num_rows] fp32; 0 marks a greedy row
    all_greedy: bool
    any_greedy: bool
    top_k: torch.Tensor | None  # [num_rows] int64, vocab_size where disabled
    max_top_k: int  # the largest k below vocab_size; 0 when top_k is None
    top_p: torch.Tensor | None  # [num_rows] fp32
    min_p: torch.Tensor | None  # [num_rows] fp32
    generators: dict[int, torch.Generator]  # row -> per-request generator (seeded rows)
    penalties: PenaltyInputs | None
    banned: tuple[tuple[int, tuple[int, ...]], ...]  # (row, token ids) masked for min_tokens
    max_num_logprobs: int | None  # top-k logprobs to return; None: none
    rounds: PivotRounds  # how top-p is drawn on this device
    # structured outputs: int32 [num_rows, ceil(vocab / 32)], bit b of word w allows token
    # 32 w + b (-1: every token); None when no row has a grammar
    token_bitmask: torch.Tensor | None = None
    logit_bias: tuple[tuple[int, int, float], ...] = ()  # (row, token id, bias)
    # (row, token ids): the only tokens that row may take (vLLM's allowed_token_ids)
    allowed: tuple[tuple[int, tuple[int, ...]], ...] = ()
    # (row, token ids) bad_words bans now (unlike min_tokens' bans, an allowed list never
    # lifts them)
    bad_words: tuple[tuple[int, tuple[int, ...]], ...] = ()


class LogprobTensors(NamedTuple):
    """Logprobs of one token per row, on the device: the chosen token first, then the top k."""

    token_ids: torch.Tensor  # [num_rows, 1 + k] int64
    logprobs: torch.Tensor  # [num_rows, 1 + k] fp32
    ranks: torch.Tensor  # [num_rows] int64: the chosen token's 1-based rank

    def to_python(self, first_k: int | None = None) -> SampledLogprobs:
        """Plain Python data from host tensors; ``first_k``: keep the chosen token and the
        top ``first_k - 1`` only."""
        ids, lps = self.token_ids, self.logprobs
        if first_k is not None:
            ids, lps = ids[:, :first_k], lps[:, :first_k]
        return SampledLogprobs(token_ids=tuple(map(tuple, ids.tolist())),
                               logprobs=tuple(map(tuple, lps.tolist())),
                               ranks=tuple(self.ranks.tolist()))


def draw_uniforms(logits: torch.Tensor, meta: SamplingMetadata,
                  default_generator: torch.Generator | None) -> torch.Tensor | None:
    """[num_rows, meta.rounds.num_uniforms] float64 in [0, 1), None when every row is greedy.
    Every row draws from the engine's stream, then seeded rows redraw from their own."""
    if meta.all_greedy:
        return None
    u = torch.rand(logits.shape[0], meta.rounds.num_uniforms, dtype=torch.float64,
                   device=logits.device, generator=default_generator)
    for row, generator in meta.generators.items():
        u[row].uniform_(generator=generator)
    return u


def sample_tokens(logits: torch.Tensor, meta: SamplingMetadata, uniforms: torch.Tensor | None,
                  kernels: SamplingKernels = SamplingKernels()
                  ) -> tuple[torch.Tensor, LogprobTensors | None]:
    """The device part: token ids [num_rows] and, where asked for, their logprobs, all left
    on the device. ``uniforms`` are ``draw_uniforms``'s (None only when every row is greedy);
    ``kernels``: the backend's argmax and draw (``Backend.sampling``)."""
    if meta.token_bitmask is not None:
        logits = apply_token_bitmask(logits, meta.token_bitmask)
    raw_logprobs = None
    if meta.max_num_logprobs is not None:
        raw_logprobs = torch.log_softmax(logits, dim=-1)
    logits = _apply_bans(logits, meta.bad_words)
    unbanned = logits
    logits = _apply_bans(logits, meta.banned)
    if meta.allowed:
        logits = _apply_allowed(logits, meta.allowed, unbanned)
    dead = None
    if sum((meta.token_bitmask is not None, bool(meta.bad_words), bool(meta.allowed))) > 1:
        # two of a grammar, bad_words and an allowed list can together leave a row no token
        # (every one -inf: no distribution to draw from; one alone, or with min_tokens' bans,
        # never does). Such a row draws from anything and is answered NO_TOKEN: its request
        # ends with an error (Scheduler._append_sampled). Steps without two pay nothing.
        dead = torch.isneginf(logits).all(dim=-1)
        logits = logits.masked_fill(dead[:, None], 0.0)
    if meta.logit_bias:
        logits = _apply_logit_bias(logits, meta.logit_bias)
    if meta.penalties is not None:
        logits = apply_penalties(logits, meta.penalties)
    if meta.all_greedy:
        tokens = kernels.argmax(logits)
    else:
        tokens = _sample_random(logits, meta, uniforms, kernels)
        if meta.any_greedy:
            tokens = torch.where(meta.temperature == 0, kernels.argmax(logits), tokens)
    logprobs = None
    if raw_logprobs is not None:
        logprobs = logprob_tensors(raw_logprobs, tokens, meta.max_num_logprobs)
    if dead is not None:
        tokens = tokens.masked_fill(dead, NO_TOKEN)
    return tokens, logprobs


def _apply_bans(logits: torch.Tensor, banned) -> torch.Tensor:
    if not banned:
        return logits
    # rows below min_tokens only: every (row, token) pair in one indexed write
    pairs = torch.tensor([(row, t) for row, token_ids in banned for t in token_ids],
                         dtype=torch.int64)
    index = to_device(pairs.T.contiguous(), logits.device)  # [2, num_pairs]: rows, tokens
    return logits.index_put((index[0], index[1]), logits.new_full((), float("-inf")))


def _apply_allowed(logits: torch.Tensor, allowed, unbanned: torch.Tensor) -> torch.Tensor:
    """-inf outside each listed row's allowed tokens (other rows unchanged). A row whose
    allowed tokens min_tokens' bans took every one of (``allowed_token_ids=[eos]`` under
    ``min_tokens``) keeps them (``unbanned``: before those bans): the request's own list wins
    over min_tokens rather than a token outside it being drawn. No host sync: a select on
    the device."""
    keep = torch.ones(logits.shape, dtype=torch.bool)
    listed = torch.zeros(logits.shape[0], 1, dtype=torch.bool)
    for row, token_ids in allowed:
        keep[row] = False
        keep[row, list(token_ids)] = True
        listed[row] = True
    keep, listed = to_device(keep, logits.device), to_device(listed, logits.device)
    out = logits.masked_fill(~keep, float("-inf"))
    dead = torch.isneginf(out).all(dim=-1, keepdim=True) & listed
    return torch.where(dead, unbanned.masked_fill(~keep, float("-inf")), out)


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """-inf where the row's bit is clear (tokens past the bitmask's width are masked)."""
    num_rows, vocab_size = logits.shape
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    allowed = ((bitmask[:, :, None] >> shifts) & 1).reshape(num_rows, -1).bool()
    if allowed.shape[1] >= vocab_size:
        allowed = allowed[:, :vocab_size]
    else:
        allowed = torch.nn.functional.pad(allowed, (0, vocab_size - allowed.shape[1]))
    return logits.masked_fill(~allowed, float("-inf"))


def _apply_logit_bias(logits: torch.Tensor, biases) -> torch.Tensor:
    rows, tokens, values = zip(*biases)
    index = (to_device(torch.tensor(rows, dtype=torch.int64), logits.device),
             to_device(torch.tensor(tokens, dtype=torch.int64), logits.device))
    values = to_device(torch.tensor(values, dtype=logits.dtype), logits.device)
    return logits.index_put(index, values, accumulate=True)


def _token_counts(token_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    # token_ids: [num_rows, length] padded with vocab_size -> counts [num_rows, vocab_size]
    counts = torch.zeros(token_ids.shape[0], vocab_size + 1, device=token_ids.device)
    counts.scatter_add_(1, token_ids, torch.ones_like(token_ids, dtype=counts.dtype))
    return counts[:, :vocab_size]


def apply_penalties(logits: torch.Tensor, p: PenaltyInputs) -> torch.Tensor:
    """Repetition (HF/CTRL: over prompt and output), presence and frequency (OpenAI: output)."""
    vocab_size = logits.shape[1]
    output_counts = _token_counts(p.output_token_ids, vocab_size)
    seen = (_token_counts(p.prompt_token_ids, vocab_size) > 0) | (output_counts > 0)
    rep = p.repetition[:, None]
    penalized = torch.where(logits > 0, logits / rep, logits * rep)
    logits = torch.where(seen, penalized, logits)
    logits = logits - p.frequency[:, None] * output_counts
    return logits - p.presence[:, None] * (output_counts > 0).to(logits.dtype)


def _untruncated(meta: SamplingMetadata, vocab_size: int) -> torch.Tensor | None:
    """[num_rows] bool: rows without top-k, top-p or min-p; None when that is every row."""
    if meta.top_k is None and meta.top_p is None and meta.min_p is None:
        return None
    plain = torch.ones_like(meta.temperature, dtype=torch.bool)
    if meta.top_k is not None:
        plain &= meta.top_k >= vocab_size
    if meta.top_p is not None:
        plain &= meta.top_p >= 1
    if meta.min_p is not None:
        plain &= meta.min_p <= 0
    return plain


def _top_p_only(meta: SamplingMetadata, vocab_size: int) -> torch.Tensor | None:
    """[num_rows] bool: rows truncated by top-p alone (no top-k, no min-p); None where the
    batch has no top-p."""
    if meta.top_p is None:
        return None
    rows = meta.top_p < 1
    if meta.top_k is not None:
        rows &= meta.top_k >= vocab_size
    if meta.min_p is not None:
        rows &= meta.min_p <= 0
    return rows


def _sample_random(logits: torch.Tensor, meta: SamplingMetadata, uniforms: torch.Tensor,
                   kernels: SamplingKernels) -> torch.Tensor:
    """The random rows' tokens (greedy rows get an arbitrary id). Untruncated rows take the
    backend's draw where it has one (``SamplingKernels.draw``), rows with top-p alone its top-p
    draw (``draw_top_p``): whether a row does depends on that row's own parameters only, so a
    seeded row's tokens do not depend on the batch. The sampler's tensor ops draw the rest."""
    vocab_size = logits.shape[1]
    plain = _untruncated(meta, vocab_size)
    tokens, covered = None, None  # what the backend's kernels drew, and for which rows
    if kernels.draw is not None:
        temperature = meta.temperature if plain is None else \
            torch.where(plain, meta.temperature, 0.0)  # the kernel skips rows at 0
        drawn = kernels.draw(logits, temperature, uniforms[:, 0])
        if drawn is not None:
            if plain is None:
                return drawn
            tokens, covered = drawn, plain
    nucleus = _top_p_only(meta, vocab_size) if kernels.draw_top_p is not None else None
    if nucleus is not None:
        drawn = kernels.draw_top_p(logits, torch.where(nucleus, meta.temperature, 0.0),
                                   meta.top_p, uniforms, meta.rounds.max_rounds)
        if drawn is not None:
            tokens = drawn if tokens is None else torch.where(nucleus, drawn, tokens)
            covered = nucleus if covered is None else covered | nucleus
    random_rows = meta.temperature > 0
    drawing = random_rows if covered is None else random_rows & ~covered
    # (a backend with a top-p draw runs on the host, where this read costs a branch)
    if nucleus is not None and covered is not None and not bool(drawing.any()):
        return tokens
    temperature = torch.where(random_rows, meta.temperature, 1.0)
    probs = torch.softmax(logits / temperature[:, None], dim=-1, dtype=torch.float32)
    rest = draw_tokens(probs, drawing, uniforms, meta.rounds, top_k=meta.top_k,
                       max_top_k=meta.max_top_k, top_p=meta.top_p, min_p=meta.min_p)
    return rest if tokens is None else torch.where(covered, tokens, rest)


def logprob_tensors(logprobs: torch.Tensor, chosen: torch.Tensor, k: int) -> LogprobTensors:
    """Per row: the chosen token's logprob and rank, then the top-k (on the device)."""
    chosen_lp = logprobs.gather(1, chosen[:, None])  # [num_rows, 1]
    ranks = (logprobs > chosen_lp).sum(dim=-1) + 1
    if k > 0:
        top_lp, top_ids = logprobs.topk(k, dim=-1)
        ids = torch.cat([chosen[:, None], top_ids], dim=1)
        lps = torch.cat([chosen_lp, top_lp], dim=1)
    else:
        ids, lps = chosen[:, None], chosen_lp
    return LogprobTensors(ids, lps, ranks)

