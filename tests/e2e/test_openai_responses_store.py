"""The Responses API's stored responses through the router, read by the official ``openai``
client: ``previous_response_id`` continues a conversation as chat would serve it whole,
``GET`` / ``DELETE`` / ``input_items`` read the store, ``background`` responses run on and are
polled or cancelled, and another API key's responses are not found. Real router + two real
engines (the stack of test_router_openai), and routers of their own for keys, a store turned
off and one flow-control slot."""

from __future__ import annotations

import json
import threading
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from tests.e2e import test_router_openai as base
from tests.e2e.router_harness import TIMEOUT_S, RunningRouter, address, request, wait_for
from tests.e2e.test_openai_responses import TOOLS, WEATHER

engines, router, front, client = base.engines, base.router, base.front, base.client
MODEL, _http = base.MODEL, base._http


def _chat(client, messages, **kwargs):
    return client.chat.completions.create(model=MODEL, messages=messages, temperature=0,
                                          **kwargs)


def _respond(client, **kwargs):
    return client.responses.create(model=MODEL, temperature=0, max_output_tokens=8, **kwargs)


@pytest.mark.parametrize("stream", [False, True])
def test_previous_response_id_continues_the_conversation_as_chat_serves_it(client, stream):
    """The second answer is what chat answers for the whole conversation: the first input,
    the first answer, the new input; the first response's instructions are not carried (as
    OpenAI documents), the second's are; a streamed first answer is stored as well."""
    if stream:
        first = list(client.responses.create(
            model=MODEL, temperature=0, max_output_tokens=8, input="My name is Ada.",
            instructions="Be brief.", stream=True))[-1].response
    else:
        first = _respond(client, input="My name is Ada.", instructions="Be brief.")
    assert first.store is True and first.previous_response_id is None
    second = _respond(client, input="What is my name?", previous_response_id=first.id,
                      instructions="Answer in one word.")
    assert second.previous_response_id == first.id
    chat = _chat(client, [{"role": "system", "content": "Answer in one word."},
                          {"role": "user", "content": "My name is Ada."},
                          {"role": "assistant", "content": first.output_text},
                          {"role": "user", "content": "What is my name?"}], max_tokens=8)
    assert second.output_text == chat.choices[0].message.content
    assert second.usage.input_tokens == chat.usage.prompt_tokens
    third = _respond(client, input="Say it again.", previous_response_id=second.id)
    chat = _chat(client, [{"role": "user", "content": "My name is Ada."},
                          {"role": "assistant", "content": first.output_text},
                          {"role": "user", "content": "What is my name?"},
                          {"role": "assistant", "content": second.output_text},
                          {"role": "user", "content": "Say it again."}], max_tokens=8)
    assert third.output_text == chat.choices[0].message.content


def test_a_function_call_is_answered_through_previous_response_id(client):
    """The call's output is sent alone, after the response that made the call: the model
    reads the conversation chat would render (the assistant's tool_calls, then the tool)."""
    asked = "Weather in Paris for 2 days?"
    first = client.responses.create(model=MODEL, input=asked, tools=TOOLS, temperature=0,
                                    tool_choice="required", parallel_tool_calls=False,
                                    max_output_tokens=60)
    (call,) = [item for item in first.output if item.type == "function_call"]
    assert set(json.loads(call.arguments)) == set(WEATHER["required"])
    follow = client.responses.create(
        model=MODEL, tools=TOOLS, temperature=0, max_output_tokens=8,
        previous_response_id=first.id,
        input=[{"type": "function_call_output", "call_id": call.call_id,
                "output": "Sunny, 20 C."}])
    chat = _chat(client, [
        {"role": "user", "content": asked},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": call.call_id, "type": "function",
             "function": {"name": call.name, "arguments": call.arguments}}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": "Sunny, 20 C."}],
        tools=[{"type": "function", "function": {"name": "get_weather",
                                                 "description": "The forecast",
                                                 "parameters": WEATHER}}], max_tokens=8)
    assert follow.usage.input_tokens == chat.usage.prompt_tokens
    text = chat.choices[0].message.content or ""
    assert follow.output_text == text or follow.output[-1].type == "function_call"


def test_retrieve_input_items_and_delete(client):
    items = [{"role": "developer", "content": "Answer in one word."},
             {"role": "user", "content": [{"type": "input_text", "text": "Sky colour?"}]},
             {"type": "message", "role": "assistant",
              "content": [{"type": "output_text", "text": "Blue."}]},
             {"role": "user", "content": "And grass?"}]
    answer = _respond(client, input=items)
    got = client.responses.retrieve(answer.id)
    assert got.model_dump() == answer.model_dump()
    listed = client.responses.input_items.list(answer.id, order="asc")
    texts = [item.content[0].text for item in listed.data]
    assert texts == ["Answer in one word.", "Sky colour?", "Blue.", "And grass?"]
    assert [item.role for item in listed.data] == ["developer", "user", "assistant", "user"]
    assert len({item.id for item in listed.data}) == 4
    newest_first = client.responses.input_items.list(answer.id)  # OpenAI's default: desc
    assert [item.content[0].text for item in newest_first.data] == texts[::-1]
    paged = client.responses.input_items.list(answer.id, order="asc", limit=1)
    assert [item.content[0].text for item in paged] == texts  # the client follows `after`
    dup = _respond(client, input=[{"role": "user", "content": c, "id": "dup"} for c in "abc"])
    pages = client.responses.input_items.list(dup.id, order="asc", limit=1)
    assert [item.content[0].text for item in pages] == ["a", "b", "c"]  # ends, in order
    client.responses.delete(answer.id)
    with pytest.raises(openai.NotFoundError, match=answer.id):
        client.responses.retrieve(answer.id)
    with pytest.raises(openai.NotFoundError) as error:
        _respond(client, input="More?", previous_response_id=answer.id)
    assert error.value.body["param"] == "previous_response_id"


def test_store_false_keeps_nothing(client):
    answer = _respond(client, input="Hello.", store=False)
    assert answer.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(answer.id)


def test_a_background_response_is_polled_to_the_same_answer(client):
    whole = _respond(client, input="Name a fruit.")
    queued = _respond(client, input="Name a fruit.", background=True)
    assert queued.status == "queued" and queued.background is True
    assert wait_for(lambda: client.responses.retrieve(queued.id).status not in
                    ("queued", "in_progress"), timeout_s=TIMEOUT_S)
    done = client.responses.retrieve(queued.id)
    assert done.status == whole.status and done.output_text == whole.output_text
    assert done.usage.output_tokens == whole.usage.output_tokens
    with pytest.raises(openai.BadRequestError, match="in_progress background"):
        client.responses.cancel(done.id)  # finished: as vLLM answers
    follow = _respond(client, input="Another.", previous_response_id=done.id)
    assert follow.status in ("completed", "incomplete")


@pytest.mark.parametrize("method, path, body, status, param", [
    ("POST", "/v1/responses", {"input": "hi", "previous_response_id": "resp_nope"}, 404,
     "previous_response_id"),
    ("POST", "/v1/responses", {"input": "hi", "previous_response_id": 7}, 400,
     "previous_response_id"),
    ("POST", "/v1/responses", {"input": "hi", "background": True, "store": False}, 400,
     "background"),
    ("POST", "/v1/responses", {"input": "hi", "background": True, "stream": True}, 400,
     "stream"),
    ("POST", "/v1/responses", {"input": "hi", "background": "yes"}, 400, "background"),
    ("GET", "/v1/responses/resp_nope", None, 404, "response_id"),
    ("DELETE", "/v1/responses/resp_nope", None, 404, "response_id"),
    ("POST", "/v1/responses/resp_nope/cancel", None, 404, "response_id"),
    ("GET", "/v1/responses/resp_nope/input_items", None, 404, "response_id"),
])
def test_bad_store_requests_name_the_field(front, method, path, body, status, param):
    got, text = _http(front, method, path, None if body is None else {"model": MODEL, **body})
    assert got == status and json.loads(text)["error"]["param"] == param, text


@pytest.mark.parametrize("query, param", [("limit=0", "limit"), ("limit=x", "limit"),
                                          ("order=up", "order"), ("after=msg_x", "after")])
def test_bad_input_item_pages_name_the_parameter(client, front, query, param):
    answer = _respond(client, input="Hi.")
    got, text = _http(front, "GET", f"/v1/responses/{answer.id}/input_items?{query}")
    assert got == 400 and json.loads(text)["error"]["param"] == param, text
    got, text = _http(front, "POST", f"/v1/responses/{answer.id}/cancel")
    assert got == 400 and json.loads(text)["error"]["param"] == "response_id", text


def test_another_api_key_does_not_find_a_response(engines):
    keyed = RunningRouter([address(e) for e in engines], http_port=0, model_name=MODEL,
                          api_keys="key-a,key-b")
    try:
        url = f"http://127.0.0.1:{keyed.server.front.port}/v1"
        with openai.OpenAI(base_url=url, api_key="key-a", max_retries=0,
                           timeout=TIMEOUT_S) as a, \
                openai.OpenAI(base_url=url, api_key="key-b", max_retries=0,
                              timeout=TIMEOUT_S) as b:
            answer = _respond(a, input="A secret.")
            assert a.responses.retrieve(answer.id).id == answer.id
            with pytest.raises(openai.NotFoundError):
                b.responses.retrieve(answer.id)
            with pytest.raises(openai.NotFoundError):
                _respond(b, input="What was it?", previous_response_id=answer.id)
            with pytest.raises(openai.NotFoundError):
                b.responses.delete(answer.id)
            assert a.responses.retrieve(answer.id).id == answer.id
    finally:
        keyed.close()


def test_a_router_with_its_store_off_keeps_nothing_and_refuses_background(engines):
    """``--responses-store-bytes 0``, as vLLM runs by default: ``store`` is answered false
    (the request is served), a background request is a 400 naming it."""
    off = RunningRouter([address(engines[0])], http_port=0, model_name=MODEL,
                        responses_store_bytes=0)
    try:
        with openai.OpenAI(base_url=f"http://127.0.0.1:{off.server.front.port}/v1",
                           api_key="x", max_retries=0, timeout=TIMEOUT_S) as c:
            answer = _respond(c, input="Hello.")
            assert answer.store is False
            with pytest.raises(openai.NotFoundError):
                c.responses.retrieve(answer.id)
            with pytest.raises(openai.BadRequestError) as error:
                _respond(c, input="Hello.", background=True)
            assert error.value.body["param"] == "background"
    finally:
        off.close()


def _placed(front) -> set[str]:
    """The request ids the router's decision log holds (a Responses request's is its id)."""
    status, text = _http(front, "GET", "/debug/decisions?limit=1000")
    assert status == 200, text
    return {d["request_id"] for d in json.loads(text)["decisions"]}


def test_a_queued_background_response_is_cancelled_and_never_runs(engines):
    """With the one flow-control slot held by a long gRPC request, a background response
    waits in the router's queue: it reads queued, cancel makes it cancelled, it is never
    placed on an engine (the decision log, which names a placed Responses request by its
    id, has no entry for it once the slot is free), and nothing is left on the engine."""
    one_slot = RunningRouter([address(engines[0])], http_port=0, model_name=MODEL,
                             flow={"engine_slots": 1})
    try:
        holder = threading.Thread(target=lambda: list(one_slot.stub.Generate(
            request(list(range(100, 140)), max_tokens=600), timeout=TIMEOUT_S)))
        holder.start()
        assert wait_for(lambda: engines[0].load.num_running == 1)
        with openai.OpenAI(base_url=f"http://127.0.0.1:{one_slot.server.front.port}/v1",
                           api_key="x", max_retries=0, timeout=TIMEOUT_S) as c:
            queued = _respond(c, input="Name a fruit.", background=True)
            assert c.responses.retrieve(queued.id).status == "queued"
            with ThreadPoolExecutor(4) as pool:  # at once: one cancels, the others are 400s
                answers = list(pool.map(lambda _: _http(
                    one_slot.server.front, "POST", f"/v1/responses/{queued.id}/cancel"),
                    range(4)))
            assert sorted(status for status, _ in answers) == [200, 400, 400, 400], answers
            cancelled = c.responses.retrieve(queued.id)
            assert cancelled.status == "cancelled" and cancelled.usage is None
            holder.join(TIMEOUT_S)
            after = _respond(c, input="Name a fruit.", background=True)  # the next in line
            assert wait_for(lambda: after.id in _placed(one_slot.server.front))
            assert queued.id not in _placed(one_slot.server.front)
            got = c.responses.retrieve(queued.id)
            assert got.status == "cancelled" and got.output == []
        assert wait_for(lambda: engines[0].holds_no_request())
    finally:
        one_slot.close()
