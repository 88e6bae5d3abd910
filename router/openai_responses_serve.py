"""The Responses API's routes on the router's HTTP front (``router.openai_api`` registers them):

- ``POST /v1/responses``: translated into the chat completion it means
  (``router.openai_responses``) and served by the chat path; with ``store`` (the default) the
  answer is kept (``router.responses_store``), and ``previous_response_id`` continues a kept
  one's conversation (its input and answer, not its ``instructions``, as OpenAI documents);
- ``background: true``: answered at once with a ``queued`` Response, served by a task that
  ``GET`` polls and ``POST /v1/responses/{id}/cancel`` stops (as vLLM serves it);
- ``GET`` / ``DELETE /v1/responses/{id}`` and ``GET /v1/responses/{id}/input_items``
  (``limit``, ``order``, ``after``, as OpenAI pages them).

An unknown id, or one another API key created, is a 404 naming it.
"""

from __future__ import annotations

import asyncio
import json
from functools import partial
from typing import TYPE_CHECKING

from aiohttp import web

from router.local_call import LocalCall
from router.openai_answer import OpenAIRequest
from router.openai_protocol import RequestError, error_response, shown
from router.openai_responses import (ALIASES, RESPONSES_FIELDS, ResponsesAnswer, answer_message,
                                     chat_body, input_items, renamed)
from router.responses_store import ResponsesStore, Stored, owner_of

if TYPE_CHECKING:
    from router.openai_api import OpenAIFront

_FINISHED = ("completed", "incomplete")
# a failed background response's error.code (OpenAI's names), by HTTP status
_ERROR_CODES = {429: "rate_limit_exceeded"}


def _owner(front: OpenAIFront, request: web.Request) -> str | None:
    if not front.seam.keys.enabled:
        return None
    return owner_of(request.headers.get("Authorization"))


def _not_found(response_id: str, param: str) -> RequestError:
    return RequestError(f"Response with id {shown(response_id)} not found.", param, 404)


def _history(store: ResponsesStore, body: dict, owner: str | None) -> list[dict]:
    """The conversation ``previous_response_id`` continues (empty without one)."""
    previous = body.get("previous_response_id")
    if previous is None:
        return []
    if not isinstance(previous, str):
        raise RequestError(f"previous_response_id: must be a string, got {shown(previous)}",
                           "previous_response_id")
    entry = store.get(previous, owner)
    if entry is None:
        raise _not_found(previous, "previous_response_id")
    status = entry.response.get("status")
    if status not in _FINISHED:
        raise RequestError(f"previous_response_id: response {shown(previous)} is {status}; "
                           "only a completed or incomplete one can be continued",
                           "previous_response_id")
    return list(entry.conversation)


def _check_background(store: ResponsesStore, body: dict) -> bool:
    if body.get("background") is not True:
        return False
    if body.get("store") is False:
        raise RequestError("background: needs store (a background response is read back by "
                           "its id)", "background")
    if not store.enabled:
        raise RequestError("background: needs the router's responses store, which is off "
                           "(--responses-store-bytes 0)", "background")
    if body.get("stream"):
        raise RequestError("stream: is not supported with background (poll GET "
                           "/v1/responses/{id})", "stream")
    return True


async def create(front: OpenAIFront, request: web.Request) -> web.StreamResponse:
    """``POST /v1/responses``."""
    call = req = chat = None
    store = front.responses
    try:
        body = await front._body(request, known=RESPONSES_FIELDS)
        owner = _owner(front, request)
        history = _history(store, body, owner)
        chat = chat_body(body, history)
        background = _check_background(store, body)
        req = OpenAIRequest(chat, chat=True, model_name=front._check_model(chat) or
                            front.model_name, **front._texts())
        (message,) = await front._generate_requests(req)
        kept = body.get("store") is not False and store.enabled
        answer = ResponsesAnswer(body, req, req.model_name, store=kept)
        message.request_id = answer.id  # the id logs, traces and /debug/decisions show
        call = LocalCall(front.seam.generate, message, timeout_s=front.cfg.request_timeout_s,
                         metadata=front._forwarded_metadata(request))
        # what a following response continues: chat's messages less the instructions
        conversation = chat["messages"][0 if body.get("instructions") is None else 1:]
        if background:
            entry = Stored(answer.response("queued", []), conversation, input_items(body), owner)
            if not store.put(entry):
                raise RequestError(f"input: too large to keep in the responses store (at most "
                                   f"{store.max_bytes} bytes)", "input")
            entry.task = asyncio.create_task(_run(front, entry, answer, call))
            entry.task.add_done_callback(partial(_ended, store, entry, call))
            call = None  # the task owns it now
            return web.json_response(entry.response)
        if kept:  # kept before the last event is written: a client that read it finds it
            def keep(final: dict) -> None:
                entry = Stored(final, conversation + [answer_message(final["output"])],
                               input_items(body), owner)
                final["store"] = store.put(entry)  # false when the bound left no room
            answer.on_final = keep
        first = await call.read()  # errors before any output keep their HTTP status
        if body.get("stream"):
            return await answer.stream(request, call, first, front._account)
        return await answer.collect(call, first, front._account)
    except Exception as e:  # noqa: BLE001 - every failure gets a JSON body
        if chat is None:  # the Responses body's own checks: named as it names them
            return front._error(request, e)
        return front._error(request, renamed(e), _aliases(req))
    finally:
        if call is not None:
            await call.aclose()


def _aliases(req: OpenAIRequest | None) -> dict[str, str]:
    """Chat's (and the engine's) names of fields -> the Responses request's."""
    return ALIASES | ({} if req is None else {
        k: ALIASES.get(v, v) for k, v in req.field_aliases.items()})


async def _run(front: OpenAIFront, entry: Stored, answer: ResponsesAnswer,
               call: LocalCall) -> None:
    """A background response: served, its stored Response updated as it goes."""
    try:
        first = await call.read()
        entry.response = entry.response | {"status": "in_progress"}
        final = await answer.result(call, first, front._account)
        entry.response = final
        entry.conversation.append(answer_message(final["output"]))
    except Exception as e:  # noqa: BLE001 - the failure is the stored response's error
        error = json.loads(error_response(renamed(e), _aliases(answer.req)).body)["error"]
        code = _ERROR_CODES.get(error["code"], "invalid_prompt" if error["code"] < 500
                                else "server_error")
        entry.response = entry.response | {"status": "failed", "error": {
            "code": code, "message": error["message"], "param": error["param"]}}
    finally:
        await call.aclose()


def _ended(store: ResponsesStore, entry: Stored, call: LocalCall, task: asyncio.Task) -> None:
    """A background task's end, however it ended: cancelled ones (before they started too,
    when the coroutine never ran) read ``cancelled``; the store accounts the final size."""
    if task.cancelled():
        if entry.running:
            entry.response = entry.response | {"status": "cancelled"}
        asyncio.ensure_future(call.aclose())  # a no-op once the call ended
    entry.task = None
    store.resized(entry)


def _entry(front: OpenAIFront, request: web.Request) -> Stored:
    response_id = request.match_info["response_id"]
    entry = front.responses.get(response_id, _owner(front, request))
    if entry is None:
        raise _not_found(response_id, "response_id")
    return entry


async def retrieve(front: OpenAIFront, request: web.Request) -> web.Response:
    """``GET /v1/responses/{id}``: the stored Response (a background one as it stands)."""
    try:
        if request.query.get("stream", "false").lower() not in ("false", "0"):
            raise RequestError("stream: resuming a stream is not supported; GET without it "
                               "returns the response as it stands", "stream")
        return web.json_response(_entry(front, request).response)
    except RequestError as e:
        return error_response(e)


async def delete(front: OpenAIFront, request: web.Request) -> web.Response:
    """``DELETE /v1/responses/{id}`` (a background one still running is stopped)."""
    try:
        entry = _entry(front, request)
    except RequestError as e:
        return error_response(e)
    front.responses.remove(entry.response["id"])
    if entry.task is not None:
        entry.task.cancel()
    return web.json_response({"id": entry.response["id"], "object": "response",
                              "deleted": True})


async def cancel(front: OpenAIFront, request: web.Request) -> web.Response:
    """``POST /v1/responses/{id}/cancel``: a queued or running background response stops and
    reads ``cancelled``; any other is a 400, as vLLM answers."""
    try:
        entry = _entry(front, request)
        if not entry.running or entry.task is None:
            raise RequestError(f"response_id: response {shown(entry.response['id'])} is "
                               f"{entry.response.get('status')}: only a queued or in_progress "
                               "background response can be cancelled", "response_id")
    except RequestError as e:
        return error_response(e)
    # cancelled from here on (a second cancel, sent meanwhile, is the 400 of a finished one)
    entry.response = entry.response | {"status": "cancelled"}
    task = entry.task
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    return web.json_response(entry.response)


async def list_input_items(front: OpenAIFront, request: web.Request) -> web.Response:
    """``GET /v1/responses/{id}/input_items``: the request's input items, a page at a time
    (``limit`` 1-100, default 20; ``order`` desc, the default, or asc; ``after`` an item id)."""
    try:
        entry = _entry(front, request)
        query = request.query
        raw = query.get("limit", "20")
        limit = int(raw) if raw.isascii() and raw.isdigit() and len(raw) <= 3 else 0
        if not 1 <= limit <= 100:
            raise RequestError(f"limit: must be an integer in [1, 100], got "
                               f"{shown(query.get('limit'))}", "limit")
        order = query.get("order", "desc")
        if order not in ("asc", "desc"):
            raise RequestError(f"order: must be asc or desc, got {shown(order)}", "order")
        items = entry.input_items if order == "asc" else entry.input_items[::-1]
        after = query.get("after")
        if after is not None:
            ids = [item["id"] for item in items]
            if after not in ids:
                raise RequestError(f"after: no input item {shown(after)} in this response",
                                   "after")
            items = items[ids.index(after) + 1:]
    except RequestError as e:
        return error_response(e)
    page = items[:limit]
    return web.json_response({"object": "list", "data": page,
                              "first_id": page[0]["id"] if page else None,
                              "last_id": page[-1]["id"] if page else None,
                              "has_more": len(items) > limit})
