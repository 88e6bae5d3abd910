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
- **Request time** (s/request): from sending a request to its last message: how long a
  request holds what it uses there (a LoRA adapter's step slot, say).

Both are ratios of decayed sums (every new sample multiplies the old sums by ``DECAY``), so a
long sample weighs more than a short one and the estimate follows a change of load within a
few dozen requests. Before any sample the prefill rate is the configured prior
(``--prefill-tokens-per-s``), weighted as ``PRIOR_S`` seconds of observation; the pool prefers
the engine's measured peers to that prior.

A request still waiting for its first token is evidence too, before it completes: ``W``
tokens not done after ``e`` seconds bound the rate by ``W / e`` (``bounded_prefill_rate``). So
an engine that has slowed down (or a fresh one that is slower than the prior) stops drawing
requests while its first slow prefill is still running, not only after it.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass, field

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
    observed: bool = False  # a prefill sample was taken (False: the rate is the prior)
    request: DecayedRatio = field(default_factory=DecayedRatio)  # seconds / requests

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

    @property
    def request_s(self) -> float:
        """Mean time a request stays on the engine (0: none finished yet)."""
        return self.request.value(0.0)

    def observe_request(self, elapsed_s: float) -> None:
        """A request ended ``elapsed_s`` after it was sent."""
        if elapsed_s > 0:
            self.request.observe(elapsed_s, 1)

    def observe_first_token(self, num_tokens: int, ttft_s: float) -> None:
        """``num_tokens`` (work ahead + the request's uncached prompt) were done ``ttft_s``
        after the request was sent, one decode step included."""
        if num_tokens > 0 and ttft_s > 0:
            self.prefill.observe(num_tokens, max(ttft_s - self.decode_step_s, 0.0))
            self.observed = True

    def observe_decode(self, num_tokens: int, elapsed_s: float) -> None:
        """A stream gave ``num_tokens`` more tokens in ``elapsed_s`` after its first."""
        if num_tokens > 0 and elapsed_s >= 0:
            self.decode.observe(elapsed_s, num_tokens)


def bounded_prefill_rate(rate: float, waiting: Iterable[tuple[float, int]],
                         now_s: float) -> float:
    """``rate``, lowered to what the requests still waiting for their first token allow:
    each ``(sent_s, num_tokens)`` has not done its ``num_tokens`` (work ahead + its own
    prefill) in ``now_s - sent_s`` seconds."""
    for sent_s, num_tokens in waiting:
        elapsed_s = now_s - sent_s
        if elapsed_s > 0 and num_tokens > 0:
            rate = min(rate, num_tokens / elapsed_s)
    return rate


Waiting = Collection[tuple[float, int]]  # (sent_s, num_tokens) of requests without a first token


def _evidence(rates: EngineRates, waiting: Waiting, now_s: float) -> float | None:
    """What an engine's own requests say of its prefill rate: measured, bounded by those
    still waiting (None: nothing yet, only the configured prior)."""
    prior = rates.prefill_tokens_per_s
    rate = bounded_prefill_rate(prior, waiting, now_s)
    return rate if rates.observed or rate < prior else None


def prefill_rate(rates: EngineRates, waiting: Waiting,
                 peers: Sequence[tuple[EngineRates, Waiting]], now_s: float) -> float:
    """An engine's prefill rate as far as the router can tell: measured, where it has taken a
    sample; else its peers' mean (engines of one pool are alike: a peer found slow says more
    about this one than the configured prior does), bounded by its own waiting requests."""
    if rates.observed:
        return bounded_prefill_rate(rates.prefill_tokens_per_s, waiting, now_s)
    found = [rate for peer in peers if (rate := _evidence(*peer, now_s)) is not None]
    rate = sum(found) / len(found) if found else rates.prefill_tokens_per_s
    return bounded_prefill_rate(rate, waiting, now_s)
