"""vLLM's ``POST /v1/chat/completions/batch``: a chat completion request whose ``messages`` is a
list of conversations, answered as one chat completion with one choice per conversation
(``index`` k for conversation k) and their usage summed.

As vLLM 0.32 serves it: every other field applies to each conversation; no ``stream``, no
``tools``, ``n`` 1. Each conversation is served by the chat path as its own request (template,
grammar, flow control, placement: conversations of one batch may run on different engines),
all at once; a bad conversation fails the whole batch with the error its own request gets.
"""

from __future__ import annotations

import asyncio

from aiohttp import web

from router.local_call import LocalCall
from router.openai_answer import OpenAIRequest, collect_body
from router.openai_protocol import MAX_BATCH_PROMPTS, RequestError


def conversations_of(body: dict) -> list[list]:
    """The batch's conversations, or RequestError naming what vLLM's batch route refuses."""
    conversations = body.get("messages")
    if not isinstance(conversations, list) or not conversations or not all(
            isinstance(c, list) and c for c in conversations):
        raise RequestError("messages: must be a non-empty list of conversations, each a "
                           "non-empty list of messages", "messages")
    if len(conversations) > MAX_BATCH_PROMPTS:
        raise RequestError(f"messages: at most {MAX_BATCH_PROMPTS} conversations, got "
                           f"{len(conversations)}", "messages")
    if body.get("stream"):
        raise RequestError("stream: batch chat completions are not streamed", "stream")
    if body.get("tools"):
        raise RequestError("tools: batch chat completions take no tools", "tools")
    if body.get("tool_choice") not in (None, "none"):
        raise RequestError('tool_choice: batch chat completions take only "none"',
                           "tool_choice")
    if body.get("n") not in (None, 1):
        raise RequestError(f"n: batch chat completions take n = 1, got {body['n']!r}", "n")
    return conversations


async def serve_chat_batch(front, request: web.Request) -> web.Response:
    """``front``: the router's ``OpenAIFront``, whose chat path serves each conversation."""
    calls: list[LocalCall] = []
    req = None
    try:
        body = await front._body(request, chat=True)
        single = {k: v for k, v in body.items() if k not in ("tools", "tool_choice")}
        reqs = []
        for conversation in conversations_of(body):
            req = OpenAIRequest(single | {"messages": conversation}, chat=True,
                                model_name=front._check_model(body) or front.model_name,
                                **front._texts())
            (message,) = await front._generate_requests(req)
            reqs.append(req)
            calls.append(LocalCall(front.seam.generate, message,
                                   timeout_s=front.cfg.request_timeout_s,
                                   metadata=front._forwarded_metadata(request)))
        firsts = await asyncio.gather(*(call.read() for call in calls))
        answers = await asyncio.gather(*(
            collect_body(r, call, first, front._account)
            for r, call, first in zip(reqs, calls, firsts)))
        choices = []
        for k, answer in enumerate(answers):
            for choice in answer["choices"]:
                choices.append(choice | {"index": k})
        usage = {key: sum(a["usage"][key] for a in answers)
                 for key in ("prompt_tokens", "completion_tokens", "total_tokens")}
        cached = sum((a["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0)
                     for a in answers)
        return web.json_response(reqs[0].envelope(choices) | {
            "usage": usage | {"prompt_tokens_details": {"cached_tokens": cached}}})
    except Exception as e:  # noqa: BLE001 - every failure gets a JSON body
        return front._error(request, e, None if req is None else req.field_aliases)
    finally:
        for call in calls:
            await call.aclose()  # no-op once finished; aborts the engine request otherwise
