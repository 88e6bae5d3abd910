"""Per-request sampling parameters, in vLLM's shape. Bad values raise ValueError naming the field."""

from __future__ import annotations

import enum
import json as json_module
from dataclasses import dataclass, field, replace

from quire.errors import FieldError
from quire.limits import SAMPLING_RANGES, check_min_tokens, check_n, check_sampling
from quire.list_limits import check_allowed_token_ids, check_bad_words
from quire.structured_outputs import (STRUCTURED_OUTPUT_KINDS, STRUCTURED_OUTPUT_OPTIONS,
                                      check_logit_bias, structured_outputs_kind)

_GREEDY_EPS = 1e-5
_OPTIONAL = frozenset({"max_tokens", "seed", "logprobs", "prompt_logprobs"})  # None: not set


class RequestOutputKind(enum.Enum):
    """What each streamed RequestOutput carries."""

    CUMULATIVE = 0  # everything generated so far
    DELTA = 1  # only what is new since the last output
    FINAL_ONLY = 2  # nothing until the request finishes


def _fail(name: str, message: str) -> None:
    raise FieldError(name, f"{message}")


def bad_words_token_ids(words, encode) -> tuple[tuple[int, ...], ...]:
    """The token sequences ``words`` ban, as vLLM derives them
    (``SamplingParams.update_from_tokenizer``): each word with leading spaces stripped, and
    the same after one space, kept where that gives a different first token and as many
    tokens (so a word is banned at the start of the text and inside it). ``encode(text)``:
    token ids without special tokens."""
    out: list[tuple[int, ...]] = []
    for word in words:
        bare = tuple(encode(word.lstrip()))
        if not bare:  # nothing the model could generate
            continue
        out.append(bare)
        spaced = tuple(encode(" " + word.lstrip()))
        if spaced and spaced[0] != bare[0] and len(spaced) == len(bare):
            out.append(spaced)
    return tuple(out)


@dataclass(frozen=True, slots=True)
class StructuredOutputsParams:
    """Constrain a completion to a grammar, as vLLM's ``StructuredOutputsParams``: exactly one
    of ``json`` (a JSON schema, as a dict or its JSON text), ``regex``, ``choice`` (the output
    is one of these strings), ``grammar`` (EBNF, xgrammar's dialect of GBNF),
    ``json_object=True`` (any JSON object) or ``structural_tag``. The completion ends when the
    grammar does."""

    json: dict | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    # vLLM's structural tag: JSON text (or its object) of {"type": "structural_tag",
    # "format": ...} or {"structures": [{"begin", "schema", "end"}], "triggers": [...]}
    structural_tag: str | dict | None = None
    # vLLM's options: accepted and checked, no effect here (JSON is always compact and strict;
    # see quire.structured_outputs.STRUCTURED_OUTPUT_OPTIONS)
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None
    disable_fallback: bool = False  # older vLLM releases' (one grammar engine here: none)

    def __post_init__(self) -> None:
        self.spec()  # FieldError naming structured_outputs.<kind> if malformed

    def spec(self) -> tuple[str, str]:
        """(kind, canonical text): the key compiled grammars are cached under."""
        fields = (*STRUCTURED_OUTPUT_KINDS, *STRUCTURED_OUTPUT_OPTIONS)
        kind, value = structured_outputs_kind({k: getattr(self, k) for k in fields})
        if kind in ("json", "structural_tag"):
            return kind, json_module.dumps(value, separators=(",", ":"))  # order matters
        if kind == "choice":
            return kind, json_module.dumps(list(value))
        return kind, "" if kind == "json_object" else value


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
    structured_outputs: StructuredOutputsParams | None = None
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit, in [-100, 100]
    # vLLM's: only these token ids may be sampled (a non-empty list; None: any)
    allowed_token_ids: list[int] | None = None
    # vLLM's: words never generated. The engine tokenizes each as vLLM does (as given and
    # after a space) into ``bad_words_token_ids``; a word's last token is banned wherever the
    # tokens generated just before it are the word's other tokens.
    bad_words: list[str] | None = None
    bad_words_token_ids: tuple[tuple[int, ...], ...] = ()

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
        if self.logit_bias:
            self.logit_bias = check_logit_bias(self.logit_bias)
        else:
            self.logit_bias = None
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = check_allowed_token_ids(self.allowed_token_ids)
        if self.bad_words is not None:
            self.bad_words = check_bad_words(self.bad_words) or None
        if self.structured_outputs is not None and \
                not isinstance(self.structured_outputs, StructuredOutputsParams):
            if not isinstance(self.structured_outputs, dict):
                _fail("structured_outputs", "must be a StructuredOutputsParams")
            structured_outputs_kind(self.structured_outputs)  # unknown keys name themselves
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)

    @property
    def is_greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @property
    def uses_penalties(self) -> bool:
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0)

    def clone(self, **changes) -> SamplingParams:
        return replace(self, stop=list(self.stop), stop_token_ids=list(self.stop_token_ids),
                       logit_bias=dict(self.logit_bias) if self.logit_bias else None,
                       allowed_token_ids=None if self.allowed_token_ids is None
                       else list(self.allowed_token_ids),
                       bad_words=None if self.bad_words is None else list(self.bad_words),
                       **changes)
