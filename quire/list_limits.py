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
# allowed_token_ids of one request: a whole vocabulary of up to 262,144 tokens (Gemma's)
MAX_ALLOWED_TOKEN_IDS = 1 << 18
MAX_BAD_WORDS = 256  # bad_words of one request
MAX_BAD_WORD_CHARS = 256  # characters of one bad word


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


def check_allowed_token_ids(ids) -> list[int]:
    """vLLM's ``allowed_token_ids``: a non-empty list of token ids (each checked against the
    vocabulary where it is known, ``check_token_ids``)."""
    if not isinstance(ids, (list, tuple)) or not ids:
        raise FieldError("allowed_token_ids", "must be a non-empty list of token ids")
    check_length(ids, MAX_ALLOWED_TOKEN_IDS, "allowed_token_ids", "token ids")
    if any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in ids):
        raise FieldError("allowed_token_ids", "every token id must be a non-negative integer")
    return list(ids)


def check_bad_words(words) -> list[str]:
    """vLLM's ``bad_words``: a list of words, each with a non-space character."""
    if not isinstance(words, (list, tuple)):
        raise FieldError("bad_words", "must be a list of strings")
    check_length(words, MAX_BAD_WORDS, "bad_words", "words")
    if any(not isinstance(w, str) or not w.strip() for w in words):
        raise FieldError("bad_words", "every bad word must be a string with a non-space "
                         "character")
    if any(len(w) > MAX_BAD_WORD_CHARS for w in words):
        raise FieldError("bad_words", f"a bad word has at most {MAX_BAD_WORD_CHARS} "
                         "characters")
    return list(words)
