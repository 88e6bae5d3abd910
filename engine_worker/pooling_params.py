"""Per-request pooling parameters (embeddings), in vLLM's shape: ``PoolingParams``."""

from __future__ import annotations

from dataclasses import dataclass, replace

from quire.errors import FieldError


@dataclass(slots=True)
class PoolingParams:
    """How to embed one prompt. ``normalize`` None: the engine's ``--pooler-config`` says.
    ``dimensions`` (a shorter, matryoshka vector) is not supported: any value is refused."""

    normalize: bool | None = None
    dimensions: int | None = None

    def __post_init__(self) -> None:
        if self.normalize is not None and not isinstance(self.normalize, bool):
            raise FieldError("normalize", f"must be a boolean, got {self.normalize!r}")
        if self.dimensions is not None:
            raise FieldError("dimensions", "is not supported: this model has no matryoshka "
                             "representation (leave it unset for the full vector)")

    def clone(self, **changes) -> PoolingParams:
        return replace(self, **changes)
