"""The Responses API's store (router.responses_store) and what it keeps of a response
(router.openai_responses: the conversation a following response continues, the input items);
served end to end in tests/e2e/test_openai_responses_store.py."""

from __future__ import annotations

import asyncio

from router.openai_responses import answer_message, chat_body, input_items
from router.responses_store import ResponsesStore, Stored, owner_of, size_of


def _entry(i: int, owner=None, status="completed", text="x" * 100) -> Stored:
    return Stored({"id": f"resp_{i}", "status": status, "output": text}, [], [], owner)


def test_least_recently_used_finished_responses_go_first_within_the_bound():
    size = size_of(*(lambda e: (e.response, e.conversation, e.input_items))(_entry(0)))
    store = ResponsesStore(max_bytes=3 * size)
    for i in range(3):
        assert store.put(_entry(i))
    assert store.get("resp_0", None) is not None  # now the most recently used
    assert store.put(_entry(3))
    assert store.get("resp_1", None) is None and len(store) == 3
    assert {e for e in ("resp_0", "resp_2", "resp_3") if store.get(e, None)} == \
        {"resp_0", "resp_2", "resp_3"}
    assert store.bytes == 3 * size


def test_a_running_background_response_is_never_dropped():
    size = size_of({"id": "resp_0", "status": "queued", "output": "x" * 100}, [], [])
    store = ResponsesStore(max_bytes=2 * size + 10)
    assert store.put(_entry(0, status="queued"))
    assert store.put(_entry(1))
    assert store.put(_entry(2))
    assert store.get("resp_0", None) is not None and store.get("resp_1", None) is None


def test_one_too_large_or_a_store_turned_off_keeps_nothing():
    assert not ResponsesStore(max_bytes=50).put(_entry(0))
    off = ResponsesStore(max_bytes=0)
    assert not off.enabled and not off.put(_entry(0)) and len(off) == 0


def test_a_finished_background_response_is_accounted_again():
    store = ResponsesStore(max_bytes=10_000)
    entry = _entry(0, status="queued", text="")
    store.put(entry)
    before = store.bytes
    entry.response = entry.response | {"status": "completed", "output": "y" * 500}
    store.resized(entry)
    assert store.bytes == before + 500 + len("completed") - len("queued")


def test_only_the_key_that_made_a_response_finds_it():
    store = ResponsesStore(max_bytes=10_000)
    a, b = owner_of("Bearer key-a"), owner_of("Bearer key-b")
    assert a != b and owner_of(None) is None and "key-a" not in a
    assert owner_of("bearer  key-a") == a  # the key, not how the header spells its scheme
    store.put(_entry(0, owner=a))
    assert store.get("resp_0", a) is not None
    assert store.get("resp_0", b) is None and store.get("resp_0", None) is None


def test_cancel_all_stops_the_running_tasks():
    async def run():
        store = ResponsesStore(max_bytes=10_000)
        entry = _entry(0, status="in_progress")
        entry.task = asyncio.create_task(asyncio.sleep(60))
        store.put(entry)
        tasks = store.cancel_all()
        await asyncio.gather(*tasks, return_exceptions=True)
        return tasks
    (task,) = asyncio.run(run())
    assert task.cancelled()


def test_history_goes_between_the_instructions_and_the_new_input():
    history = [{"role": "user", "content": "q1"}, {"role": "assistant", "content": "a1"}]
    body = chat_body({"input": "q2", "instructions": "Be brief."}, history)
    assert body["messages"] == [{"role": "system", "content": "Be brief."}, *history,
                                {"role": "user", "content": "q2"}]


def test_output_items_become_the_assistant_message_that_follows():
    text = {"type": "message", "content": [{"type": "output_text", "text": "Let me look."}]}
    call = {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"}
    assert answer_message([text]) == {"role": "assistant", "content": "Let me look."}
    assert answer_message([call]) == {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}
    assert answer_message([text, call])["content"] == "Let me look."


def test_input_items_are_listed_as_typed_items_with_ids():
    (item,) = input_items({"input": "hi"})
    assert item["type"] == "message" and item["role"] == "user"
    assert item["content"] == [{"type": "input_text", "text": "hi"}]
    assert item["id"].startswith("msg_")
    items = input_items({"input": [
        {"role": "assistant", "content": "ok"},
        {"type": "function_call_output", "call_id": "c1", "output": "one", "id": "mine"}]})
    assert items[0]["content"] == [{"type": "output_text", "text": "ok", "annotations": []}]
    assert items[1]["id"] == "mine"


def test_a_background_response_that_finishes_counts_as_used():
    """Finished, it is the most recently used: the next store drops another, not the one
    its client is about to poll."""
    size = size_of({"id": "resp_0", "status": "completed", "output": "x" * 100}, [], [])
    store = ResponsesStore(max_bytes=2 * size + 10)
    background = _entry(0, status="queued")
    store.put(background)
    store.put(_entry(1))
    background.response = background.response | {"status": "completed"}
    store.resized(background)
    assert store.put(_entry(2))
    assert store.get("resp_0", None) is background and store.get("resp_1", None) is None


def test_put_says_false_when_running_responses_leave_no_room():
    size = size_of({"id": "resp_0", "status": "queued", "output": "x" * 100}, [], [])
    store = ResponsesStore(max_bytes=size + 10)
    assert store.put(_entry(0, status="queued"))
    assert not store.put(_entry(1))  # evicted at once: the running one stays
    assert store.get("resp_1", None) is None and store.get("resp_0", None) is not None


def test_a_background_task_cancelled_before_it_starts_reads_cancelled():
    """Cancelled before its first step, the task's coroutine never runs (nor its finally):
    the done callback still marks the response cancelled, closes the call and frees it."""
    from router.openai_responses_serve import _ended

    class Call:
        closed = False

        async def aclose(self):
            Call.closed = True

    async def never_started():
        raise AssertionError("ran")

    async def run():
        store = ResponsesStore(max_bytes=10_000)
        entry = _entry(0, status="queued")
        store.put(entry)
        entry.task = asyncio.get_running_loop().create_task(never_started())
        entry.task.add_done_callback(lambda t: _ended(store, entry, Call(), t))
        entry.task.cancel()
        await asyncio.gather(entry.task, return_exceptions=True)
        await asyncio.sleep(0)
        return entry
    entry = asyncio.run(run())
    assert entry.response["status"] == "cancelled" and entry.task is None and Call.closed
