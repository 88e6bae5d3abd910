"""The engine loop's load reports (what routers read in StreamLoad, and the step gauges) show
every request the engine holds, including those that join and finish within one step, and
never a generation request's passing wait as it joins."""

from __future__ import annotations

import asyncio

from engine_worker.config import EngineArgs
from engine_worker.engine import LLMEngine, EngineStats
from engine_worker.pooling_params import PoolingParams
from engine_worker.sampling_params import SamplingParams
from engine_worker.server.async_engine import AsyncEngine


def test_pooling_requests_that_finish_within_one_step_are_reported(tiny_model_dir):
    """Short pooling prompts are admitted and pooled in the step they join, so a report made
    only after steps never saw them (an embeddings flood read as an idle engine). The loop
    now reports as requests join, before the step that takes them."""
    engine = LLMEngine.from_engine_args(EngineArgs(model=str(tiny_model_dir), dtype="float32",
                                                   kv_cache_memory_bytes=1 << 22, seed=0))
    reports: list[EngineStats] = []

    async def embed_some() -> int:
        async_engine = AsyncEngine(engine, on_step=reports.append)
        async_engine.start()
        try:
            outputs = await asyncio.gather(*(
                async_engine.embed(f"e{i}", {"prompt_token_ids": list(range(300, 310 + i))},
                                   PoolingParams())
                for i in range(4)))
            return len(outputs)
        finally:
            await asyncio.to_thread(async_engine.stop)

    assert asyncio.run(embed_some()) == 4
    held = [r.scheduler.num_waiting + r.scheduler.num_running for r in reports]
    assert max(held) >= 1, held  # seen while they waited for their step
    # every request joined was reported: the reports' waiting counts cover all four
    assert sum(r.scheduler.num_waiting for r in reports) >= 4, held
    assert held[-1] == 0  # and the last report, after the last step, holds none


def test_generation_requests_are_published_after_their_first_step(tiny_model_dir):
    """Routers read the published report (StreamLoad) every 100 ms; a generation request's
    report as it joined (waiting, its prompt queued) outlived the step that took it, and other
    routers placed the next request of a warm prefix on a cold engine. Only the gauges see a
    generation request join; the report shows it from its first step, as before."""
    engine = LLMEngine.from_engine_args(EngineArgs(model=str(tiny_model_dir), dtype="float32",
                                                   kv_cache_memory_bytes=1 << 22, seed=0))
    gauges: list[EngineStats] = []
    published: list[int] = []

    async def generate_some() -> None:
        async_engine = AsyncEngine(engine, on_step=gauges.append)
        publish = async_engine._publish_load

        def recorded(stats: EngineStats) -> None:
            published.append(stats.scheduler.num_waiting)
            publish(stats)

        async_engine._publish_load = recorded
        async_engine.start()
        try:
            async def one(i: int) -> None:
                async for _ in async_engine.generate(
                        f"g{i}", {"prompt_token_ids": list(range(300, 310 + i))},
                        SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)):
                    pass
            await asyncio.gather(*(one(i) for i in range(3)))
        finally:
            await asyncio.to_thread(async_engine.stop)

    asyncio.run(generate_some())
    assert sum(g.scheduler.num_waiting for g in gauges) >= 3  # the gauges saw them join
    assert published and max(published) == 0  # (an empty batch takes each in its first step)
