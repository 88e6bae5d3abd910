"""Multi-step decode behind the server's loop thread (``quire engine --num-scheduler-steps N``):
a request that comes in during a run is not kept behind it (the loop's interrupt ends the run
after its current pass), and streams carry the tokens of one pass a step."""

from __future__ import annotations

import asyncio
import time

from engine_worker.config import EngineArgs
from engine_worker.engine import LLMEngine
from engine_worker.sampling_params import SamplingParams
from engine_worker.server.async_engine import AsyncEngine

PASS_S = 0.15  # each forward pass made this slow, so a run of 8 lasts 1.2 s
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def _engine(tiny_model_dir, steps: int) -> LLMEngine:
    return LLMEngine.from_engine_args(EngineArgs(
        model=str(tiny_model_dir), dtype="float32", kernels="torch",
        kv_cache_memory_bytes=1 << 22, num_scheduler_steps=steps))


def _paced_passes(engine: LLMEngine) -> None:
    forward = engine.runner._forward

    def slow(*args):
        time.sleep(PASS_S)
        return forward(*args)

    engine.runner._forward = slow


def _logged_steps(engine: LLMEngine) -> list[dict[str, int]]:
    """Each step's new token counts per request, recorded on the loop thread (a server's
    outputs are DELTAs: each carries its step's tokens)."""
    steps, step = [], engine.step

    def logged():
        result = step()
        # (the engine's ids carry a suffix)
        steps.append({out.request_id.split("-")[0]: len(out.outputs[0].token_ids)
                      for out in result.outputs})
        return result

    engine.step = logged
    return steps


async def _two_requests(engine: LLMEngine) -> dict[str, list[int]]:
    """``a`` alone, then ``b`` once ``a``'s first token is out; each one's token ids."""
    async_engine = AsyncEngine(engine)
    async_engine.start()
    got: dict[str, list[int]] = {"a": [], "b": []}
    first = asyncio.Event()

    async def consume(req_id: str, prompt: list[int]):
        async for out in async_engine.generate(req_id, {"prompt_token_ids": prompt}, GREEDY):
            got[req_id].extend(out.outputs[0].token_ids)  # (DELTAs)
            if got[req_id]:
                first.set()

    try:
        a = asyncio.create_task(consume("a", list(range(3, 19))))
        await first.wait()
        await consume("b", list(range(40, 52)))
        await a
        return got
    finally:
        await asyncio.to_thread(async_engine.stop)


def test_a_request_coming_in_mid_run_waits_one_pass(tiny_model_dir):
    engine = _engine(tiny_model_dir, 8)
    _paced_passes(engine)
    steps = _logged_steps(engine)
    got = asyncio.run(_two_requests(engine))
    joined = next(i for i, s in enumerate(steps) if "b" in s)
    a_before = sum(s.get("a", 0) for s in steps[:joined])
    # a's prefill token, then the pass under way when b came in (one, where the event loop
    # answers within a pass; up to two more allowed for a loaded machine); without the
    # interrupt a's run of 8 would go first (9)
    assert 1 <= a_before <= 4, steps
    assert steps[joined] == {"a": 1, "b": 1}, steps  # b's prefill step is one pass
    assert any(s == {"a": 8, "b": 8} for s in steps), steps  # then both decode in runs

    one_pass = asyncio.run(_two_requests(_engine(tiny_model_dir, 1)))
    assert got == one_pass  # greedy: the same tokens as one pass a step
    assert [len(t) for t in got.values()] == [24, 24]
