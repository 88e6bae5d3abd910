"""vLLM's ``POST /tokenize`` and ``POST /detokenize`` for the router's HTTP front.

Served by the router's own tokenizer (``quire.tokenizer``), which tokenizes and renders chat
templates exactly as the engines do: no engine is asked. The shapes are vLLM's:

- tokenize, completion form: ``{"model", "prompt", "add_special_tokens" (default true),
  "return_token_strs"}``; chat form: ``{"model", "messages", "add_generation_prompt"
  (default true), "continue_final_message" (default false), "add_special_tokens" (default
  false), "chat_template_kwargs", "return_token_strs"}``
  -> ``{"count", "max_model_len", "tokens", "token_strs"}``;
- detokenize: ``{"model", "tokens"}`` -> ``{"prompt"}``.

Validation follows the other routes: a 400 naming the field for anything malformed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from router.chat_template import CHAT_TEMPLATE_FIELDS, ChatTemplateOptions, flag
from router.openai_protocol import RequestError, chat_messages, shown, token_list

if TYPE_CHECKING:
    from quire.tokenizer import FastTokenizer

TOKENIZE_FIELDS = frozenset({"model", "prompt", "messages", "add_special_tokens",
                             "return_token_strs", *CHAT_TEMPLATE_FIELDS})
DETOKENIZE_FIELDS = frozenset({"model", "tokens"})
_PROMPT_ONLY = ("prompt",)
_CHAT_ONLY = ("messages",) + CHAT_TEMPLATE_FIELDS


@dataclass(frozen=True, slots=True)
class TokenizeRequest:
    """A checked ``/tokenize`` body: ``text`` or ``messages`` (exactly one is set; ``chat``
    with ``messages``)."""

    text: str | None
    messages: list[dict] | None
    add_special_tokens: bool
    chat: ChatTemplateOptions | None
    return_token_strs: bool

    @classmethod
    def from_body(cls, body: dict, max_chars: int) -> TokenizeRequest:
        chat = "messages" in body
        if chat and "prompt" in body:
            raise RequestError("prompt: give either prompt or messages, not both", "prompt")
        if not chat and "prompt" not in body:
            raise RequestError("prompt: a prompt (or messages) is required", "prompt")
        for name in (_PROMPT_ONLY if chat else _CHAT_ONLY):
            if name in body:
                raise RequestError(f"{name}: only with {'prompt' if chat else 'messages'}",
                                   name)
        text = messages = options = None
        if chat:
            messages = chat_messages(body, max_chars)
            options = ChatTemplateOptions.from_body(body, messages)
        else:
            text = body["prompt"]
            if not isinstance(text, str):
                raise RequestError(f"prompt: must be a string, got {shown(text)}", "prompt")
            if len(text) > max_chars:
                raise RequestError(f"prompt: at most {max_chars} characters, got {len(text)}",
                                   "prompt")
        return cls(text=text, messages=messages,
                   add_special_tokens=flag(body, "add_special_tokens", not chat),
                   chat=options, return_token_strs=flag(body, "return_token_strs", False))

    def token_ids(self, tokenizer: FastTokenizer) -> list[int]:
        """The ids an engine would be sent for this prompt (chat: the rendered template)."""
        if self.chat is not None:
            return self.chat.token_ids(tokenizer, self.messages)
        return tokenizer.encode(self.text, add_special_tokens=self.add_special_tokens)


def tokenize_response(request: TokenizeRequest, token_ids: list[int], max_model_len: int,
                      tokenizer: FastTokenizer) -> dict:
    body = {"count": len(token_ids), "max_model_len": max_model_len, "tokens": token_ids,
            "token_strs": None}
    if request.return_token_strs:
        body["token_strs"] = [tokenizer.backend.id_to_token(t) for t in token_ids]
    return body


def detokenize_ids(body: dict, vocab_size: int, max_tokens: int) -> list[int]:
    """The checked ``tokens`` of a ``/detokenize`` body."""
    tokens = body.get("tokens")
    if isinstance(tokens, list) and len(tokens) > max_tokens:
        raise RequestError(f"tokens: at most {max_tokens} token ids, got {len(tokens)}",
                           "tokens")
    ids = [] if tokens == [] else token_list(tokens)
    if ids is None:
        raise RequestError("tokens: must be a list of token ids", "tokens")
    bad = next((t for t in ids if t >= vocab_size), None)
    if bad is not None:
        raise RequestError(f"tokens: {bad} is not a token id in [0, {vocab_size})", "tokens")
    return ids
