"""How fast each engine is, as the router sees it: the two rates its placement estimate needs,
measured from the requests the router itself relays (no engine reports them, and what it
observes already includes the engine's batch mix, its hardware and its queue discipline).

- **Prefill rate** (tokens/s): the uncached prompt tokens of the requests whose first token
  came back, over the time the engine was busy with them (``PrefillClock``: busy while any
  request the router sent there waits for its first token), less one decode step per sample
  (the step that gives the token). Throughput over busy time does not depend on the order
  the engine works in: an engine that batches a later arrival into the step of an earlier
  request (every prefill of the step gives its first token at the step's end) makes the
  earlier one slow, but not the engine's rate; a per-request sample ("W tokens of work were
  ahead of it, it took T") would read such a step as a slow engine.
- **Decode step** (s/token of one stream): the time between a stream's first message and its
  last, over the tokens that came after the first: what one more step costs on that engine
  now (it grows with the number of sequences the engine runs).
- **Request time** (s/request): from sending a request to its last message: how long a
  request holds what it uses there (a LoRA adapter's step slot, say).

Each is a ratio of decayed sums (every new sample multiplies the old sums by ``DECAY``), so a
long sample weighs more than a short one and the estimate follows a change of load within a
few dozen requests. Before any sample the prefill rate is the configured prior
(``--prefill-tokens-per-s``), weighted as ``PRIOR_S`` seconds of observation; the pool prefers
the engine's measured peers to that prior.

Work still waiting for its first token is evidence too, before it completes: an engine busy
for ``e`` seconds (since its queue last emptied) that has answered ``C`` tokens of it and not
yet the ``P`` tokens pending would have done all ``C + P`` at any rate above
``(C + P) / e``, whatever its order (``PrefillClock.bound``). So an engine that has slowed
down (or a fresh one that is slower than the prior) stops drawing requests while its first
slow prefill is still running, not only after it.

With several router replicas, each measures the share of an engine's time its own requests
get: every engine's rate reads lower by about that share, alike, so the comparison between
engines holds.
"""

from __future__ import annotations

from collections.abc import Sequence
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
class PrefillClock:
    """One engine's prefill work as the router sees it: busy while any request it sent there
    waits for its first token."""

    num_pending: int = 0  # requests sent that have not given a first token
    pending_tokens: int = 0  # their uncached prompt tokens
    last_s: float = 0.0  # the last event
    busy_s: float = 0.0  # busy time not yet taken by a sample
    period_start_s: float = 0.0  # when the engine last became busy
    period_done_tokens: int = 0  # tokens answered since then

    def _advance(self, now_s: float) -> None:
        if self.num_pending > 0:
            self.busy_s += max(now_s - self.last_s, 0.0)
        self.last_s = now_s

    def sent(self, now_s: float, num_tokens: int) -> None:
        """A request with ``num_tokens`` uncached prompt tokens was sent."""
        self._advance(now_s)
        if self.num_pending == 0:
            self.period_start_s = now_s
            self.period_done_tokens = 0
        self.num_pending += 1
        self.pending_tokens += num_tokens

    def answered(self, now_s: float, num_tokens: int) -> float:
        """A request's first token came: the busy seconds since the last answer, its sample's
        time (zero for each further request answered by the same step)."""
        self._advance(now_s)
        busy_s, self.busy_s = self.busy_s, 0.0
        self._remove(num_tokens)
        self.period_done_tokens += num_tokens
        return busy_s

    def dropped(self, now_s: float, num_tokens: int) -> None:
        """A request ended before its first token (cancelled, failed)."""
        self._advance(now_s)
        self._remove(num_tokens)

    def _remove(self, num_tokens: int) -> None:
        self.num_pending = max(self.num_pending - 1, 0)
        self.pending_tokens = max(self.pending_tokens - num_tokens, 0)
        if self.num_pending == 0:
            self.busy_s = 0.0  # the rest of a busy period ended by drops measures nothing

    def bound(self, now_s: float) -> float | None:
        """The highest prefill rate consistent with the work still pending (None: nothing
        pending, or no time passed): at any higher rate it would all be done by now."""
        elapsed_s = now_s - self.period_start_s
        if self.num_pending == 0 or elapsed_s <= 0 or self.pending_tokens <= 0:
            return None
        return (self.period_done_tokens + self.pending_tokens) / elapsed_s


@dataclass(slots=True)
class EngineRates:
    """One engine's measured prefill rate and decode step; only the pool writes it."""

    prefill: DecayedRatio  # tokens / seconds
    decode: DecayedRatio  # seconds / tokens (one stream's)
    observed: bool = False  # a prefill sample was taken (False: the rate is the prior)
    request: DecayedRatio = field(default_factory=DecayedRatio)  # seconds / requests
    clock: PrefillClock = field(default_factory=PrefillClock)

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

    @property
    def pending_tokens(self) -> int:
        """Uncached prompt tokens sent there that have not given a first token yet."""
        return self.clock.pending_tokens

    def sent(self, now_s: float, num_tokens: int) -> None:
        """A request with ``num_tokens`` uncached prompt tokens was sent there."""
        self.clock.sent(now_s, num_tokens)

    def first_token(self, now_s: float, num_tokens: int) -> None:
        """The first token of a request sent with ``num_tokens`` uncached tokens came."""
        self.observe_prefill(num_tokens, self.clock.answered(now_s, num_tokens))

    def dropped(self, now_s: float, num_tokens: int) -> None:
        """A request sent there ended without a first token."""
        self.clock.dropped(now_s, num_tokens)

    def observe_prefill(self, num_tokens: int, busy_s: float) -> None:
        """``num_tokens`` were answered after ``busy_s`` more seconds of busy time, the step
        that gave the first token included (that step is taken off: it is decode)."""
        if num_tokens > 0 and busy_s >= 0:
            self.prefill.observe(num_tokens, max(busy_s - self.decode_step_s, 0.0))
            self.observed = True

    def observe_decode(self, num_tokens: int, elapsed_s: float) -> None:
        """A stream gave ``num_tokens`` more tokens in ``elapsed_s`` after its first."""
        if num_tokens > 0 and elapsed_s >= 0:
            self.decode.observe(elapsed_s, num_tokens)

    def bounded_prefill_rate(self, rate: float, now_s: float) -> float:
        """``rate``, lowered to what the work still pending there allows."""
        bound = self.clock.bound(now_s)
        return rate if bound is None else min(rate, bound)


def prefill_rate(rates: EngineRates, peers: Sequence[EngineRates], now_s: float) -> float:
    """An engine's prefill rate as far as the router can tell: measured, where it has taken a
    sample; else its measured peers' mean (engines of one pool are alike: a peer measured slow
    says more about this one than the configured prior does), bounded by its own pending work.
    A peer's pending work is not evidence here: it says how loaded that peer is, not how fast
    this one would be (an idle engine next to a queue is exactly where a request should go)."""
    if rates.observed:
        return rates.bounded_prefill_rate(rates.prefill_tokens_per_s, now_s)
    found = [peer.prefill_tokens_per_s for peer in peers if peer.observed]
    rate = sum(found) / len(found) if found else rates.prefill_tokens_per_s
    return rates.bounded_prefill_rate(rate, now_s)
