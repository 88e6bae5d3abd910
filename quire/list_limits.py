"""How long a request's lists may be: one limit per list field, shared by the router's fronts and
the engine, so both refuse the same requests with the same message, which names the limit.
Before these, only the body size bounded a list (half a million stop token ids were accepted).

Lists with limits elsewhere: stop strings (``max_stop_strings``, configured per server) and
prompt token ids (``max_model_len``, the model's). ``logit_bias`` is accepted only empty.

Imports nothing of either application: the router and the engine both import it.
"""

from __future__ import annotations

from collections.abc import Sized

from quire.errors import FieldError

MAX_STOP_TOKEN_IDS = 128  # stop_token_ids of one request (a model has a few end tokens)
MAX_CHAT_MESSAGES = 2048  # messages of one chat conversation
MAX_CONTENT_PARTS = 256  # content parts of one chat message


def check_length(values: Sized, limit: int, field: str, what: str) -> None:
    """FieldError naming ``field`` and ``limit`` when ``values`` holds more than ``limit``."""
    if len(values) > limit:
        raise FieldError(field, f"at most {limit} {what}, got {len(values)}")


def check_token_ids(token_ids, vocab_size: int, field: str) -> None:
    """Every id an integer in [0, ``vocab_size``): FieldError naming ``field`` otherwise."""
    for token_id in token_ids:
        if isinstance(token_id, bool) or not isinstance(token_id, int) \
                or not 0 <= token_id < vocab_size:
            raise FieldError(field, f"{token_id!r} is not a token id in [0, {vocab_size})")
