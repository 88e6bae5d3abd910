"""A stream that lags behind the engine gets its outputs merged, and loses nothing by it."""

from __future__ import annotations

import asyncio
import time

from engine_worker.config import EngineArgs
from engine_worker.engine import LLMEngine
from engine_worker.sampling_params import SamplingParams
from engine_worker.server.async_engine import AsyncEngine

PROMPT = {"prompt_token_ids": list(range(300, 332))}


def _params(**kwargs) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=3,
                          prompt_logprobs=2, n=2, seed=1, **kwargs)


async def _run(engine: LLMEngine, lag: bool):
    """The request's messages; with ``lag``, read the first, then nothing until the engine
    has finished the request (so every later output waits in the collector)."""
    async_engine = AsyncEngine(engine)
    async_engine.start()
    try:
        messages = []
        async for output in async_engine.generate("r", PROMPT, _params()):
            messages.append(output)
            if lag and len(messages) == 1:
                while async_engine.num_unfinished:  # the loop thread saw the last output
                    await asyncio.sleep(0.01)
                # a round trip through the loop thread: the hand-off of the last output,
                # queued to this event loop before the reply, has run when the reply comes
                await async_engine.call(lambda engine: None)
        return messages
    finally:
        await asyncio.to_thread(async_engine.stop)


def _joined(messages):
    """Per completion index: concatenated text, token ids and logprobs, and the last finish."""
    joined = {}
    for message in messages:
        for c in message.outputs:
            text, ids, lps, _ = joined.get(c.index, ("", [], [], None))
            joined[c.index] = (text + c.text, ids + c.token_ids, lps + c.logprobs,
                               (c.finish_reason, c.stop_reason, c.cumulative_logprob))
    prompt_logprobs = [lp for m in messages for lp in (m.prompt_logprobs or [])]
    return joined, prompt_logprobs


def _paced(engine: LLMEngine, pause_s: float) -> None:
    """Each step of ``engine`` takes ``pause_s`` longer (on the engine's loop thread), so a
    reader that keeps up is well ahead of it."""
    step = engine.step

    def paced_step():
        time.sleep(pause_s)
        return step()

    engine.step = paced_step


def test_a_lagging_stream_gets_the_same_outputs_in_fewer_messages(tiny_model_dir):
    engine = LLMEngine.from_engine_args(EngineArgs(model=str(tiny_model_dir), dtype="float32",
                                                   kv_cache_memory_bytes=1 << 22, seed=0))
    _paced(engine, 0.01)
    prompt = asyncio.run(_run(engine, lag=False))
    lagging = asyncio.run(_run(engine, lag=True))
    # A reader that keeps up gets about one message a step (the first may carry no token); on
    # a loaded machine its own thread can miss a step or two, which merges those (seen: 15 of
    # 16 with another process spinning on one of two cores), so only "more" is certain.
    assert len(prompt) > len(lagging)
    assert len(lagging) == 2  # the first, then everything else merged into one
    assert lagging[-1].finished and prompt[-1].finished
    (want, want_prompt_lps), (got, got_prompt_lps) = _joined(prompt), _joined(lagging)
    assert got == want
    assert got_prompt_lps == want_prompt_lps
    assert len(want_prompt_lps) == len(PROMPT["prompt_token_ids"])
    assert all(len(ids) == 16 for _, ids, _, _ in got.values())
