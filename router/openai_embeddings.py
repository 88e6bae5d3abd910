"""OpenAI's ``POST /v1/embeddings`` for the router's HTTP front: request checking and the
response's shape. Each input becomes one ``Embed`` call on the router's own gRPC front, so it
is tokenized, hashed and placed like a generation (prefix-aware), and the inputs of one request
run concurrently, batched by the engines with whatever else they run.

Fields (OpenAI's names; vLLM's extra ``normalize`` too): ``model``, ``input`` (a string, a
list of strings, a list of token ids, or a list of such lists), ``encoding_format`` ("float"
or "base64": little-endian float32 bytes), ``dimensions`` (refused: no model here has a
shorter, matryoshka vector), ``user`` (ignored), ``normalize`` (vLLM's; default: the engine's
pooler config), ``truncate_prompt_tokens`` (vLLM's: keep each input's last k tokens; -1:
max_model_len; unset: a longer input is refused).
"""

from __future__ import annotations

import base64
import struct
from dataclasses import dataclass

from router.openai_protocol import RequestError, shown, token_list

EMBEDDING_FIELDS = frozenset({"model", "input", "encoding_format", "dimensions", "normalize",
                              "truncate_prompt_tokens"})
MAX_EMBEDDING_INPUTS = 2048  # inputs of one request (OpenAI's limit)
_FORMATS = ("float", "base64")
_INPUT_FORMS = "a non-empty string, a list of them, a list of token ids, or a list of those"


@dataclass(frozen=True, slots=True)
class EmbeddingsRequest:
    """A checked body: ``inputs`` are each a text or a list of token ids."""

    inputs: tuple[str | list[int], ...]
    batched: bool  # the input was a list of inputs (errors then say which: ``input[3]``)
    encoding_format: str
    normalize: bool | None
    truncate_prompt_tokens: int | None

    @classmethod
    def from_body(cls, body: dict, max_chars: int) -> EmbeddingsRequest:
        if body.get("dimensions") is not None:
            raise RequestError(f"dimensions: is not supported by this model (no matryoshka "
                               f"representation), got {shown(body['dimensions'])}",
                               "dimensions")
        encoding = body.get("encoding_format") or "float"
        if encoding not in _FORMATS:
            raise RequestError(f"encoding_format: must be one of {list(_FORMATS)}, got "
                               f"{shown(encoding)}", "encoding_format")
        normalize = body.get("normalize")
        if normalize is not None and not isinstance(normalize, bool):
            raise RequestError(f"normalize: must be a boolean, got {shown(normalize)}",
                               "normalize")
        keep = body.get("truncate_prompt_tokens")
        if keep is not None and (isinstance(keep, bool) or not isinstance(keep, int)
                                 or keep == 0 or not -1 <= keep < 2 ** 31):
            raise RequestError(f"truncate_prompt_tokens: must be -1 (max_model_len) or a "
                               f"positive integer, got {shown(keep)}", "truncate_prompt_tokens")
        inputs, batched = _inputs(body.get("input"), max_chars)
        return cls(inputs=inputs, batched=batched, encoding_format=encoding,
                   normalize=normalize, truncate_prompt_tokens=keep)

    def name(self, index: int) -> str:
        """How errors name input ``index``."""
        return f"input[{index}]" if self.batched else "input"


def _inputs(value, max_chars: int) -> tuple[tuple[str | list[int], ...], bool]:
    if isinstance(value, str):
        if not value:
            raise RequestError("input: must not be empty", "input")
        if len(value) > max_chars:
            raise RequestError(f"input: at most {max_chars} characters, got {len(value)}",
                               "input")
        return (value,), False
    if not isinstance(value, list) or not value:
        raise RequestError(f"input: must be {_INPUT_FORMS}", "input")
    if len(value) > MAX_EMBEDDING_INPUTS:
        raise RequestError(f"input: at most {MAX_EMBEDDING_INPUTS} inputs, got {len(value)}",
                           "input")
    if all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        ids = token_list(value)
        if ids is None:
            raise RequestError("input: token ids must be non-negative integers", "input")
        return (ids,), False
    inputs: list[str | list[int]] = []
    num_chars = 0
    for i, item in enumerate(value):
        if isinstance(item, str):
            if not item:
                raise RequestError(f"input[{i}]: must not be empty", "input")
            num_chars += len(item)
            if num_chars > max_chars:
                raise RequestError(f"input: at most {max_chars} characters in all", "input")
            inputs.append(item)
        elif (ids := token_list(item)) is not None:
            inputs.append(ids)
        else:
            raise RequestError(f"input[{i}]: must be a non-empty string or list of token ids",
                               "input")
    return tuple(inputs), True


def _encoded(vector, encoding: str):
    if encoding == "float":
        return list(vector)
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")


def embeddings_response(request: EmbeddingsRequest, vectors: list, num_prompt_tokens: int,
                        model_name: str) -> dict:
    return {"object": "list", "model": model_name,
            "data": [{"object": "embedding", "index": i,
                      "embedding": _encoded(v, request.encoding_format)}
                     for i, v in enumerate(vectors)],
            "usage": {"prompt_tokens": num_prompt_tokens, "total_tokens": num_prompt_tokens}}
