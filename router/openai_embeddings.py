"""OpenAI's ``POST /v1/embeddings`` for the router's HTTP front: request checking and the
response's shape. Each input becomes one ``Embed`` call on the router's own gRPC front, so it
is tokenized, admitted (flow control: priority, tenant share, shedding) and placed like a
generation (prefix-aware), and the inputs of one request run concurrently (at most
``EMBEDDING_INPUTS_IN_FLIGHT`` at once), batched by the engines with whatever else they run.

Fields (OpenAI's names; vLLM's extra ``normalize`` too): ``model``, ``input`` (a string, a
list of strings, a list of token ids, or a list of such lists), ``encoding_format`` ("float"
or "base64": little-endian float32 bytes), ``dimensions`` (refused: no model here has a
shorter, matryoshka vector), ``user`` (ignored), ``normalize`` (vLLM's; default: the engine's
pooler config), ``truncate_prompt_tokens`` (vLLM's: keep each input's last k tokens; -1:
max_model_len; unset: a longer input is refused).

Chat form, as vLLM's: ``messages`` (one conversation, or a list of conversations: one vector
each), or a conversation given as ``input``, rendered through the model's chat template with
vLLM's embedding defaults: ``add_generation_prompt`` false, ``continue_final_message`` false,
``add_special_tokens`` false, and ``chat_template_kwargs``.
"""

from __future__ import annotations

import base64
import struct
from dataclasses import dataclass

from router.chat_template import CHAT_TEMPLATE_FIELDS, ChatTemplateOptions
from router.openai_protocol import (RequestError, cache_salt, chat_messages,
                                    request_priority, shown, token_list, truncation)

EMBEDDING_FIELDS = frozenset({"model", "input", "messages", "encoding_format", "dimensions",
                              "normalize", "truncate_prompt_tokens", "add_special_tokens",
                              "priority", "cache_salt", "truncation_side",
                              *CHAT_TEMPLATE_FIELDS})
MAX_EMBEDDING_INPUTS = 2048  # inputs of one request (OpenAI's limit)
# Inputs of one request sent at once; the next goes as one finishes. A quarter of a tenant's
# default router queue (256), so one large request never fills it, and more than a pooling
# step's worth of typical inputs, so the engines stay busy.
EMBEDDING_INPUTS_IN_FLIGHT = 64
_FORMATS = ("float", "base64")
_INPUT_FORMS = "a non-empty string, a list of them, a list of token ids, or a list of those"


@dataclass(frozen=True, slots=True)
class Conversation:
    """One chat-form input: checked messages, to be rendered through the template."""

    messages: list[dict]


@dataclass(frozen=True, slots=True)
class EmbeddingsRequest:
    """A checked body: ``inputs`` are each a text, a list of token ids or a conversation
    (``chat``: how conversations become token ids)."""

    inputs: tuple[str | list[int] | Conversation, ...]
    batched: bool  # the input was a list of inputs (errors then say which: ``input[3]``)
    encoding_format: str
    normalize: bool | None
    truncate_prompt_tokens: int | None
    chat: ChatTemplateOptions | None = None
    priority: int = 0  # vLLM's: each input waits its turn at it (0: the tenant's default)
    cache_salt: str = ""  # vLLM's: inputs share cached prefixes only with an equal salt
    truncation_side: str = ""  # "right" (the default: keep the first k) or "left"

    @classmethod
    def from_body(cls, body: dict, max_chars: int) -> EmbeddingsRequest:
        if body.get("dimensions") is not None:
            raise RequestError(f"dimensions: is not supported by this model (no matryoshka "
                               f"representation), got {shown(body['dimensions'])}",
                               "dimensions")
        encoding = body.get("encoding_format")
        encoding = "float" if encoding is None else encoding
        if encoding not in _FORMATS:
            raise RequestError(f"encoding_format: must be one of {list(_FORMATS)}, got "
                               f"{shown(encoding)}", "encoding_format")
        normalize = body.get("normalize")
        if normalize is not None and not isinstance(normalize, bool):
            raise RequestError(f"normalize: must be a boolean, got {shown(normalize)}",
                               "normalize")
        keep, side = truncation(body, default_side="right") or (None, "")
        chat = None
        if _is_chat_form(body):
            conversations, batched, chat = _conversations(body, max_chars)
            inputs: tuple = tuple(Conversation(c) for c in conversations)
        else:
            for name in (*CHAT_TEMPLATE_FIELDS, "add_special_tokens"):
                if name in body:  # (text inputs get the tokenizer's special tokens)
                    raise RequestError(f"{name}: only with messages", name)
            inputs, batched = _inputs(body.get("input"), max_chars)
        return cls(inputs=inputs, batched=batched, encoding_format=encoding,
                   normalize=normalize, truncate_prompt_tokens=keep, chat=chat,
                   priority=request_priority(body), cache_salt=cache_salt(body),
                   truncation_side=side)

    @property
    def field(self) -> str:
        """Where the inputs came from: ``messages`` (chat form) or ``input``."""
        return "messages" if self.chat is not None else "input"

    def name(self, index: int) -> str:
        """How errors name input ``index``."""
        return f"{self.field}[{index}]" if self.batched else self.field


def _is_conversation(value) -> bool:
    return isinstance(value, list) and bool(value) and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) for m in value)


def _is_chat_form(body: dict) -> bool:
    """``messages``, or a conversation given as ``input`` (vLLM takes both)."""
    if "messages" in body:
        if body.get("input") is not None:  # (null: the official client's way to leave it out)
            raise RequestError("input: give either input or messages, not both", "input")
        return True
    return _is_conversation(body.get("input"))


def _conversations(body: dict, max_chars: int
                   ) -> tuple[list[list[dict]], bool, ChatTemplateOptions]:
    """The checked conversations (several where ``messages`` is a list of them) and the
    template options, with vLLM's defaults for embeddings."""
    value = body["messages"] if "messages" in body else body["input"]
    batched = isinstance(value, list) and bool(value) and all(
        isinstance(c, list) for c in value)
    if batched and len(value) > MAX_EMBEDDING_INPUTS:
        raise RequestError(f"messages: at most {MAX_EMBEDDING_INPUTS} conversations, got "
                           f"{len(value)}", "messages")
    conversations = []
    for j, conversation in enumerate(value if batched else [value]):
        try:
            conversations.append(chat_messages({"messages": conversation}, max_chars))
        except RequestError as e:  # name the conversation of a batch: messages[2][0].role
            text = str(e)
            if batched and text.startswith("messages"):
                text = f"messages[{j}]{text[len('messages'):]}"
            raise RequestError(text, "messages") from None
    if sum(len(m["content"]) for c in conversations for m in c) > max_chars:
        raise RequestError(f"messages: at most {max_chars} characters of content in all",
                           "messages")
    options = None
    for conversation in conversations:  # each must suit the options (the last message)
        options = ChatTemplateOptions.from_body(body, conversation,
                                                default_generation_prompt=False)
    return conversations, batched, options


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
    if all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        ids = token_list(value)  # one input of token ids: its length is the engine's to bound
        if ids is None:
            raise RequestError("input: token ids must be non-negative integers", "input")
        return (ids,), False
    if len(value) > MAX_EMBEDDING_INPUTS:
        raise RequestError(f"input: at most {MAX_EMBEDDING_INPUTS} inputs, got {len(value)}",
                           "input")
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
