"""Exact acceptance of draft tokens: the output is distributed as the target model's.

Standard speculative sampling (Leviathan et al., Chen et al.) verifies draft token ``x`` drawn
from ``q`` at a position where the target distribution is ``p``: accept with probability
``min(1, p(x) / q(x))``; on rejection emit a token from the normalised residual
``(p - q)+``, and stop there; when every draft is accepted, emit a bonus token from the
target's distribution after the last draft.

The ngram and suffix methods propose deterministically: ``q`` is a point mass on ``x``. Then
``min(1, p(x) / q(x)) = p(x)`` and ``(p - q)+`` is ``p`` with ``x`` removed, so the rule is
exactly: *draw ``y`` from ``p``; accept ``x`` if ``y == x``, otherwise emit ``y``.*
(``P(accept) = p(x)``; given a rejection, ``y`` is distributed as ``p`` restricted to the other
tokens, which is the normalised residual.) So the runner samples every verified position with
the ordinary sampler, every sampling parameter applied to ``p`` as without speculation
(temperature, top-k / top-p / min-p, penalties and min_tokens over the tokens before that
position, drafts included), and this module only compares. A greedy row's ``p`` is the point
mass on its argmax, which makes the rule "the longest matching prefix, then the target's
token".
"""

from __future__ import annotations

from collections.abc import Sequence


def num_accepted(draft_token_ids: Sequence[int], target_token_ids: Sequence[int]) -> int:
    """How many leading drafts the target's samples accept (``target_token_ids`` has one
    sample per verified position: ``len(draft_token_ids) + 1``)."""
    assert len(target_token_ids) == len(draft_token_ids) + 1
    for i, (draft, target) in enumerate(zip(draft_token_ids, target_token_ids)):
        if draft != target:
            return i
    return len(draft_token_ids)


def accepted_tokens(draft_token_ids: Sequence[int], target_token_ids: Sequence[int]
                    ) -> tuple[int, ...]:
    """The tokens the step emits: the accepted drafts, then the target's token at the first
    rejected position (or the bonus token after the last draft)."""
    return tuple(target_token_ids[:num_accepted(draft_token_ids, target_token_ids) + 1])
