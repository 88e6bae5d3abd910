"""Running totals of speculative decoding, as vLLM's ``vllm:spec_decode_*`` metrics count them."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class SpecDecodingStats:
    """Totals since start. A *draft* is one request's proposal verified in one step;
    ``num_accepted_tokens_per_pos[i]``: drafts whose token at position i was accepted."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: tuple[int, ...] = ()

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens a verifying step yields per request on average (accepted drafts + 1)."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0


class SpecDecodingCounter:
    """The mutable counter behind ``SpecDecodingStats``; owned by the speculator alone."""

    def __init__(self, num_positions: int) -> None:
        self.num_drafts = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.per_pos = [0] * num_positions

    def record(self, num_draft_tokens: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        for pos in range(num_accepted):
            self.per_pos[pos] += 1

    def snapshot(self) -> SpecDecodingStats:
        return SpecDecodingStats(self.num_drafts, self.num_draft_tokens,
                                 self.num_accepted_tokens, tuple(self.per_pos))
