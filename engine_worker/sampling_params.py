"""Per-request sampling parameters, in vLLM's shape. Bad values raise ValueError naming the field."""

from __future__ import annotations

from quire.errors import FieldError
import enum
import math
from dataclasses import dataclass, field, replace

from quire.limits import check_n

_GREEDY_EPS = 1e-5


class RequestOutputKind(enum.Enum):
    """What each streamed RequestOutput carries."""

    CUMULATIVE = 0  # everything generated so far
    DELTA = 1  # only what is new since the last output
    FINAL_ONLY = 2  # nothing until the request finishes


def _fail(name: str, message: str) -> None:
    raise FieldError(name, f"{message}")


@dataclass(slots=True)
class SamplingParams:
    """How to sample one request's completion(s).

    ``temperature=0`` is greedy. ``seed`` gives the request its own random stream, so its output
    does not depend on what else is batched with it. Stop strings are left out of the text.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    detokenize: bool = True
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.top_k = -1 if self.top_k in (0, None) else self.top_k
        self._validate()

    def _validate(self) -> None:
        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                     "frequency_penalty"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) \
                    or not math.isfinite(value):
                _fail(name, f"must be a finite number, got {value!r}")
        for name in ("n", "top_k", "min_tokens", "max_tokens", "seed", "logprobs",
                     "prompt_logprobs"):
            if isinstance(getattr(self, name), bool):
                _fail(name, f"must be an integer, got {getattr(self, name)!r}")
        check_n(self.n)
        if self.temperature is None or self.temperature < 0:
            _fail("temperature", f"must be non-negative, got {self.temperature!r}")
        if not 0.0 < self.top_p <= 1.0:
            _fail("top_p", f"must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or (self.top_k < 1 and self.top_k != -1):
            _fail("top_k", f"must be -1, 0 (disable) or at least 1, got {self.top_k!r}")
        if not 0.0 <= self.min_p <= 1.0:
            _fail("min_p", f"must be in [0, 1], got {self.min_p!r}")
        if self.repetition_penalty <= 0.0:
            _fail("repetition_penalty", f"must be positive, got {self.repetition_penalty!r}")
        if not -2.0 <= self.presence_penalty <= 2.0:
            _fail("presence_penalty", f"must be in [-2, 2], got {self.presence_penalty!r}")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            _fail("frequency_penalty", f"must be in [-2, 2], got {self.frequency_penalty!r}")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int)
                                            or self.max_tokens < 1):
            _fail("max_tokens", f"must be at least 1, got {self.max_tokens!r}")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            _fail("min_tokens", f"must be non-negative, got {self.min_tokens!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            _fail("min_tokens", f"must not exceed max_tokens={self.max_tokens}, "
                                f"got {self.min_tokens}")
        if self.seed is not None and (not isinstance(self.seed, int)
                                      or not 0 <= self.seed < 2**63):
            _fail("seed", f"must be an integer in [0, 2**63), got {self.seed!r}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 0):
                _fail(name, f"must be a non-negative integer, got {value!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            _fail("stop", "every stop string must be a non-empty string")
        if self.stop and not self.detokenize:
            _fail("stop", "stop strings need detokenize=True")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            _fail("stop_token_ids", "every stop token id must be a non-negative integer")

    @property
    def is_greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @property
    def uses_penalties(self) -> bool:
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0)

    def clone(self, **changes) -> SamplingParams:
        return replace(self, stop=list(self.stop), stop_token_ids=list(self.stop_token_ids),
                       **changes)
