"""A serving process builds its engine on the thread that then steps it (one OpenMP pool:
engine_worker/server/model_thread.py), and serves from there as from a thread of its own."""

from __future__ import annotations

import asyncio
import threading

import pytest

from engine_worker.config import EngineArgs
from engine_worker.engine import LLMEngine
from engine_worker.sampling_params import SamplingParams
from engine_worker.server.async_engine import AsyncEngine
from engine_worker.server.model_thread import ModelThread


def _build(model_dir, built_on: list[int]) -> LLMEngine:
    built_on.append(threading.get_ident())
    return LLMEngine.from_engine_args(EngineArgs(model=str(model_dir), dtype="float32",
                                                 kv_cache_memory_bytes=1 << 22, seed=0))


async def _serve(engine: LLMEngine, model_thread: ModelThread | None):
    async_engine = AsyncEngine(engine, model_thread=model_thread)
    async_engine.start()
    try:
        tokens = []
        async for output in async_engine.generate(
                "r", {"prompt_token_ids": list(range(300, 332))},
                SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)):
            tokens += output.outputs[0].token_ids
        return tokens, await async_engine.call(lambda _: threading.get_ident())
    finally:
        await asyncio.to_thread(async_engine.stop)


def test_the_loop_runs_on_the_thread_that_built_the_engine(tiny_model_dir):
    model_thread = ModelThread()
    built_on: list[int] = []
    engine = model_thread.submit(lambda: _build(tiny_model_dir, built_on)).result()
    assert built_on == [model_thread.thread.ident] != [threading.get_ident()]
    tokens, loop_thread = asyncio.run(_serve(engine, model_thread))
    assert loop_thread == model_thread.thread.ident
    # stopped, the thread takes the next job; the same engine restarts there
    again, loop_thread = asyncio.run(_serve(engine, model_thread))
    assert loop_thread == model_thread.thread.ident and again == tokens
    # and it is the engine a thread of its own steps, token for token
    other, loop_thread = asyncio.run(_serve(_build(tiny_model_dir, []), None))
    assert loop_thread not in (model_thread.thread.ident, threading.get_ident())
    assert other == tokens and len(tokens) == 12
    model_thread.close()
    model_thread.thread.join(timeout=10)
    assert not model_thread.thread.is_alive()


def test_a_failed_build_raises_in_the_caller():
    model_thread = ModelThread()

    def fail():
        raise ValueError("model: no such directory")

    with pytest.raises(ValueError, match="no such directory"):
        model_thread.submit(fail).result(timeout=10)
    assert model_thread.submit(lambda: 7).result(timeout=10) == 7  # the thread lives on
