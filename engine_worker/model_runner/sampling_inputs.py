"""Turn the rows to sample into the sampler's batched tensors.

Built on the host, then each moved with ``platform.to_device`` (queued copies from pinned
memory on a GPU), so building a step's metadata never waits on the kernels before it.
"""

from __future__ import annotations

import numpy as np
import torch

from engine_worker.platform import to_device
from engine_worker.sampler import PenaltyInputs, SamplingMetadata
from engine_worker.sampling_draw import pivot_rounds_for


def _padded(rows: list[list[int]], pad: int, device: torch.device) -> torch.Tensor:
    width = max((len(r) for r in rows), default=0) or 1
    out = torch.full((len(rows), width), pad, dtype=torch.int64)
    for i, r in enumerate(rows):
        if r:
            out[i, :len(r)] = torch.tensor(r, dtype=torch.int64)
    return to_device(out, device)


def _column(values: list, device: torch.device, dtype: torch.dtype | None = None
            ) -> torch.Tensor:
    return to_device(torch.tensor(values, dtype=dtype), device)


def _bad_word_bans(words, token_ids, num_prompt_tokens: int) -> tuple[int, ...]:
    """The last tokens of the bad words whose other tokens are the latest generated ones (the
    prompt's never count, as vLLM's ``apply_bad_words`` reads only the output; the words'
    ids were checked against the vocabulary on arrival)."""
    num_generated = len(token_ids) - num_prompt_tokens
    out = set()
    for word in words:
        head = len(word) - 1
        if head > num_generated:
            continue
        if head == 0 or tuple(token_ids[len(token_ids) - head:]) == word[:-1]:
            out.add(word[-1])
    return tuple(sorted(out))


def changes_with_tokens(state) -> bool:
    """Whether a row's sampling metadata may differ from one step to the next as its tokens
    grow: penalties (counts of the tokens), bad words (the latest tokens) and a min_tokens
    ban not yet lifted. Everything else in it is fixed by the request's parameters."""
    p = state.params
    return p.uses_penalties or bool(p.bad_words_token_ids) or \
        len(state.token_ids) - state.num_prompt_tokens < p.min_tokens


def build_sampling_metadata(states, vocab_size: int, eos_token_ids: frozenset[int],
                            device: torch.device, token_bitmask: np.ndarray | None = None
                            ) -> SamplingMetadata:
    """``states`` are runner request states (token_ids, num_prompt_tokens, params, generator);
    ``token_bitmask`` (int32 [num_rows, words]) the grammars' allowed tokens, row by row."""
    params = [s.params for s in states]
    temperature = _column([0.0 if p.is_greedy else p.temperature for p in params], device,
                          torch.float32)
    all_greedy = all(p.is_greedy for p in params)
    top_k = top_p = min_p = None
    # k >= vocab_size keeps every token, as top-k off does
    ks = [p.top_k if 0 < p.top_k < vocab_size else vocab_size for p in params]
    max_top_k = max((k for k in ks if k < vocab_size), default=0)
    if max_top_k:
        top_k = _column(ks, device)
    if any(p.top_p < 1.0 for p in params):
        top_p = _column([p.top_p for p in params], device, torch.float32)
    if any(p.min_p > 0.0 for p in params):
        min_p = _column([p.min_p for p in params], device, torch.float32)
    penalties = None
    if any(p.uses_penalties for p in params):
        penalties = PenaltyInputs(
            prompt_token_ids=_padded([s.token_ids[:s.num_prompt_tokens] for s in states],
                                     vocab_size, device),
            output_token_ids=_padded([s.token_ids[s.num_prompt_tokens:] for s in states],
                                     vocab_size, device),
            repetition=_column([p.repetition_penalty for p in params], device),
            presence=_column([p.presence_penalty for p in params], device),
            frequency=_column([p.frequency_penalty for p in params], device))
    banned, bad_words = [], []
    for row, state in enumerate(states):
        p = state.params
        # a grammar decides when its output may end: min_tokens does not ban its stop tokens
        if p.structured_outputs is None and \
                len(state.token_ids) - state.num_prompt_tokens < p.min_tokens:
            stop_ids = set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos_token_ids))
            stop_ids = tuple(t for t in stop_ids if t < vocab_size)
            if stop_ids:
                banned.append((row, stop_ids))
        if p.bad_words_token_ids:
            words = _bad_word_bans(p.bad_words_token_ids, state.token_ids,
                                   state.num_prompt_tokens)
            if words:
                bad_words.append((row, words))
    # (their ids were checked against the vocabulary on arrival: no filtering each step)
    allowed = tuple((row, p.allowed_token_ids) for row, p in enumerate(params)
                    if p.allowed_token_ids is not None)
    biases = tuple((row, token_id, bias) for row, p in enumerate(params) if p.logit_bias
                   for token_id, bias in p.logit_bias.items() if token_id < vocab_size)
    logprob_ks = [p.logprobs for p in params if p.logprobs is not None]
    return SamplingMetadata(
        temperature=temperature, all_greedy=all_greedy,
        any_greedy=any(p.is_greedy for p in params), top_k=top_k, max_top_k=max_top_k,
        top_p=top_p, min_p=min_p,
        generators={i: s.generator for i, s in enumerate(states)
                    if s.generator is not None and not s.params.is_greedy},
        penalties=penalties, banned=tuple(banned),
        token_bitmask=None if token_bitmask is None else to_device(
            torch.from_numpy(token_bitmask), device),
        logit_bias=biases, allowed=allowed, bad_words=tuple(bad_words),
        max_num_logprobs=max(logprob_ks) if logprob_ks else None,
        rounds=pivot_rounds_for(device))
