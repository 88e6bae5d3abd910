"""The chat template's options on the router's OpenAI routes, under vLLM's names.

vLLM's chat completions and its chat-form ``/tokenize`` take the same four fields beside
``messages``: ``add_generation_prompt`` (default true), ``continue_final_message`` (default
false: the final assistant message is left open for the model to continue),
``add_special_tokens`` (default false: the template writes its own) and
``chat_template_kwargs`` (extra variables for the template, e.g. ``{"enable_thinking":
false}``). Both routes read them here, so a prompt ``/tokenize`` reports is the prompt a chat
completion sends.

``chat_template`` (a template in the request) is refused, as vLLM refuses it unless its
server was started with ``--trust-request-chat-template``: a template is code the router runs.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import jinja2

from router.openai_protocol import RequestError, shown

if TYPE_CHECKING:
    from quire.tokenizer import FastTokenizer

CHAT_TEMPLATE_FIELDS = ("add_generation_prompt", "continue_final_message",
                        "chat_template_kwargs")
# OpenAI's reasoning_effort values, as vLLM 0.32 takes them
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")
# Template variables a request may not set: the router sets them itself.
# (with the renderer's own parameters, which a template variable of the same name would clash
# with: "got multiple values for keyword argument")
_RESERVED_KWARGS = frozenset({"messages", "add_generation_prompt", "tools", "documents",
                              "continue_final_message", "self"})


def flag(body: dict, name: str, default: bool) -> bool:
    """``body[name]`` as a boolean (``default`` when absent or null), else a 400 naming it."""
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise RequestError(f"{name}: must be a boolean, got {shown(value)}", name)
    return value


@dataclass(frozen=True, slots=True)
class ChatTemplateOptions:
    """How a checked conversation becomes prompt token ids."""

    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    template_kwargs: Mapping[str, object] = field(default_factory=dict)

    @classmethod
    def from_body(cls, body: dict, messages: list[dict], *,
                  default_generation_prompt: bool = True) -> ChatTemplateOptions:
        """The options of a request whose ``messages`` are already checked
        (``default_generation_prompt``: vLLM's default for the route; false for embeddings)."""
        kwargs = body.get("chat_template_kwargs") or {}
        if not isinstance(kwargs, dict) or not all(isinstance(k, str) for k in kwargs):
            raise RequestError("chat_template_kwargs: must be an object",
                               "chat_template_kwargs")
        reserved = _RESERVED_KWARGS & set(kwargs)
        if reserved:
            raise RequestError(f"chat_template_kwargs: {sorted(reserved)[0]!r} cannot be set "
                               f"here", "chat_template_kwargs")
        effort = body.get("reasoning_effort")
        if effort is not None:  # OpenAI's field: template variables, as vLLM 0.32 passes them
            if effort not in REASONING_EFFORTS:
                raise RequestError(f"reasoning_effort: must be one of "
                                   f"{', '.join(REASONING_EFFORTS)}, got {shown(effort)}",
                                   "reasoning_effort")
            # thinking on unless "none", for templates that need the opt-in (Qwen3, Gemma)
            kwargs = {"reasoning_effort": effort, "enable_thinking": effort != "none", **kwargs}
        add_generation_prompt = flag(body, "add_generation_prompt", default_generation_prompt)
        continue_final = flag(body, "continue_final_message", False)
        if continue_final and add_generation_prompt and "add_generation_prompt" in body:
            raise RequestError("continue_final_message: cannot be combined with "
                               "add_generation_prompt", "continue_final_message")
        if continue_final and (not messages or messages[-1]["role"] != "assistant"):
            raise RequestError("continue_final_message: the last message must be the "
                               "assistant's", "continue_final_message")
        return cls(add_generation_prompt=add_generation_prompt and not continue_final,
                   continue_final_message=continue_final,
                   add_special_tokens=flag(body, "add_special_tokens", False),
                   template_kwargs=kwargs)

    def render(self, tokenizer: FastTokenizer, messages: list[dict],
               tools: list[dict] | None = None) -> str:
        """The prompt text (a 400 naming ``messages`` when the model has no template)."""
        try:
            # continue_final_message: transformers' cut (a tag after the final message's text),
            # which vLLM asks transformers for, and the engine's LLM.chat does too
            return tokenizer.apply_chat_template(
                messages, add_generation_prompt=self.add_generation_prompt, tools=tools,
                continue_final_message=self.continue_final_message, **self.template_kwargs)
        except (ValueError, TypeError, jinja2.TemplateError) as e:
            # no template, or the template refused this conversation (its raise_exception) or
            # these kwargs: the request's content, as vLLM answers it (400)
            if not isinstance(e, ValueError):
                raise RequestError(f"messages: the chat template failed: {e}",
                                   "messages") from None
            field_name = ("continue_final_message"
                          if str(e).startswith("continue_final_message") else "messages")
            raise RequestError(str(e), field_name) from None

    def token_ids(self, tokenizer: FastTokenizer, messages: list[dict],
                  tools: list[dict] | None = None) -> list[int]:
        text = self.render(tokenizer, messages, tools)
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:  # a lone surrogate came out of some decoded JSON
            raise RequestError("messages: the conversation holds a lone surrogate (an "
                               "unpaired \\ud800-\\udfff escape), which is not text",
                               "messages") from None
        return tokenizer.encode(text, add_special_tokens=self.add_special_tokens)
