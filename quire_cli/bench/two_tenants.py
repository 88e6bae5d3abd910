"""The ``two_tenants`` scenario of ``quire bench serve``: one tenant floods, another sends a
request every few seconds; does the router's flow control keep the light tenant's latency near
what it gets on an idle stack?

On fresh engines, behind a router whose tenants are told apart by a header:

1. idle: the light tenant alone sends ``light_idle_requests`` requests, one at a time: its
   latency on an idle stack;
2. flood: for ``flood_duration_s`` the heavy tenant sends Poisson arrivals at ``flood_rate``
   requests/s (far beyond what the engines serve) while the light tenant sends one request
   every ``light_interval_s``; the heavy tenant's queue in the router holds
   ``tenant_max_queue`` requests, so beyond it the heavy tenant gets 429s
   (RESOURCE_EXHAUSTED);
3. then every request is waited for, and the router and engines must hold nothing.

Reported (``two_tenants`` in the run): the light tenant's end-to-end latency (p50, p90, max)
idle and under the flood and their ratio (flood p90 / idle p50; the target is at most 5x),
and the heavy tenant's completions, 429s, other errors (5xx and the rest) and what was left
running. Prompts are unique random token ids of ``prompt_len`` tokens; every request
generates ``output_len`` tokens.
"""

from __future__ import annotations

import asyncio
import random
import time

import grpc

from quire.v1 import engine_pb2_grpc
from quire_cli.bench.harness import (FIRST_SAFE_TOKEN_ID, RequestResult, describe_ms,
                                     generate_request, running_router, stream_request)

TENANT_HEADER = "x-tenant-id"
_SETTLE_S = 5.0  # how long the router and engines get to report nothing running


def gradient_limit_modes(cfg) -> tuple[str, ...]:
    """The router's ``--gradient-limit`` modes to run the scenario with, one run each."""
    return cfg.gradient_limit_modes


async def measure_two_tenants(engines, policy: str, cfg, seed: int,
                              variant: str = "auto") -> dict:
    """One run of the scenario on fresh ``engines`` (a ``serve_engines.RunEngines``), the
    router's gradient limit in mode ``variant``."""
    from quire_cli.bench.serve import summarize

    rng = random.Random(f"{seed}-two_tenants")
    vocab = engines.vocab_size

    def prompt() -> list[int]:
        return [rng.randrange(FIRST_SAFE_TOKEN_ID, vocab - FIRST_SAFE_TOKEN_ID)
                for _ in range(cfg.prompt_len)]

    flow = {"tenant_header": TENANT_HEADER, "max_queue_per_tenant": cfg.tenant_max_queue,
            "gradient_limit": variant}
    async with running_router(engines.urls, policy, cfg.startup_timeout_s, flow=flow,
                              **engines.router_options) as router:
        decisions = router.metrics.decisions
        decisions.capacity = max(decisions.capacity, 100_000)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{router.port}") as channel:
            stub = engine_pb2_grpc.EngineServiceStub(channel)
            t0 = time.perf_counter()

            async def send(tenant: str, req_id: str) -> RequestResult:
                return await stream_request(
                    stub, generate_request(req_id, prompt(), cfg.output_len), t0=t0,
                    timeout_s=cfg.request_timeout_s, metadata=((TENANT_HEADER, tenant),))

            timeline: list[dict] = []
            sampler = asyncio.create_task(_sample(router, t0, timeline))
            idle = [await send("light", f"idle-{i}") for i in range(cfg.light_idle_requests)]
            light, heavy = await _flood(send, cfg, rng)
            duration_s = time.perf_counter() - t0
            sampler.cancel()
            await asyncio.gather(sampler, return_exceptions=True)
            left = await _left_running(router)
        placement_us = [d.placement_us for d in decisions.latest(decisions.capacity)]
    results = idle + light + heavy
    run = {"policy": policy, "workload": "two_tenants", "gradient_limit": variant,
           **summarize(results, engines.engine_ids, placement_us, duration_s),
           "two_tenants": _scenario_report(idle, light, heavy, left),
           "light_requests": [_row(r) for r in idle + light],
           "flow_timeline": timeline}
    return run


async def _sample(router, t0: float, samples: list[dict]) -> None:
    """The router's slots, admission limit, in-flight and queued requests twice a second."""
    flow = router.flow
    while flow is not None:
        samples.append({"t_s": round(time.perf_counter() - t0, 2), "slots": flow.slots,
                        "capacity": flow.capacity, "inflight": flow.inflight,
                        "queued": flow.depth()})
        await asyncio.sleep(0.5)


def _row(r: RequestResult) -> dict:
    return {"req_id": r.req_id, "sent_s": r.sent_s, "ttft_s": r.ttft_s if r.chunks else None,
            "e2e_s": r.e2e_s, "output_tokens": r.num_output_tokens, "error": r.error}


async def _flood(send, cfg, rng: random.Random):
    """Heavy Poisson arrivals and light periodic ones for ``flood_duration_s``."""
    heavy_tasks, light_tasks = [], []
    start = time.perf_counter()

    async def heavy_arrivals() -> None:
        i = 0
        while time.perf_counter() - start < cfg.flood_duration_s:
            heavy_tasks.append(asyncio.create_task(send("heavy", f"heavy-{i}")))
            i += 1
            await asyncio.sleep(rng.expovariate(cfg.flood_rate))

    async def light_arrivals() -> None:
        i = 0
        while time.perf_counter() - start < cfg.flood_duration_s:
            await asyncio.sleep(cfg.light_interval_s)
            light_tasks.append(asyncio.create_task(send("light", f"light-{i}")))
            i += 1

    await asyncio.gather(heavy_arrivals(), light_arrivals())
    return list(await asyncio.gather(*light_tasks)), list(await asyncio.gather(*heavy_tasks))


async def _left_running(router) -> dict:
    """What the router and the engines still hold, once they have had time to say."""
    deadline = time.monotonic() + _SETTLE_S
    while True:
        loads = router.pool.serving_loads()
        left = {"router_inflight": router.flow.inflight if router.flow else 0,
                "router_queued": sum(router.flow.depth().values()) if router.flow else 0,
                "engine_running": sum(x.num_running for x in loads),
                "engine_waiting": sum(x.num_waiting for x in loads)}
        if not any(left.values()) or time.monotonic() > deadline:
            return left
        await asyncio.sleep(0.2)


def _scenario_report(idle, light, heavy, left: dict) -> dict:
    def latencies(results) -> dict:
        ok = [r.e2e_s for r in results if r.ok]
        return describe_ms(ok) | {"max": max(ok) * 1e3 if ok else None,
                                  "num_requests": len(results), "num_ok": len(ok)}

    idle_ms, flood_ms = latencies(idle), latencies(light)
    refused = [r for r in heavy if r.error and r.error.startswith("RESOURCE_EXHAUSTED")]
    other = [r for r in heavy + light + idle if not r.ok and r not in refused]
    return {
        "light_idle_ms": idle_ms, "light_flood_ms": flood_ms,
        "light_p90_over_idle_p50": flood_ms["p90"] / idle_ms["p50"]
        if flood_ms["p90"] and idle_ms["p50"] else None,
        "heavy": {"sent": len(heavy), "completed": sum(r.ok for r in heavy),
                  "refused_429": len(refused),
                  "other_errors": len([r for r in other if r in heavy])},
        "light_errors": len([r for r in other if r not in heavy]),
        "errors": sorted({r.error or f"unfinished ({r.finish_reason})" for r in other})[:5],
        "left_running": left,
    }


def print_two_tenants(run: dict) -> None:
    s = run["two_tenants"]
    idle, flood, heavy = s["light_idle_ms"], s["light_flood_ms"], s["heavy"]

    def ms(value) -> str:
        return "-" if value is None else f"{value:.0f}"

    ratio = s["light_p90_over_idle_p50"]
    print(f"two_tenants: {run['policy']}, gradient limit {run.get('gradient_limit')}: light "
          f"tenant e2e p50/p90/max idle {ms(idle['p50'])}/"
          f"{ms(idle['p90'])}/{ms(idle['max'])} ms, under the flood {ms(flood['p50'])}/"
          f"{ms(flood['p90'])}/{ms(flood['max'])} ms ({flood['num_ok']}/"
          f"{flood['num_requests']} ok): p90 {'-' if ratio is None else f'{ratio:.2f}'}x idle "
          f"p50 (target <= 5x); heavy tenant {heavy['sent']} sent, {heavy['completed']} "
          f"completed, {heavy['refused_429']} refused (429), {heavy['other_errors']} other "
          f"errors; left running {s['left_running']}")
