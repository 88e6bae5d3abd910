"""One request's DELTA outputs on their way from the engine loop to its gRPC stream.

The engine makes one output per request per step; the stream sends one message per output it
takes. When the stream is slower than the engine (a slow client, a busy event loop, a full
socket), outputs that wait are merged into one, so a lagging consumer costs one message (one
protobuf, one write, one SSE chunk further on) per turn instead of one per step, and it catches
up instead of falling further behind. Merging is lossless: the text, token ids and logprobs of
the merged output are those of the parts, concatenated (vLLM's API server merges the same way).
"""

from __future__ import annotations

import asyncio
import dataclasses

from engine_worker.outputs import CompletionOutput, RequestOutput


def _concat(a: list | None, b: list | None) -> list | None:
    if a is None:
        return b
    if b is None:
        return a
    return a + b


def merge_completions(a: CompletionOutput, b: CompletionOutput) -> CompletionOutput:
    """``a`` then ``b``, two DELTAs of the same completion, as one DELTA."""
    return CompletionOutput(index=a.index, text=a.text + b.text,
                            token_ids=a.token_ids + b.token_ids,
                            cumulative_logprob=b.cumulative_logprob,
                            logprobs=_concat(a.logprobs, b.logprobs),
                            finish_reason=b.finish_reason, stop_reason=b.stop_reason)


def merge_deltas(a: RequestOutput, b: RequestOutput) -> RequestOutput:
    """``a`` then ``b``, two DELTA outputs of the same request, as one DELTA output.

    A DELTA output carries only the completions that changed in its step; the merge carries
    every completion that changed in either, in index order."""
    assert a.request_id == b.request_id and not a.finished, "merging past a request's end"
    by_index = {c.index: c for c in a.outputs}
    for completion in b.outputs:
        earlier = by_index.get(completion.index)
        by_index[completion.index] = (completion if earlier is None
                                      else merge_completions(earlier, completion))
    return dataclasses.replace(
        b, outputs=[by_index[i] for i in sorted(by_index)],
        prompt_logprobs=_concat(a.prompt_logprobs, b.prompt_logprobs))


class OutputCollector:
    """Holds what one request's stream has not taken yet: at most one (merged) output, then
    the end (an exception) if one came. Used from the event loop's thread only."""

    __slots__ = ("_output", "_error", "_ready")

    def __init__(self) -> None:
        self._output: RequestOutput | None = None
        self._error: BaseException | None = None
        self._ready = asyncio.Event()

    def put(self, output: RequestOutput) -> None:
        self._output = output if self._output is None else merge_deltas(self._output, output)
        self._ready.set()

    def fail(self, error: BaseException) -> None:
        """End the stream with ``error`` once the outputs before it are taken."""
        self._error = error
        self._ready.set()

    async def get(self) -> RequestOutput:
        """The outputs since the last call, merged; raises the error after the last output."""
        while self._output is None and self._error is None:
            self._ready.clear()
            await self._ready.wait()
        output, self._output = self._output, None
        if output is not None:
            return output
        raise self._error
