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


def test_a_running_background_response_is_never_dropped_nor_counted():
    """Running, it is outside the bound (flow control bounds how many run): finished
    responses are not dropped to make room for it, and it is never dropped itself."""
    size = size_of({"id": "resp_0", "status": "completed", "output": "x" * 100}, [], [])
    store = ResponsesStore(max_bytes=2 * size + 10)
    assert store.put(_entry(0, status="queued"))
    assert store.put(_entry(1)) and store.put(_entry(2)) and store.bytes == 2 * size
    assert store.put(_entry(3))
    assert store.get("resp_0", None) is not None and store.get("resp_1", None) is None
    assert store.get("resp_2", None) is not None and store.get("resp_3", None) is not None


def test_one_too_large_or_a_store_turned_off_keeps_nothing():
    assert not ResponsesStore(max_bytes=50).put(_entry(0))
    off = ResponsesStore(max_bytes=0)
    assert not off.enabled and not off.put(_entry(0)) and len(off) == 0


def test_a_finished_background_response_is_accounted_then():
    store = ResponsesStore(max_bytes=10_000)
    entry = _entry(0, status="queued", text="")
    store.put(entry)
    assert store.bytes == 0
    entry.response = entry.response | {"status": "completed", "output": "y" * 500}
    store.resized(entry)
    assert store.bytes == entry.size == size_of(entry.response, [], [])
    store.remove("resp_0")
    assert store.bytes == 0


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
    # ids that could not page are the server's: not strings, empty, or repeated
    items = input_items({"input": [{"role": "user", "content": c, "id": i} for c, i in
                                   (("a", "dup"), ("b", "dup"), ("c", None), ("d", 7),
                                    ("e", ""))]})
    ids = [item["id"] for item in items]
    assert ids[0] == "dup" and len(set(ids)) == 5 and all(isinstance(i, str) and i for i in ids)


def test_background_responses_that_finish_are_the_last_to_go():
    """Many running while the store is full (the probe's 12 at 20,000 bytes): each, once
    finished, is the most recently used, so the next to finish drops older finished ones,
    not itself: the last ones to finish are all still there to be polled."""
    size = size_of({"id": "resp_00", "status": "completed", "output": "x" * 100}, [], [])
    store = ResponsesStore(max_bytes=3 * size + 10)
    running = [_entry(10 + i, status="queued") for i in range(12)]
    for entry in running:
        assert store.put(entry)
    for i in range(5):
        assert store.put(_entry(100 + i))  # finished foreground answers meanwhile
    for entry in running:
        entry.response = entry.response | {"status": "completed"}
        store.resized(entry)
        assert store.get(entry.response["id"], None) is entry  # there when first polled
    assert [store.get(f"resp_{10 + i}", None) is not None for i in range(12)] == \
        [False] * 9 + [True] * 3


def test_put_says_false_for_one_over_the_bound_alone():
    size = size_of({"id": "resp_0", "status": "completed", "output": "x" * 100}, [], [])
    store = ResponsesStore(max_bytes=size - 1)
    assert not store.put(_entry(0)) and store.get("resp_0", None) is None and len(store) == 0


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
