"""The Responses API's stored responses: what ``previous_response_id``, ``GET`` /
``DELETE /v1/responses/{id}``, ``/input_items`` and background responses read.

Kept in memory in the router process that answered, bounded in bytes of JSON
(``--responses-store-bytes``, 16 MiB: about 4.5x that in Python objects; 0 turns storing off,
as vLLM runs unless ``VLLM_ENABLE_RESPONSES_API_STORE`` is set). When the bound is reached the
least recently used finished responses go first. A background response counts once it has
finished (its finish is a use: it is then the last to go, so the client polling for it finds
it); while it runs it is never dropped, and flow control bounds how many run. With API keys
on, a response is visible only under the key that created it (kept as its SHA-256), so one
tenant cannot read another's by id. Several router replicas do not share their stores: a client
that chains responses needs to reach the same replica (the chart's
``router.service.sessionAffinity``).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
from collections import OrderedDict
from dataclasses import dataclass, field


def owner_of(authorization: str | None) -> str | None:
    """Whose a response is: the SHA-256 of the API key in an ``Authorization: Bearer`` header
    (None without one). The front asks only when API keys are on: without them every client
    reads every response, as vLLM's store serves them."""
    if not authorization:
        return None
    scheme, _, token = authorization.strip().partition(" ")
    key = token.strip() if scheme.lower() == "bearer" else authorization.strip()
    return hashlib.sha256(key.encode()).hexdigest()


def size_of(*values) -> int:
    return sum(len(json.dumps(v, separators=(",", ":"))) for v in values)


@dataclass(slots=True)
class Stored:
    """One stored response: its Response object (updated in place while a background one
    runs), the conversation it ends (chat messages, its own answer last, without
    ``instructions``: they are not carried into a following response, as OpenAI documents),
    its input items as listed by ``/input_items``, and its task while a background one runs."""

    response: dict
    conversation: list[dict]
    input_items: list[dict]
    owner: str | None = None
    task: asyncio.Task | None = None
    size: int = 0
    counted: bool = False  # its size is in the store's bytes (a finished response's is)

    @property
    def running(self) -> bool:
        return self.response.get("status") in ("queued", "in_progress")


@dataclass(slots=True)
class ResponsesStore:
    """Stored responses by id, least recently used first."""

    max_bytes: int
    _entries: OrderedDict[str, Stored] = field(default_factory=OrderedDict)
    _bytes: int = 0

    @property
    def enabled(self) -> bool:
        return self.max_bytes > 0

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def bytes(self) -> int:
        return self._bytes

    def put(self, entry: Stored) -> bool:
        """Keep ``entry`` (replacing one of its id); False when it is not kept (alone over the
        bound)."""
        response_id = entry.response["id"]
        self.remove(response_id)
        entry.size = size_of(entry.response, entry.conversation, entry.input_items)
        if not self.enabled or entry.size > self.max_bytes:
            return False
        self._entries[response_id] = entry
        self._count(entry)
        self._shrink()
        return response_id in self._entries

    def resized(self, entry: Stored) -> None:
        """Account ``entry`` again after its response changed (a background one finished:
        that counts as a use, so the client polling for it finds it)."""
        response_id = entry.response["id"]
        if self._entries.get(response_id) is not entry:
            return
        if entry.counted:
            self._bytes -= entry.size
        entry.size = size_of(entry.response, entry.conversation, entry.input_items)
        self._entries.move_to_end(response_id)
        self._count(entry)
        self._shrink()

    def _count(self, entry: Stored) -> None:
        entry.counted = not entry.running
        if entry.counted:
            self._bytes += entry.size

    def get(self, response_id: str, owner: str | None) -> Stored | None:
        """The response of that id created by ``owner``, or None (also for another owner's:
        the two are not told apart)."""
        entry = self._entries.get(response_id)
        if entry is None or entry.owner != owner:
            return None
        self._entries.move_to_end(response_id)
        return entry

    def remove(self, response_id: str) -> Stored | None:
        entry = self._entries.pop(response_id, None)
        if entry is not None and entry.counted:
            self._bytes -= entry.size
        return entry

    def _shrink(self) -> None:
        """Drop finished responses, least recently used first, until within the bound."""
        while self._bytes > self.max_bytes:
            oldest = next((i for i, e in self._entries.items() if not e.running), None)
            if oldest is None:
                return
            self.remove(oldest)

    def cancel_all(self) -> list[asyncio.Task]:
        """Cancel every background response still running (the router is stopping)."""
        tasks = [e.task for e in self._entries.values() if e.task and not e.task.done()]
        for task in tasks:
            task.cancel()
        return tasks
