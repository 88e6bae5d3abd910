"""What the model runner returns each step: plain Python data, never tensors."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class SampledLogprobs:
    """Log probabilities at one or more positions.

    For position ``p``: ``token_ids[p][0]`` is the chosen (sampled or prompt) token, followed by
    the top-k tokens; ``logprobs[p]`` matches them; ``ranks[p]`` is the chosen token's 1-based rank.
    """

    token_ids: tuple[tuple[int, ...], ...]
    logprobs: tuple[tuple[float, ...], ...]
    ranks: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class ModelRunnerOutput:
    """Per request id: tokens sampled this step (empty mid-prefill) and optional logprobs."""

    sampled_token_ids: Mapping[str, tuple[int, ...]]
    logprobs: Mapping[str, SampledLogprobs]
    prompt_logprobs: Mapping[str, SampledLogprobs]
