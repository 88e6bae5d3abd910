"""How many requests to run at once so that one more still buys throughput: a gradient
concurrency limit (the idea of Netflix's concurrency-limits ``Gradient2``) on the time per
output token (after the first) of finished requests.

An engine's batch limit (``router.engine_slots``) says how many requests it *can* run together,
not how many it runs *well*: where batching is nearly free (a GPU) the time per token barely
grows with the batch, but where the engine is compute-bound (a CPU) it grows with every request
added, so running more only makes every request slower. The limit follows the ratio of the
fastest per-token time seen (the engines' speed with room to spare) to the recent one:

    g = clamp(2 * fastest / recent, 1/2, 1)
    limit <- (1 - s) * limit + s * (limit * g + (sqrt(limit) if g == 1 else 0))

With a per-token time within twice the fastest the limit grows by about its square root per
request, as Gradient2's allowance (up to the engines' slots); beyond that it shrinks, so on a
compute-bound engine it settles where each request runs at about half the speed it gets alone
(a latency bound; such an engine gains little throughput from more anyway). ``s`` (0.2)
smooths; the tolerance (2) keeps noise in the per-token time from shrinking the limit
(Gradient2 uses 1.5 on round trips). Unlike Gradient2 the allowance is given only while the
per-token time is within the tolerance, so a slowed pool shrinks to one request per engine
rather than to a floor of its own making.
"""

from __future__ import annotations

import math

_SMOOTHING = 0.2
_RECENT_EWMA = 0.2  # weight of the newest request in the recent per-token time
_MIN_GRADIENT = 0.5  # one request's noise must not halve the limit at once
_TOLERANCE = 2.0  # per-token time may grow this much over the fastest before the limit shrinks


class GradientLimit:
    def __init__(self, initial: float) -> None:
        self.limit = float(initial)
        self.fastest_s: float | None = None  # per-token time with room to spare
        self.recent_s: float | None = None

    def observe(self, per_token_s: float, ceiling: int, floor: int = 1) -> None:
        """A request finished at ``per_token_s`` seconds a generated token; ``ceiling``: the
        engines' slots now; ``floor``: the fewest to allow (one per engine, so none idles)."""
        if per_token_s <= 0:
            return
        self.fastest_s = per_token_s if self.fastest_s is None else min(self.fastest_s,
                                                                        per_token_s)
        self.recent_s = per_token_s if self.recent_s is None else \
            self.recent_s + _RECENT_EWMA * (per_token_s - self.recent_s)
        gradient = min(1.0, max(_MIN_GRADIENT, _TOLERANCE * self.fastest_s / self.recent_s))
        wanted = self.limit * gradient + (math.sqrt(self.limit) if gradient >= 1.0 else 0.0)
        self.limit = min((1 - _SMOOTHING) * self.limit + _SMOOTHING * wanted, float(ceiling))
        self.limit = max(self.limit, float(floor), 1.0)

    def value(self, ceiling: int, floor: int = 1) -> int:
        return max(1, floor, min(int(self.limit), ceiling))
