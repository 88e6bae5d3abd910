"""Per-request sampling parameters, in vLLM's shape. Bad values raise ValueError naming the field."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field, replace

from quire.errors import FieldError
from quire.limits import SAMPLING_RANGES, check_min_tokens, check_n, check_sampling

_GREEDY_EPS = 1e-5
_OPTIONAL = frozenset({"max_tokens", "seed", "logprobs", "prompt_logprobs"})  # None: not set


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
        # the ranges are quire.limits' (the router's HTTP front checks the same ones)
        check_n(self.n)
        for name in SAMPLING_RANGES:
            value = getattr(self, name)
            if value is not None or name not in _OPTIONAL:
                check_sampling(name, value)
        check_min_tokens(self.min_tokens, self.max_tokens)
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
