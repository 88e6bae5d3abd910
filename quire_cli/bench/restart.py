"""The ``restart`` scenario of ``quire bench serve``: an engine killed (SIGKILL) and started
again at the same address under steady shared-prefix traffic. How long until the cache hit
rate is back, and does any error reach a client that another engine could have served?

On fresh engines behind the router:

1. steady traffic: Poisson arrivals at ``request_rate``, each one of ``num_groups`` system
   prompts (drawn at random) and a unique question, sent until the end;
2. at ``restart_kill_at_s`` the last engine is killed with SIGKILL (its in-flight streams
   break; its blocks are gone) and at once started again with the same command and address
   (a new incarnation, as a restarted pod); the router must notice both;
3. traffic goes on for ``restart_after_s`` after the router serves the engine again.

Reported (``restart`` in the run): the hit rate (cached / prompt tokens of the requests sent in
each ``restart_window_s`` window), the steady hit rate (the requests sent in the second half
before the kill), when the kill, the new process and its return to the router's pool happened,
the lowest window after the kill, the first window (after the kill, and after the return) whose
hit rate is at least 90% of the steady one, and the client-visible errors: those before any
token and those whose stream broke after tokens had arrived (the target is none of either: the
router retries the first on the other engine and moves the second there, ``router.resume``),
with the router's retries and moved streams.
"""

from __future__ import annotations

import asyncio
import math
import random
import time

import grpc

from quire.v1 import engine_pb2_grpc
from quire_cli.bench.harness import (FIRST_SAFE_TOKEN_ID, RequestResult, generate_request,
                                     running_router, stream_request)

RECOVERED_SHARE = 0.9  # of the steady hit rate: a window at least this high has recovered
_POLL_S = 0.05


async def measure_restart(engines, policy: str, cfg, seed: int) -> dict:
    """One run of the scenario on fresh ``engines`` (a ``serve_engines.RunEngines``)."""
    from quire_cli.bench.serve import summarize

    if engines.control is None:
        raise ValueError("workloads: restart kills and restarts engine processes: Quire "
                         "engines only (--engine-kind quire)")
    rng = random.Random(f"{seed}-restart")
    arrivals = random.Random(f"{seed}-restart-arrivals")
    vocab = engines.vocab_size

    def draw(n: int) -> list[int]:
        return [rng.randrange(FIRST_SAFE_TOKEN_ID, vocab - FIRST_SAFE_TOKEN_ID)
                for _ in range(n)]

    systems = [draw(cfg.system_prompt_len) for _ in range(cfg.num_groups)]
    victim = len(engines.urls) - 1
    events: dict[str, float] = {}
    async with running_router(engines.urls, policy, cfg.startup_timeout_s,
                              **engines.router_options) as router:
        decisions = router.metrics.decisions
        decisions.capacity = max(decisions.capacity, 100_000)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{router.port}") as channel:
            stub = engine_pb2_grpc.EngineServiceStub(channel)
            t0 = time.perf_counter()

            async def kill_and_restart() -> None:
                await asyncio.sleep(cfg.restart_kill_at_s)
                engines.control.kill(victim)
                events["killed_s"] = time.perf_counter() - t0
                await asyncio.to_thread(engines.control.restart, victim)
                events["listening_s"] = time.perf_counter() - t0
                while len(router.pool.serving()) < len(engines.urls):
                    await asyncio.sleep(_POLL_S)
                events["rejoined_s"] = time.perf_counter() - t0

            def sending() -> bool:  # until restart_after_s after the return (or a failure)
                if not restarter.done():
                    return True
                return restarter.exception() is None and \
                    time.perf_counter() - t0 < events["rejoined_s"] + cfg.restart_after_s

            async def traffic() -> list[RequestResult]:
                tasks, i = [], 0
                while sending():
                    prompt = systems[rng.randrange(cfg.num_groups)] + draw(cfg.question_len)
                    request = generate_request(f"restart-{i}", prompt, cfg.output_len)
                    tasks.append(asyncio.create_task(stream_request(
                        stub, request, t0=t0, timeout_s=cfg.request_timeout_s)))
                    i += 1
                    await asyncio.sleep(arrivals.expovariate(cfg.request_rate))
                return list(await asyncio.gather(*tasks))

            restarter = asyncio.create_task(kill_and_restart())
            results = await traffic()
            await restarter
            duration_s = time.perf_counter() - t0
        retries, migrations = (sum(s.value for metric in counter.collect()
                                   for s in metric.samples if s.name.endswith("_total"))
                               for counter in (router.metrics.retries,
                                               router.metrics.migrations))
        placement_us = [d.placement_us for d in decisions.latest(decisions.capacity)]
    return {"policy": policy, "workload": "restart",
            **summarize(results, engines.engine_ids, placement_us, duration_s),
            "restart": restart_report(results, events, cfg.restart_window_s, retries,
                                      engines.engine_ids[victim], migrations),
            "requests": [_row(r) for r in results]}


def _row(r: RequestResult) -> dict:
    return {"req_id": r.req_id, "engine": r.engine_id, "sent_s": r.sent_s,
            "prompt_tokens": r.prompt_tokens, "cached_tokens": r.cached_tokens,
            "output_tokens": r.num_output_tokens, "error": r.error}


def hit_rate_windows(results, window_s: float) -> list[dict]:
    """Per window of sending time: requests, errors, and the hit rate of those that finished
    (None where none did)."""
    if not results:
        return []
    count = math.floor(max(r.sent_s for r in results) / window_s) + 1
    windows = [{"start_s": i * window_s, "requests": 0, "errors": 0, "prompt_tokens": 0,
                "cached_tokens": 0} for i in range(count)]
    for r in results:
        w = windows[math.floor(r.sent_s / window_s)]
        w["requests"] += 1
        if r.ok:
            w["prompt_tokens"] += r.prompt_tokens
            w["cached_tokens"] += r.cached_tokens
        else:
            w["errors"] += 1
    for w in windows:
        w["hit_rate"] = w["cached_tokens"] / w["prompt_tokens"] if w["prompt_tokens"] else None
    return windows


def _hit_rate(results) -> float | None:
    prompt = sum(r.prompt_tokens for r in results if r.ok)
    return sum(r.cached_tokens for r in results if r.ok) / prompt if prompt else None


def restart_report(results, events: dict[str, float], window_s: float, retries: float,
                   victim: str, migrations: float = 0) -> dict:
    killed, rejoined = events["killed_s"], events["rejoined_s"]
    steady = _hit_rate([r for r in results if killed / 2 <= r.sent_s < killed])
    windows = hit_rate_windows(results, window_s)

    def back_after(t_s: float) -> float | None:
        """Seconds from ``t_s`` to the end of the first window starting at or after it whose
        hit rate is at least 90% of the steady one (None: none by the end of the run)."""
        for w in windows:
            if w["start_s"] >= t_s and w["hit_rate"] is not None and steady and \
                    w["hit_rate"] >= RECOVERED_SHARE * steady:
                return w["start_s"] + window_s - t_s
        return None

    after_kill = [w["hit_rate"] for w in windows
                  if w["start_s"] >= killed and w["hit_rate"] is not None]
    failed = [r for r in results if not r.ok]
    after_tokens = [r for r in failed if r.chunks]
    return {
        "events_s": dict(events), "victim": victim, "window_s": window_s,
        "steady_hit_rate": steady, "windows": windows,
        "hit_rate_before_kill": steady,
        "hit_rate_after_return": _hit_rate([r for r in results if r.sent_s >= rejoined]),
        "lowest_window_hit_rate_after_kill": min(after_kill, default=None),
        "recovered_s_after_kill": back_after(killed),
        "recovered_s_after_return": back_after(rejoined),
        "requests_after_return_on_victim": sum(
            1 for r in results if r.ok and r.sent_s >= rejoined and r.engine_id == victim),
        "client_errors": len(failed),
        "client_errors_after_tokens": len(after_tokens),
        "client_errors_before_tokens": len(failed) - len(after_tokens),
        "errors": sorted({r.error or f"unfinished ({r.finish_reason})" for r in failed})[:5],
        "router_retries": int(retries),
        "router_migrations": int(migrations),
    }


def print_restart(run: dict) -> None:
    s = run["restart"]
    ev = s["events_s"]

    def num(value, spec=".1f") -> str:
        return "-" if value is None else format(value, spec)

    rates = " ".join(num(w["hit_rate"], ".2f") for w in s["windows"])
    print(f"restart: {run['policy']}: engine killed at {ev['killed_s']:.1f}s, listening again "
          f"at {ev['listening_s']:.1f}s, serving in the router at {ev['rejoined_s']:.1f}s; "
          f"hit rate steady {num(s['steady_hit_rate'], '.2f')}, after the return "
          f"{num(s['hit_rate_after_return'], '.2f')}, lowest window after the kill "
          f"{num(s['lowest_window_hit_rate_after_kill'], '.2f')}; a window at 90% of steady "
          f"{num(s['recovered_s_after_kill'])}s after the kill, "
          f"{num(s['recovered_s_after_return'])}s after the return; client errors "
          f"{s['client_errors']} ({s['client_errors_before_tokens']} before any token, "
          f"{s['client_errors_after_tokens']} mid-stream), router retries "
          f"{s['router_retries']}, streams moved {s['router_migrations']}")
    print(f"restart: hit rate per {s['window_s']:g}s window: {rates}")
