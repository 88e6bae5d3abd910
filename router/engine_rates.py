"""How fast each engine is, as the router sees it: the two rates its placement estimate needs,
measured from the requests the router itself relays (no engine reports them, and what it
observes already includes the engine's batch mix, its hardware and its queue discipline).

- **Prefill rate** (tokens/s): a request placed with ``W`` tokens of work ahead of it (the
  engine's reported queue plus the router's own in-flight prefill) and ``U`` uncached prompt
  tokens gave its first token after ``T`` seconds; one decode step of that is the token itself,
  the rest is prefill: a sample of ``(W + U)`` tokens in ``T - step`` seconds.
- **Decode step** (s/token of one stream): the time between a stream's first message and its
  last, over the tokens that came after the first: what one more step costs on that engine
  now (it grows with the number of sequences the engine runs).

Both are ratios of decayed sums (every new sample multiplies the old sums by ``DECAY``), so a
long sample weighs more than a short one and the estimate follows a change of load within a
few dozen requests. Before any sample the prefill rate is the configured prior
(``--prefill-tokens-per-s``), weighted as ``PRIOR_S`` seconds of observation.
"""

from __future__ import annotations

from dataclasses import dataclass

# Each sample multiplies the older ones' weight by this: the last ~16 requests dominate. On
# the engines measured here a load change (a burst starting or ending) turns over that many
# requests in a second or two, so the estimate follows it without jumping on one odd request.
DECAY = 1.0 - 1.0 / 16
# The configured prefill rate counts as this much observed time: one real prefill of a few
# hundred tokens (tenths of a second on a CPU) already outweighs it.
PRIOR_S = 0.05


@dataclass(slots=True)
class DecayedRatio:
    """sum(numerators) / sum(denominators), each sum decayed by ``DECAY`` per sample."""

    numerator: float = 0.0
    denominator: float = 0.0

    def observe(self, numerator: float, denominator: float) -> None:
        self.numerator = self.numerator * DECAY + numerator
        self.denominator = self.denominator * DECAY + denominator

    def value(self, default: float) -> float:
        return self.numerator / self.denominator if self.denominator > 0 else default


@dataclass(slots=True)
class EngineRates:
    """One engine's measured prefill rate and decode step; only the pool writes it."""

    prefill: DecayedRatio  # tokens / seconds
    decode: DecayedRatio  # seconds / tokens (one stream's)

    @classmethod
    def with_prior(cls, prefill_tokens_per_s: float) -> EngineRates:
        if prefill_tokens_per_s <= 0:
            raise ValueError(f"prefill_tokens_per_s must be > 0, got {prefill_tokens_per_s}")
        return cls(DecayedRatio(prefill_tokens_per_s * PRIOR_S, PRIOR_S), DecayedRatio())

    @property
    def prefill_tokens_per_s(self) -> float:
        return self.prefill.value(0.0)

    @property
    def decode_step_s(self) -> float:
        return self.decode.value(0.0)

    def observe_first_token(self, num_tokens: int, ttft_s: float) -> None:
        """``num_tokens`` (work ahead + the request's uncached prompt) were done ``ttft_s``
        after the request was sent, one decode step included."""
        if num_tokens > 0 and ttft_s > 0:
            self.prefill.observe(num_tokens, max(ttft_s - self.decode_step_s, 0.0))

    def observe_decode(self, num_tokens: int, elapsed_s: float) -> None:
        """A stream gave ``num_tokens`` more tokens in ``elapsed_s`` after its first."""
        if num_tokens > 0 and elapsed_s >= 0:
            self.decode.observe(elapsed_s, num_tokens)
