"""The proposer registry: ``speculative_config.method`` -> the proposer it builds."""

from __future__ import annotations

from collections.abc import Callable

from engine_worker.spec_decode.config import SpeculativeConfig
from engine_worker.spec_decode.ngram import NgramProposer
from engine_worker.spec_decode.speculator import STEP_TOKEN_LIMITS, Proposer, Speculator
from engine_worker.spec_decode.suffix import SuffixProposer


def _ngram(config: SpeculativeConfig) -> Proposer:
    return NgramProposer(config.prompt_lookup_max, config.prompt_lookup_min)


def _suffix(config: SpeculativeConfig) -> Proposer:
    return SuffixProposer(max_depth=config.suffix_decoding_max_tree_depth,
                          max_outputs=config.suffix_decoding_max_cached_requests)


PROPOSERS: dict[str, Callable[[SpeculativeConfig], Proposer]] = {
    "ngram": _ngram,
    "suffix": _suffix,
}


def build_speculator(config: SpeculativeConfig | None, device_type: str = "cpu"
                     ) -> Speculator | None:
    """The scheduler's speculator for ``config`` (None when speculation is off), with the
    step token limit of ``device_type`` (see ``speculator``)."""
    if config is None:
        return None
    make = PROPOSERS.get(config.method)
    if make is None:
        raise ValueError(f"speculative_config.method: {config.method!r} is not available in "
                         f"this build (available: {sorted(PROPOSERS)})")
    limit = STEP_TOKEN_LIMITS.get(device_type, STEP_TOKEN_LIMITS["cpu"])
    return Speculator(config, make(config), step_token_limit=limit)
