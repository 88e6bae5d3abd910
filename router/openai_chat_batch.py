"""vLLM's ``POST /v1/chat/completions/batch``: a chat completion request whose ``messages`` is a
list of conversations, answered as one chat completion with one choice per conversation
(``index`` k for conversation k) and their usage summed.

As vLLM 0.32 serves it, every other field applies to each conversation and ``n`` is 1; a
``stream`` or ``tools`` (which vLLM ignores there) is refused, not answered otherwise. Each
conversation is served by the chat path as its own request (template, grammar, flow control,
placement: conversations of one batch may run on different engines), all at once; a bad
conversation fails the whole batch with the error its own request gets.
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
    """``front``: the router's ``OpenAIFront``, whose chat path serves each conversation.

    Each conversation's call is read to its end by a task of its own, all at once: one still
    waiting for a flow-control slot gets it as the others finish (a batch that read every
    first message before any stream on held its own slots unread and waited for itself). One
    that fails cancels the others' tasks, and closing the calls aborts their engine requests."""
    calls: list[LocalCall] = []
    tasks: list[asyncio.Task] = []
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

        async def answer(r: OpenAIRequest, call: LocalCall) -> dict:
            return await collect_body(r, call, await call.read(), front._account)

        tasks = [asyncio.ensure_future(answer(r, call)) for r, call in zip(reqs, calls)]
        answers = await asyncio.gather(*tasks)
        choices = [choice | {"index": k}
                   for k, one in enumerate(answers) for choice in one["choices"]]
        usage = {key: sum(a["usage"][key] for a in answers)
                 for key in ("prompt_tokens", "completion_tokens", "total_tokens")}
        cached = sum((a["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0)
                     for a in answers)
        return web.json_response(reqs[0].envelope(choices) | {
            "usage": usage | {"prompt_tokens_details": {"cached_tokens": cached}}})
    except Exception as e:  # noqa: BLE001 - every failure gets a JSON body
        return front._error(request, e, None if req is None else req.field_aliases)
    finally:
        for task in tasks:  # (a failed or cancelled batch: the others stop reading first)
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for call in calls:
            await call.aclose()  # no-op once finished; aborts the engine request otherwise
