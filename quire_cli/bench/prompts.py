"""Synthetic prompts shared by the offline benchmarks."""

from __future__ import annotations

import random

FIRST_PLAIN_TOKEN_ID = 100  # SmolLM2's special and control tokens all sit below this id


def random_prompt(rng: random.Random, num_tokens: int, vocab_size: int) -> list[int]:
    """Token ids drawn uniformly from the plain (non-special) vocabulary."""
    return [rng.randrange(FIRST_PLAIN_TOKEN_ID, vocab_size) for _ in range(num_tokens)]
