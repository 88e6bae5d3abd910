"""vLLM's ``speculative_config``: which proposer, how many draft tokens, and when to stop.

Given as a dict (``LLM(speculative_config={...})``) or as its JSON text
(``--speculative-config '{"method": "ngram", "num_speculative_tokens": 4}'``). A bad value
raises ``ValueError`` naming the field as ``speculative_config.<field>``. Torch-free.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

SPEC_METHODS = ("ngram", "suffix", "draft_model")
MAX_SPECULATIVE_TOKENS = 32

# The batch rule's default (see ``speculator``): with more requests than this in a step, the
# step runs without drafts.
DEFAULT_DISABLE_BY_BATCH_SIZE = 4


def _field(name: str) -> str:
    return f"speculative_config.{name}"


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    """``method``: ``ngram`` (prompt lookup over the request's own prompt and output),
    ``suffix`` (suffix matching over the request and recent outputs of others) or
    ``draft_model`` (``model``, a small model of the same tokenizer).
    ``num_speculative_tokens``: the most draft tokens a request verifies per step.
    ``prompt_lookup_max`` / ``prompt_lookup_min``: the longest and shortest n-gram (suffix of
    the request's tokens) that ngram matches. ``disable_by_batch_size``: no drafts in a step
    with more running requests than this."""

    method: str
    num_speculative_tokens: int
    prompt_lookup_max: int | None = None
    prompt_lookup_min: int | None = None
    model: str | None = None
    disable_by_batch_size: int = DEFAULT_DISABLE_BY_BATCH_SIZE
    # suffix: the longest suffix of the request matched in recent outputs, and how many
    # finished requests' outputs are kept for matching (vLLM's names)
    suffix_decoding_max_tree_depth: int | None = None
    suffix_decoding_max_cached_requests: int | None = None

    def __post_init__(self) -> None:
        if self.method not in SPEC_METHODS:
            raise ValueError(f"{_field('method')}: must be one of {SPEC_METHODS}, "
                             f"got {self.method!r}")
        k = self.num_speculative_tokens
        if not (_is_int(k) and 1 <= k <= MAX_SPECULATIVE_TOKENS):
            raise ValueError(f"{_field('num_speculative_tokens')}: must be an integer from 1 "
                             f"to {MAX_SPECULATIVE_TOKENS}, got {k!r}")
        if not (_is_int(self.disable_by_batch_size) and self.disable_by_batch_size >= 1):
            raise ValueError(f"{_field('disable_by_batch_size')}: must be a positive integer, "
                             f"got {self.disable_by_batch_size!r}")
        self._check_ngram()
        self._check_suffix()
        if self.method == "draft_model":
            if not isinstance(self.model, str) or not self.model:
                raise ValueError(f"{_field('model')}: the draft_model method needs the draft "
                                 f"model's path, got {self.model!r}")
        elif self.model is not None:
            raise ValueError(f"{_field('model')}: only the draft_model method takes a model "
                             f"(method is {self.method!r})")

    def _check_ngram(self) -> None:
        lookup = (self.prompt_lookup_max, self.prompt_lookup_min)
        if self.method != "ngram":
            if any(v is not None for v in lookup):
                raise ValueError(f"{_field('prompt_lookup_max')}: only the ngram method takes "
                                 f"prompt_lookup_max / prompt_lookup_min")
            return
        for name in ("prompt_lookup_max", "prompt_lookup_min"):
            value = getattr(self, name)
            if value is not None and not (_is_int(value) and value >= 1):
                raise ValueError(f"{_field(name)}: must be a positive integer, got {value!r}")
        hi = 5 if self.prompt_lookup_max is None else self.prompt_lookup_max
        lo = min(2, hi) if self.prompt_lookup_min is None else self.prompt_lookup_min
        if lo > hi:
            raise ValueError(f"{_field('prompt_lookup_min')}: must not exceed "
                             f"prompt_lookup_max ({hi}), got {lo}")
        object.__setattr__(self, "prompt_lookup_max", hi)
        object.__setattr__(self, "prompt_lookup_min", lo)

    def _check_suffix(self) -> None:
        names = ("suffix_decoding_max_tree_depth", "suffix_decoding_max_cached_requests")
        if self.method != "suffix":
            for name in names:
                if getattr(self, name) is not None:
                    raise ValueError(f"{_field(name)}: only the suffix method takes it")
            return
        for name, default in zip(names, (24, 1000)):
            value = getattr(self, name)
            if value is None:
                object.__setattr__(self, name, default)
            elif not (_is_int(value) and value >= 1):
                raise ValueError(f"{_field(name)}: must be a positive integer, got {value!r}")

    @classmethod
    def parse(cls, value: str | dict | SpeculativeConfig | None) -> SpeculativeConfig | None:
        """From a dict, its JSON text, or None / ``""`` / ``"null"`` (speculation off)."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            if not value.strip() or value.strip() == "null":
                return None
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative_config: not valid JSON ({e})") from None
            if value is None:
                return None
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config: must be a JSON object, got {value!r}")
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"{_field(unknown[0])}: unknown field (known: {sorted(known)})")
        fields = dict(value)
        if "method" not in fields:
            if fields.get("model") is None:
                raise ValueError(f"{_field('method')}: required (one of {SPEC_METHODS}), "
                                 "or a draft model's path in 'model'")
            fields["method"] = "draft_model"
        if "num_speculative_tokens" not in fields:
            raise ValueError(f"{_field('num_speculative_tokens')}: required")
        return cls(**fields)

    def to_json(self) -> str:
        """The config as it runs (defaults filled in): start block, GetModelInfo."""
        return json.dumps({k: v for k, v in asdict(self).items() if v is not None},
                          sort_keys=True)
