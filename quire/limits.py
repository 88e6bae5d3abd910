"""Request checks that the router and the engine both apply, written once so both accept the
same requests and name the same fields when they refuse one.

Imports only ``quire.errors``: the router (whose image has no torch) and the engine both
import it.
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from quire.errors import FieldError

if TYPE_CHECKING:
    from quire.v1 import engine_pb2 as pb

DEFAULT_MAX_N = 16  # samples per request a server accepts unless configured otherwise
MAX_LOGPROBS = 20  # top logprobs per token a request may ask for (vLLM's default max_logprobs)
UINT32_MAX = 2 ** 32 - 1
INT32_MAX = 2 ** 31 - 1
SEED_MAX = 2 ** 63 - 1  # a torch generator takes seeds in [0, 2**63)
FLOAT32_MAX = 3.4028234663852886e38  # the wire's floats are float32: nothing larger travels
# a client-chosen request id: it goes into every log line, span and event about the request
MAX_REQUEST_ID_CHARS = 256
# a LoRA adapter's name: it is echoed in errors, logs and the models list
MAX_LORA_NAME_CHARS = 1024


@dataclass(frozen=True, slots=True)
class Range:
    """The values a numeric sampling field accepts: an integer or a finite (float32) number in
    [lo, hi] (``lo_open``: (lo, hi]); None: unbounded on that side."""

    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False
    integer: bool = False
    note: str = ""  # appended to the message, e.g. what a special value means

    def contains(self, value: float) -> bool:
        above = self.lo is None or (value > self.lo if self.lo_open else value >= self.lo)
        return above and (self.hi is None or value <= self.hi)

    def describe(self) -> str:
        """What the range asks for, as an error message says it: "must be >= 0 and <= 2"."""
        bounds = [f"{'>' if self.lo_open else '>='} {self.lo}" if self.lo is not None else "",
                  f"<= {self.hi}" if self.hi is not None else ""]
        return "must be " + " and ".join(b for b in bounds if b)


# The sampling fields' ranges, by their engine (and quire.v1 SamplingOptions) name. The router's
# HTTP front and the engine's SamplingParams both check with ``check_sampling``; the HTTP front
# names the OpenAI field (``top_logprobs`` checks as ``logprobs``, ``max_completion_tokens`` as
# ``max_tokens``). ``n`` has its own check (``check_n``): its bound is each server's setting.
SAMPLING_RANGES: Mapping[str, Range] = {
    "temperature": Range(0),  # 0: greedy; no upper bound (vLLM's rule)
    "top_p": Range(0, 1, lo_open=True),
    "top_k": Range(-1, INT32_MAX, integer=True, note=" (-1 and 0: off)"),
    "min_p": Range(0, 1),
    "repetition_penalty": Range(0, lo_open=True),
    "presence_penalty": Range(-2, 2),
    "frequency_penalty": Range(-2, 2),
    "max_tokens": Range(1, UINT32_MAX, integer=True),
    "min_tokens": Range(0, UINT32_MAX, integer=True),
    "seed": Range(0, SEED_MAX, integer=True),
    "logprobs": Range(0, MAX_LOGPROBS, integer=True),
    "prompt_logprobs": Range(0, MAX_LOGPROBS, integer=True),
}


def shown(value: object, limit: int = 64) -> str:
    """A value as it was sent (JSON where it can be), cut short for messages."""
    try:
        text = json.dumps(value)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def load_json(text: str | bytes, field: str) -> object:
    """``text`` parsed as JSON, or ``FieldError`` naming ``field`` and why: not JSON, nested too
    deeply for the parser (about 1,000 levels), or an integer too long for Python to convert
    (``sys.get_int_max_str_digits()``, 4,300 digits), which json raises as a plain ValueError."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise FieldError(field, f"not valid JSON ({e})") from None
    except UnicodeDecodeError as e:
        raise FieldError(field, f"not valid JSON (not UTF-8: {e.reason} at byte {e.start})"
                         ) from None
    except RecursionError:
        raise FieldError(field, "not valid JSON here: nested too deeply") from None
    except ValueError:  # int('1' * 5000): json's only other ValueError
        raise FieldError(field, "not valid JSON here: an integer of more than "
                         f"{sys.get_int_max_str_digits()} digits") from None


def check_sampling(name: str, value: object, *, field: str | None = None,
                   hi: float | None = None, why: str = "") -> int | float:
    """``value`` of the sampling field ``name`` if ``SAMPLING_RANGES[name]`` accepts it, else
    ``FieldError`` naming ``field`` (default ``name``: the caller's name for it) and echoing the
    value. ``hi`` tightens the upper bound (a server's cap; ``why``, appended, says whose)."""
    rule = SAMPLING_RANGES[name]
    field = field or name
    if isinstance(value, bool) or not isinstance(value, (int,) if rule.integer else (int, float)):
        raise FieldError(field, f"must be {'an integer' if rule.integer else 'a number'}, "
                         f"got {shown(value)}")
    if isinstance(value, float) and not math.isfinite(value):
        raise FieldError(field, f"must be a finite number, got {shown(value)}")
    if not rule.integer and abs(value) > FLOAT32_MAX:  # an int too: 10**400 overflows a float
        raise FieldError(field, f"must be at most {FLOAT32_MAX:.7g} in magnitude (a float32), "
                         f"got {shown(value)}")
    if hi is not None and (rule.hi is None or hi < rule.hi):
        rule = replace(rule, hi=hi, note=why + rule.note)
    if not rule.contains(value):
        raise FieldError(field, f"{rule.describe()}{rule.note}, got {shown(value)}")
    return value


def check_request_id(request_id: str) -> None:
    """A caller's request id (empty: one is made up) of at most ``MAX_REQUEST_ID_CHARS``."""
    if len(request_id) > MAX_REQUEST_ID_CHARS:
        raise FieldError("request_id", f"at most {MAX_REQUEST_ID_CHARS} characters, got "
                         f"{len(request_id)}")


# vLLM's bounds on a cache salt (it reaches cache keys, KV event wires and paths downstream)
MAX_CACHE_SALT_CHARS = 128
_CACHE_SALT_FORBIDDEN = frozenset("@/\\\x00")


def check_cache_salt(value: object, field: str = "cache_salt") -> str:
    """vLLM's ``cache_salt`` check, the same on every front: a non-empty string of at most
    128 characters without @, /, \\ or NUL (gRPC took any string, 4 MB and NUL included)."""
    if not isinstance(value, str) or not value:
        raise FieldError(field, f"must be a non-empty string, got {shown(value)}")
    if len(value) > MAX_CACHE_SALT_CHARS or _CACHE_SALT_FORBIDDEN & set(value):
        raise FieldError(field, f"must be at most {MAX_CACHE_SALT_CHARS} characters and must "
                         "not contain '@', '/', '\\' or NUL")
    return value


def check_lora_name(name: str, field: str = "lora_name") -> None:
    """A LoRA adapter's name ("" : the base model) of at most ``MAX_LORA_NAME_CHARS``."""
    if len(name) > MAX_LORA_NAME_CHARS:
        raise FieldError(field, f"at most {MAX_LORA_NAME_CHARS} characters, got {len(name)}")


def check_min_tokens(min_tokens: int, max_tokens: int | None,
                     field: str = "min_tokens") -> None:
    """At least ``min_tokens`` cannot be generated within ``max_tokens``."""
    if max_tokens is not None and min_tokens > max_tokens:
        raise FieldError(field, f"must not exceed max_tokens={max_tokens}, got {min_tokens}")


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
