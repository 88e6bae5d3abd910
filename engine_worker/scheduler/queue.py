"""Waiting queues (admission order) and the matching preemption-victim rule, by policy name."""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Iterator

from engine_worker.request import Request


class FCFSQueue:
    """First come, first served. Preempted requests go back to the front; the victim of a
    preemption is the most recently admitted running request."""

    def __init__(self) -> None:
        self._queue: deque[Request] = deque()

    def add(self, request: Request) -> None:
        self._queue.append(request)

    def add_preempted(self, request: Request) -> None:
        self._queue.appendleft(request)

    def peek(self) -> Request:
        return self._queue[0]

    def pop(self) -> Request:
        return self._queue.popleft()

    def remove(self, request: Request) -> None:
        self._queue.remove(request)

    def __len__(self) -> int:
        return len(self._queue)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._queue)

    @staticmethod
    def pick_victim(running: list[Request]) -> Request:
        return max(running, key=lambda r: r.admit_seq)


class PriorityQueue:
    """Lowest ``priority`` value first, then earliest arrival. The victim of a preemption is
    the running request with the highest priority value (latest arrival breaks ties)."""

    def __init__(self) -> None:
        self._heap: list[tuple[int, float, int, Request]] = []
        self._counter = itertools.count()

    def add(self, request: Request) -> None:
        heapq.heappush(self._heap,
                       (request.priority, request.arrival_time, next(self._counter), request))

    add_preempted = add

    def peek(self) -> Request:
        return self._heap[0][3]

    def pop(self) -> Request:
        return heapq.heappop(self._heap)[3]

    def remove(self, request: Request) -> None:
        self._heap = [item for item in self._heap if item[3] is not request]
        heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator[Request]:
        return (item[3] for item in sorted(self._heap))

    @staticmethod
    def pick_victim(running: list[Request]) -> Request:
        return max(running, key=lambda r: (r.priority, r.arrival_time, r.admit_seq))


QUEUE_POLICIES: dict[str, type] = {"fcfs": FCFSQueue, "priority": PriorityQueue}
