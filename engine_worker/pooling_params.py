"""Per-request pooling parameters (embeddings), in vLLM's shape: ``PoolingParams``."""

from __future__ import annotations

from dataclasses import dataclass, replace

from quire.errors import FieldError


@dataclass(slots=True)
class PoolingParams:
    """How to embed one prompt. ``normalize`` None: the engine's ``--pooler-config`` says.
    ``truncate_prompt_tokens`` k keeps only k of the prompt's tokens (-1: max_model_len):
    its first k, or its last k with ``truncation_side="left"`` (vLLM 0.32's sides: "right",
    which cuts the end, is the default of pooling models); None refuses a prompt longer than
    max_model_len. ``dimensions`` (a shorter, matryoshka
    vector) is not supported: any value is refused."""

    truncate_prompt_tokens: int | None = None
    dimensions: int | None = None
    normalize: bool | None = None
    truncation_side: str | None = None  # None: "right"

    def __post_init__(self) -> None:
        if self.truncation_side not in (None, "left", "right"):
            raise FieldError("truncation_side", f"must be left or right, got "
                             f"{self.truncation_side!r}")
        k = self.truncate_prompt_tokens
        if k is not None and (isinstance(k, bool) or not isinstance(k, int) or k == 0
                              or k < -1):
            raise FieldError("truncate_prompt_tokens", f"must be -1 (max_model_len) or a "
                             f"positive integer, got {k!r}")
        if self.normalize is not None and not isinstance(self.normalize, bool):
            raise FieldError("normalize", f"must be a boolean, got {self.normalize!r}")
        if self.dimensions is not None:
            raise FieldError("dimensions", "is not supported: this model has no matryoshka "
                             "representation (leave it unset for the full vector)")

    def clone(self, **changes) -> PoolingParams:
        return replace(self, **changes)
