"""``quire bench serve``: routing policies compared on real engine processes.

For each workload and each policy, cold engines (so runs are comparable) and an in-process
router in front of them; requests arrive as a Poisson process at ``request_rate`` (``inf``: all
at once) and stream back through the router. The engines are fresh ``quire engine``
subprocesses, or vLLM servers whose prefix caches are reset before every run
(``--engine-kind vllm``; ``quire_cli.bench.serve_engines``).

Workloads are token ids drawn from ``seed`` (the engine flag ``--seed``, which also seeds the
engines), so lengths are exact and every policy sees the same prompts in the same order at the
same times:

- ``shared_prefix``: ``num_groups`` system prompts, each shared by ``prompts_per_group``
  requests that add a unique question; groups interleave in a shuffled order.
- ``no_sharing``: the same number and lengths of prompts, every one unique (the control).
- ``hot_prefix``: one system prompt on ``hot_share`` (80%) of the requests, the others unique
  prompts of the same length, or (``other_prompts`` > 0) each on one of that many other
  system prompts with a question of its own: at a rate above one engine's capacity, pure
  cache affinity piles the hot prefix onto one engine, and least-loaded recomputes prefixes
  wherever the load sends them. With unique others, their own prefill sets the TTFT p90
  (a fifth of the requests, each a whole prompt to compute on some engine).

With ``num_routers`` above one, that many router replicas share the traffic (request ``i``
through replica ``i mod N``); each holds its own index from every engine's KV events.

Reported per run: TTFT, time per output token and inter-token latency (p50/p90/p99), request
and output-token throughput, the cache hit rate the engines reported, requests and prompt
tokens per engine, errors and the router's placement time (vLLM engines: also vLLM's own
prefix-cache counters); then prefix_aware against each other policy. Report and plots: ``quire_cli.bench.serve_report``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import grpc

from quire.v1 import engine_pb2_grpc
from quire_cli.bench.harness import (FIRST_SAFE_TOKEN_ID, RequestResult, describe_ms,
                                     generate_request, machine_info, percentile,
                                     running_router, stream_request)
from quire_cli.bench.serve_config import WORKLOAD_NAMES, ServeBenchConfig
from quire_cli.bench.serve_engines import ENGINE_KINDS, RunEngines, counter_deltas
from quire_cli.bench.restart import measure_restart
from quire_cli.bench.two_tenants import gradient_limit_modes, measure_two_tenants


@dataclass(frozen=True, slots=True)
class Workload:
    """Prompts in send order and when each is sent (seconds after the run starts)."""

    name: str
    prompts: tuple[tuple[int, ...], ...]
    arrival_offsets_s: tuple[float, ...]
    output_len: int


def _draw(rng: random.Random, vocab_size: int, n: int) -> list[int]:
    return [rng.randrange(FIRST_SAFE_TOKEN_ID, vocab_size - FIRST_SAFE_TOKEN_ID)
            for _ in range(n)]


def _shared_prefix_prompts(cfg: ServeBenchConfig, rng: random.Random, vocab_size: int):
    systems = [_draw(rng, vocab_size, cfg.system_prompt_len) for _ in range(cfg.num_groups)]
    prompts = [tuple(systems[g] + _draw(rng, vocab_size, cfg.question_len))
               for g in range(cfg.num_groups) for _ in range(cfg.prompts_per_group)]
    # Shuffled rather than strictly alternating: with as many groups as engines, strict
    # alternation would hand round_robin perfect affinity by accident.
    rng.shuffle(prompts)
    return prompts


def _no_sharing_prompts(cfg: ServeBenchConfig, rng: random.Random, vocab_size: int):
    return [tuple(_draw(rng, vocab_size, cfg.prompt_len)) for _ in range(cfg.num_requests)]


def _hot_prefix_prompts(cfg: ServeBenchConfig, rng: random.Random, vocab_size: int):
    hot = _draw(rng, vocab_size, cfg.system_prompt_len)
    num_hot = round(cfg.hot_share * cfg.num_requests)
    prompts = [tuple(hot + _draw(rng, vocab_size, cfg.question_len)) for _ in range(num_hot)]
    num_others = cfg.num_requests - num_hot
    if cfg.other_prompts:
        others = [_draw(rng, vocab_size, cfg.system_prompt_len)
                  for _ in range(cfg.other_prompts)]
        prompts += [tuple(others[i % len(others)] + _draw(rng, vocab_size, cfg.question_len))
                    for i in range(num_others)]
    else:
        prompts += [tuple(_draw(rng, vocab_size, cfg.prompt_len)) for _ in range(num_others)]
    rng.shuffle(prompts)
    return prompts


WORKLOADS: dict[str, Callable] = {
    "shared_prefix": _shared_prefix_prompts,
    "no_sharing": _no_sharing_prompts,
    "hot_prefix": _hot_prefix_prompts,
}
# Scenarios that drive the router their own way: (engines, policy, cfg, seed[, variant]) -> a
# run; those with variants (cfg -> names) run once per variant, each on fresh engines.
SCENARIOS: dict[str, Callable] = {"two_tenants": measure_two_tenants,
                                  "restart": measure_restart}
SCENARIO_VARIANTS: dict[str, Callable] = {"two_tenants": gradient_limit_modes}
assert (*WORKLOADS, *SCENARIOS) == WORKLOAD_NAMES  # the config validates names without us


def poisson_offsets(num_requests: int, rate: float, rng: random.Random) -> tuple[float, ...]:
    """Arrival times: the first at 0, then exponential gaps of mean 1/rate (0 when inf)."""
    offsets, t = [], 0.0
    for i in range(num_requests):
        if i and rate != float("inf"):
            t += rng.expovariate(rate)
        offsets.append(t)
    return tuple(offsets)


def make_workload(name: str, cfg: ServeBenchConfig, *, vocab_size: int, seed: int) -> Workload:
    if vocab_size < 2 * FIRST_SAFE_TOKEN_ID + 100:
        raise ValueError(f"vocab_size: too small for random prompts, got {vocab_size}")
    # Separate streams per workload, and arrivals independent of prompt content.
    prompts = WORKLOADS[name](cfg, random.Random(f"{seed}-{name}"), vocab_size)
    offsets = poisson_offsets(len(prompts), cfg.request_rate, random.Random(f"{seed}-arrivals"))
    return Workload(name, tuple(prompts), offsets, cfg.output_len)


async def drive(stubs: Sequence, workload: Workload, *, tag: str, max_concurrency: int,
                timeout_s: float, t0: float) -> list[RequestResult]:
    """Send every request of ``workload`` at its arrival time, request ``i`` through
    ``stubs[i % len(stubs)]``; results in workload order."""
    limit = asyncio.Semaphore(max_concurrency) if max_concurrency else None

    async def one(i: int) -> RequestResult:
        await asyncio.sleep(max(0.0, t0 + workload.arrival_offsets_s[i] - time.perf_counter()))
        async with limit or contextlib.nullcontext():
            request = generate_request(f"{tag}-{i}", workload.prompts[i], workload.output_len)
            return await stream_request(stubs[i % len(stubs)], request, t0=t0,
                                        timeout_s=timeout_s)

    return list(await asyncio.gather(*(one(i) for i in range(len(workload.prompts)))))


def summarize(results: Sequence[RequestResult], addresses: Sequence[str],
              placement_us: Sequence[float], duration_s: float) -> dict:
    """Latency, throughput, cache and load-spread metrics of one run."""
    ok = [r for r in results if r.ok]
    prompt_tokens = sum(r.prompt_tokens for r in ok)
    cached_tokens = sum(r.cached_tokens for r in ok)
    output_tokens = sum(r.num_output_tokens for r in ok)
    per_engine = {}
    for i, address in enumerate(addresses):
        mine = [r for r in ok if r.engine_id == address]
        per_engine[f"engine-{i}"] = {
            "address": address, "num_requests": len(mine),
            "request_share": len(mine) / len(ok) if ok else 0.0,
            "prompt_tokens": sum(r.prompt_tokens for r in mine),
            "prompt_token_share": sum(r.prompt_tokens for r in mine) / prompt_tokens
            if prompt_tokens else 0.0,
            "cached_tokens": sum(r.cached_tokens for r in mine)}
    counts = [e["num_requests"] for e in per_engine.values()]
    return {
        "num_requests": len(results), "num_finished": len(ok),
        "num_errors": len(results) - len(ok),
        "errors": sorted({r.error or f"unfinished ({r.finish_reason})" for r in results
                          if not r.ok})[:5],
        "duration_s": duration_s,
        "request_throughput": len(ok) / duration_s if duration_s > 0 else None,
        "output_token_throughput": output_tokens / duration_s if duration_s > 0 else None,
        "prompt_tokens": prompt_tokens, "cached_tokens": cached_tokens,
        "output_tokens": output_tokens,
        "cache_hit_rate": cached_tokens / prompt_tokens if prompt_tokens else 0.0,
        "ttft_ms": describe_ms([r.ttft_s for r in ok]),
        "tpot_ms": describe_ms([r.tpot_s for r in ok if r.tpot_s is not None]),
        "itl_ms": describe_ms([gap for r in ok for gap in r.itls_s()]),
        "e2e_ms": describe_ms([r.e2e_s for r in ok]),
        "per_engine": per_engine,
        # max/min requests per engine; None when an engine got none (the spread is unbounded)
        "load_spread": max(counts) / min(counts) if min(counts) else None,
        "placement_us": {"mean": sum(placement_us) / len(placement_us) if placement_us
                         else None, "p50": percentile(placement_us, 50),
                         "p99": percentile(placement_us, 99)},
    }


async def measure(engines: RunEngines, counters: Callable, policy: str, workload_name: str,
                  cfg: ServeBenchConfig, seed: int) -> dict:
    """One (policy, workload) run on cold, warmed-up ``engines``; ``counters()`` reads the
    engines' own cache counters (None where usage already tells)."""
    if cfg.prompt_len + cfg.output_len > engines.max_model_len:
        raise ValueError(f"system_prompt_len: prompt + output ({cfg.prompt_len} + "
                         f"{cfg.output_len}) exceed max_model_len {engines.max_model_len}")
    workload = make_workload(workload_name, cfg, vocab_size=engines.vocab_size, seed=seed)
    ids = engines.engine_ids
    async with contextlib.AsyncExitStack() as stack:
        routers = [await stack.enter_async_context(running_router(
            engines.urls, policy, cfg.startup_timeout_s, **engines.router_options))
            for _ in range(cfg.num_routers)]
        for router in routers:
            decisions = router.metrics.decisions
            # The log keeps only its latest placements: make room for every request of the run.
            decisions.capacity = max(decisions.capacity, 4 * len(workload.prompts))
        before = await counters()
        channels = [await stack.enter_async_context(
            grpc.aio.insecure_channel(f"127.0.0.1:{router.port}")) for router in routers]
        stubs = [engine_pb2_grpc.EngineServiceStub(channel) for channel in channels]
        t0 = time.perf_counter()
        results = await drive(stubs, workload, tag=f"{policy}-{workload_name}",
                              max_concurrency=cfg.max_concurrency,
                              timeout_s=cfg.request_timeout_s, t0=t0)
        duration_s = time.perf_counter() - t0
        engine_counters = counter_deltas(before, await counters(), ids)
        req_ids = {r.req_id for r in results}
        placement_us = [d.placement_us for router in routers
                        for d in router.metrics.decisions.latest(
                            router.metrics.decisions.capacity) if d.request_id in req_ids]
    run = {"policy": policy, "workload": workload_name, "num_routers": cfg.num_routers,
           **summarize(results, ids, placement_us, duration_s),
           "requests": [_request_row(r, ids) for r in results]}
    if engine_counters is not None:
        run["engine_cache_counters"] = engine_counters
    return run


def _request_row(r: RequestResult, addresses: Sequence[str]) -> dict:
    engine = f"engine-{addresses.index(r.engine_id)}" if r.engine_id in addresses else None
    return {"req_id": r.req_id, "engine": engine, "sent_s": r.sent_s,
            "ttft_s": r.ttft_s if r.chunks else None, "e2e_s": r.e2e_s,
            "output_tokens": r.num_output_tokens, "prompt_tokens": r.prompt_tokens,
            "cached_tokens": r.cached_tokens, "finish_reason": r.finish_reason,
            "error": r.error}


def policy_order(policies: Sequence[str], repeat: int) -> tuple[str, ...]:
    """The order of repeat ``repeat``: rotated by one policy a repeat, so that over as many
    repeats as policies each runs once in every position (a run's place in the sequence
    moves its figures: the machine warms, caches fill)."""
    k = repeat % len(policies)
    return tuple(policies[k:]) + tuple(policies[:k])


async def run_all(cfg: ServeBenchConfig, engines, seed: int) -> list[dict]:
    """Every (workload, policy) run ``cfg.repeats`` times on ``engines`` (a
    ``serve_engines`` kind, entered), the policies in ``policy_order``."""
    runs = []
    for repeat, workload_name in ((r, w) for r in range(cfg.repeats)
                                  for w in cfg.workload_names):
        variants = SCENARIO_VARIANTS[workload_name](cfg) \
            if workload_name in SCENARIO_VARIANTS else (None,)
        for policy, variant in ((p, v) for p in policy_order(cfg.policy_names, repeat)
                                for v in variants):
            # Other work on the machine skews a run; its load average is kept beside it.
            load_1m = os.getloadavg()[0]
            async with engines.fresh() as run_engines:
                if workload_name in SCENARIOS:
                    extra = {} if variant is None else {"variant": variant}
                    run = await SCENARIOS[workload_name](run_engines, policy, cfg, seed,
                                                         **extra)
                else:
                    run = await measure(run_engines, engines.cache_counters, policy,
                                        workload_name, cfg, seed)
            runs.append(dict(run, repeat=repeat, load_average_1m_before=load_1m))
            print(f"  {workload_name:<14}{policy:<14}{run['num_finished']}/"
                  f"{run['num_requests']} finished in {run['duration_s']:.1f}s", flush=True)
    return runs


def run_from_args(ns: argparse.Namespace) -> int:
    from quire.config_args import dataclass_from_namespace
    from quire_cli.bench.serve_report import build_report, print_summary, write_outputs
    from quire_cli.stack import changed_engine_flags, resolve_model_once

    cfg = dataclass_from_namespace(ServeBenchConfig, ns)
    flags = changed_engine_flags(ns)
    model_dir = resolve_model_once(ns.model)
    machine_before = machine_info()
    print(f"bench serve: {len(cfg.workload_names)} workloads x {len(cfg.policy_names)} "
          f"policies, {cfg.num_requests} requests each at {cfg.request_rate} req/s, "
          f"{cfg.num_engines} {cfg.engine_kind} engines", flush=True)
    with ENGINE_KINDS[cfg.engine_kind](cfg, flags, model_dir) as engines:
        runs = asyncio.run(run_all(cfg, engines, ns.seed))
        described = engines.describe()
    report = build_report(cfg, seed=ns.seed, engine_flags=flags, engines=described, runs=runs,
                          machine=dict(machine_before,
                                       load_average_after=machine_info()["load_average"]))
    print_summary(report)
    write_outputs(report, cfg.output_json, cfg.output_png)
    return 0
