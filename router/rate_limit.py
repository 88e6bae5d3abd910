"""Per-tenant rate limits: requests and tokens a minute, each a token bucket.

A bucket holds at most one minute's allowance and refills continuously, so a tenant may burst
up to its per-minute limit and then runs at the limit. A request takes one from the request
bucket and its prompt tokens from the token bucket when it is admitted; its generated tokens
are taken when they are known (the bucket may go below zero: the next requests wait for it).
A request the buckets cannot cover is refused at once with the time until they could.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class TokenBucket:
    """``per_minute`` units a minute, at most ``per_minute`` banked."""

    per_minute: float
    level: float
    updated_s: float

    @classmethod
    def full(cls, per_minute: float, now_s: float) -> TokenBucket:
        return cls(per_minute, per_minute, now_s)

    def refill(self, now_s: float) -> None:
        elapsed = max(now_s - self.updated_s, 0.0)
        self.level = min(self.per_minute, self.level + elapsed * self.per_minute / 60.0)
        self.updated_s = now_s

    def wait_s(self, amount: float, now_s: float) -> float:
        """Seconds until ``amount`` can be taken (0: now). Amounts above a minute's allowance
        need only a full bucket: otherwise such a request could never run."""
        self.refill(now_s)
        need = min(amount, self.per_minute) - self.level
        return 0.0 if need <= 0 else need * 60.0 / self.per_minute

    def take(self, amount: float, now_s: float) -> None:
        self.refill(now_s)
        self.level -= amount


@dataclass(slots=True)
class TenantLimits:
    """A tenant's two buckets (None: that rate is not limited)."""

    requests: TokenBucket | None
    tokens: TokenBucket | None

    @classmethod
    def of(cls, requests_per_minute: float, tokens_per_minute: float,
           now_s: float) -> TenantLimits:
        return cls(TokenBucket.full(requests_per_minute, now_s) if requests_per_minute else None,
                   TokenBucket.full(tokens_per_minute, now_s) if tokens_per_minute else None)

    def wait_s(self, num_tokens: int, now_s: float) -> tuple[float, str]:
        """(seconds until a request of ``num_tokens`` prompt tokens fits, the limit that
        binds: "requests_per_minute" / "tokens_per_minute", "" when it fits now)."""
        waits = [(0.0, "")]
        if self.requests is not None:
            waits.append((self.requests.wait_s(1, now_s), "requests_per_minute"))
        if self.tokens is not None:
            waits.append((self.tokens.wait_s(num_tokens, now_s), "tokens_per_minute"))
        return max(waits)

    def take(self, num_requests: int, num_tokens: int, now_s: float) -> None:
        if self.requests is not None and num_requests:
            self.requests.take(num_requests, now_s)
        if self.tokens is not None and num_tokens:
            self.tokens.take(num_tokens, now_s)

    def idle(self, now_s: float) -> bool:
        """Both buckets full again: forgetting them changes nothing."""
        for bucket in (self.requests, self.tokens):
            if bucket is not None:
                bucket.refill(now_s)
                if bucket.level < bucket.per_minute:
                    return False
        return True
