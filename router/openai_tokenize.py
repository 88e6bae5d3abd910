"""vLLM's ``POST /tokenize`` and ``POST /detokenize`` for the router's HTTP front.

Served by the router's own tokenizer (``quire.tokenizer``), which tokenizes and renders chat
templates exactly as the engines do: no engine is asked. The shapes are vLLM's:

- tokenize, completion form: ``{"model", "prompt", "add_special_tokens" (default true),
  "return_token_strs"}``; chat form: ``{"model", "messages", "tools", "add_generation_prompt"
  (default true), "continue_final_message" (default false), "add_special_tokens" (default
  false), "chat_template_kwargs", "return_token_strs"}``, rendered as chat renders it (tool
  calls, tool results and the tools the prompt shows included, ``quire.tool_calls``)
  -> ``{"count", "max_model_len", "tokens", "token_strs"}``;
- detokenize: ``{"model", "tokens"}`` -> ``{"prompt"}``.

Validation follows the other routes: a 400 naming the field for anything malformed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from quire.errors import FieldError
from quire.tool_calls import render_inputs, tool_choice_of
from router.chat_template import CHAT_TEMPLATE_FIELDS, ChatTemplateOptions, flag
from router.openai_protocol import RequestError, chat_messages, shown, token_list

if TYPE_CHECKING:
    from quire.tokenizer import FastTokenizer

TOKENIZE_FIELDS = frozenset({"model", "prompt", "messages", "tools", "add_special_tokens",
                             "return_token_strs", *CHAT_TEMPLATE_FIELDS})
DETOKENIZE_FIELDS = frozenset({"model", "tokens"})
_PROMPT_ONLY = ("prompt",)
_CHAT_ONLY = ("messages", "tools") + CHAT_TEMPLATE_FIELDS


@dataclass(frozen=True, slots=True)
class TokenizeRequest:
    """A checked ``/tokenize`` body: ``text`` or ``messages`` (exactly one is set; ``chat``
    with ``messages``)."""

    text: str | None
    messages: list[dict] | None
    add_special_tokens: bool
    chat: ChatTemplateOptions | None
    return_token_strs: bool
    tools: tuple[dict, ...] = ()  # the tools the chat prompt shows

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
        tools: tuple[dict, ...] = ()
        if chat:
            messages = chat_messages(body, max_chars)
            options = ChatTemplateOptions.from_body(body, messages)
            try:  # checked as chat checks them (tool_choice and the rest are chat's alone)
                tool_choice_of({"tools": body.get("tools")})
            except FieldError as e:
                raise RequestError(str(e), e.field) from None
            tools = tuple(body.get("tools") or ())
        else:
            text = body["prompt"]
            if not isinstance(text, str):
                raise RequestError(f"prompt: must be a string, got {shown(text)}", "prompt")
            if len(text) > max_chars:
                raise RequestError(f"prompt: at most {max_chars} characters, got {len(text)}",
                                   "prompt")
        return cls(text=text, messages=messages,
                   add_special_tokens=flag(body, "add_special_tokens", not chat),
                   chat=options, return_token_strs=flag(body, "return_token_strs", False),
                   tools=tools)

    def token_ids(self, tokenizer: FastTokenizer) -> list[int]:
        """The ids an engine would be sent for this prompt (chat: the rendered template, as
        the chat route renders it)."""
        if self.chat is not None:
            messages, tools = render_inputs(self.messages, self.tools, tokenizer.chat_template)
            return self.chat.token_ids(tokenizer, messages, tools)
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
