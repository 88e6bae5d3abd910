"""Request checks that the router and the engine both apply, written once so both accept the
same requests and name the same fields when they refuse one.

Imports nothing: the router (whose image has no torch) and the engine both import it.
"""

from __future__ import annotations

from quire.errors import FieldError
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from quire.v1 import engine_pb2 as pb

DEFAULT_MAX_N = 16  # samples per request a server accepts unless configured otherwise


def check_n(n: object, max_n: int | None = None, field: str = "n") -> int:
    """``n`` (samples of one prompt) as an integer in [1, ``max_n``] (no upper bound when
    ``max_n`` is None); ValueError naming ``field`` otherwise."""
    if isinstance(n, bool) or not isinstance(n, int):
        raise FieldError(field, f"must be an integer, got {n!r}")
    if max_n is None and n < 1:
        raise FieldError(field, f"must be at least 1, got {n}")
    if max_n is not None and not 1 <= n <= max_n:
        raise FieldError(field, f"must be in [1, {max_n}], got {n}")
    return n


def request_prompt(request: pb.GenerateRequest) -> str | list[int]:
    """The prompt of a ``GenerateRequest``: its text, or its token ids. ValueError naming the
    field when neither is set or the one set is empty."""
    kind = request.WhichOneof("prompt")
    if kind == "text":
        if not request.text:
            raise FieldError("text", "the prompt must not be empty")
        return request.text
    if kind == "token_ids":
        if not request.token_ids.ids:
            raise FieldError("token_ids", "the prompt must not be empty")
        return list(request.token_ids.ids)
    raise FieldError("prompt", "set either text or token_ids")
