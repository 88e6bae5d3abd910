"""The per-request output collector: merging DELTA outputs while a stream lags is lossless."""

from __future__ import annotations

import asyncio

import pytest

from engine_worker.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from engine_worker.server.collector import OutputCollector, merge_deltas


def _delta(token_ids, texts, *, index=0, finish=None, logprobs=True, prompt_logprobs=None,
           finished=None, cached=0, t=0.0):
    lps = [{t: Logprob(-0.1 * t, rank=1, decoded_token=s)} for t, s in zip(token_ids, texts)] \
        if logprobs else None
    completion = CompletionOutput(index=index, text="".join(texts), token_ids=list(token_ids),
                                  cumulative_logprob=-float(sum(token_ids)), logprobs=lps,
                                  finish_reason=finish, stop_reason="x" if finish else None)
    return RequestOutput(request_id="r", prompt=None, prompt_token_ids=[1, 2],
                         outputs=[completion],
                         finished=finish is not None if finished is None else finished,
                         prompt_logprobs=prompt_logprobs, num_cached_tokens=cached,
                         metrics=RequestMetrics(arrival_time=t))


def test_merge_concatenates_text_tokens_and_logprobs_and_keeps_the_latest_state():
    a = _delta([5, 6], ["a", "b"], prompt_logprobs=[None])
    b = _delta([7], ["c"], finish="stop", prompt_logprobs=[{2: Logprob(-1.0)}], cached=16, t=3.0)
    merged = merge_deltas(a, b)
    [c] = merged.outputs
    assert (c.token_ids, c.text) == ([5, 6, 7], "abc")
    assert c.logprobs == a.outputs[0].logprobs + b.outputs[0].logprobs
    assert (c.cumulative_logprob, c.finish_reason, c.stop_reason) == (-7.0, "stop", "x")
    assert merged.finished and merged.num_cached_tokens == 16
    assert merged.prompt_logprobs == [None, {2: Logprob(-1.0)}]
    assert merged.metrics.arrival_time == 3.0
    assert (a.outputs[0].token_ids, a.outputs[0].text) == ([5, 6], "ab")  # parts untouched


def test_merge_keeps_completions_that_changed_in_either_part_in_index_order():
    a = _delta([5], ["a"], index=1, logprobs=False)
    b = _delta([9], ["z"], index=0, logprobs=False)
    b.outputs.append(_delta([6], ["b"], index=1, logprobs=False).outputs[0])
    merged = merge_deltas(a, b)
    assert [(c.index, c.token_ids, c.text, c.logprobs) for c in merged.outputs] == \
        [(0, [9], "z", None), (1, [5, 6], "ab", None)]


def test_a_lagging_stream_takes_every_waiting_output_as_one():
    async def run():
        collector = OutputCollector()
        parts = [_delta([i], [chr(97 + i)]) for i in range(4)]
        parts.append(_delta([4], ["e"], finish="length"))
        for part in parts[:2]:
            collector.put(part)
        first = await collector.get()
        for part in parts[2:]:
            collector.put(part)
        second = await collector.get()
        return first, second
    first, second = asyncio.run(run())
    assert (first.outputs[0].token_ids, first.outputs[0].text) == ([0, 1], "ab")
    assert not first.finished
    assert (second.outputs[0].token_ids, second.outputs[0].text) == ([2, 3, 4], "cde")
    assert second.finished and second.outputs[0].finish_reason == "length"


def test_an_error_ends_the_stream_after_the_outputs_before_it():
    async def run():
        collector = OutputCollector()
        waiter = asyncio.ensure_future(collector.get())
        await asyncio.sleep(0)
        assert not waiter.done()  # nothing yet: get() waits
        collector.put(_delta([1], ["a"]))
        got = await waiter
        collector.put(_delta([2], ["b"]))
        collector.fail(RuntimeError("engine died"))
        second = await collector.get()
        with pytest.raises(RuntimeError, match="engine died"):
            await collector.get()
        return got, second
    got, second = asyncio.run(run())
    assert got.outputs[0].token_ids == [1] and second.outputs[0].token_ids == [2]
