"""``quire bench router-overhead``: the latency the router adds in front of one engine.

One ``quire engine`` subprocess and an in-process router before it. Short requests with
unique prompts (nothing cached) go one at a time, alternately straight to the engine and
through the router, and the pair order flips every round, so drift in the machine's speed
(other work, thermal) falls on both paths alike. Reports TTFT and end-to-end latency per path,
what the router adds (percentile differences, and the median of per-pair differences), and
the router's placement time per request from its decision log.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import random
import statistics
import sys
import time
from pathlib import Path

import grpc

from quire.v1 import engine_pb2_grpc
from quire_cli.bench.harness import (FIRST_SAFE_TOKEN_ID, RequestResult, describe_ms,
                                     generate_request, machine_info, model_info, percentile,
                                     running_engines, running_router, stream_request,
                                     warm_up)
from quire_cli.bench.report import write_json
from quire_cli.bench.serve_config import OverheadBenchConfig

PATHS = ("direct", "routed")


async def _interleaved(stubs: dict, cfg: OverheadBenchConfig, rng: random.Random,
                       vocab_size: int, address: str) -> dict[str, list[RequestResult]]:
    results: dict[str, list[RequestResult]] = {p: [] for p in PATHS}
    t0 = time.perf_counter()
    for i in range(cfg.num_requests):
        for path in (PATHS if i % 2 == 0 else PATHS[::-1]):
            prompt = [rng.randrange(FIRST_SAFE_TOKEN_ID, vocab_size - FIRST_SAFE_TOKEN_ID)
                      for _ in range(cfg.prompt_len)]
            request = generate_request(f"{path}-{i}", prompt, cfg.output_len)
            results[path].append(await stream_request(
                stubs[path], request, t0=t0, timeout_s=cfg.request_timeout_s,
                engine_id=address))
    return results


async def measure(address: str, cfg: OverheadBenchConfig, seed: int) -> dict:
    info = await model_info(address)
    await warm_up([address], cfg.prompt_len, cfg.output_len, cfg.request_timeout_s)
    rng = random.Random(f"{seed}-overhead")
    async with running_router([address], cfg.policy, cfg.startup_timeout_s) as router:
        decisions = router.metrics.decisions
        decisions.capacity = max(decisions.capacity, 2 * cfg.num_requests + 16)
        async with grpc.aio.insecure_channel(address) as direct, \
                grpc.aio.insecure_channel(f"127.0.0.1:{router.port}") as routed:
            stubs = {"direct": engine_pb2_grpc.EngineServiceStub(direct),
                     "routed": engine_pb2_grpc.EngineServiceStub(routed)}
            # Open both connections before timing anything.
            for path, stub in stubs.items():
                warm = generate_request(f"warm-{path}", [FIRST_SAFE_TOKEN_ID] * cfg.prompt_len,
                                        cfg.output_len)
                await stream_request(stub, warm, t0=time.perf_counter(),
                                     timeout_s=cfg.request_timeout_s)
            results = await _interleaved(stubs, cfg, rng, info.vocab_size, address)
        routed_ids = {r.req_id for r in results["routed"]}
        placement_us = [d.placement_us for d in decisions.latest(decisions.capacity)
                        if d.request_id in routed_ids]
    return summarize(results, placement_us)


def summarize(results: dict[str, list[RequestResult]], placement_us: list[float]) -> dict:
    out: dict = {}
    for path in PATHS:
        ok = [r for r in results[path] if r.ok]
        out[path] = {"num_requests": len(results[path]),
                     "num_errors": len(results[path]) - len(ok),
                     "ttft_ms": describe_ms([r.ttft_s for r in ok]),
                     "e2e_ms": describe_ms([r.e2e_s for r in ok])}
    added = {}
    for metric in ("ttft_ms", "e2e_ms"):
        d, r = out["direct"][metric], out["routed"][metric]
        diffs = {k: r[k] - d[k] if r[k] is not None and d[k] is not None else None for k in d}
        # Rounds pair a direct and a routed request sent back to back: the median of their
        # differences is robust to slow phases that hit a whole round.
        attr = "ttft_s" if metric == "ttft_ms" else "e2e_s"
        pairs = [getattr(rr, attr) - getattr(dr, attr) for dr, rr in
                 zip(results["direct"], results["routed"]) if dr.ok and rr.ok]
        diffs["paired_median"] = statistics.median(pairs) * 1e3 if pairs else None
        added[metric] = diffs
    out["added_ms"] = added
    out["placement_us"] = {"p50": percentile(placement_us, 50),
                           "p99": percentile(placement_us, 99),
                           "mean": statistics.fmean(placement_us) if placement_us else None,
                           "num_decisions": len(placement_us)}
    out["samples_ms"] = {path: {"ttft": [r.ttft_s * 1e3 for r in results[path] if r.ok],
                                "e2e": [r.e2e_s * 1e3 for r in results[path] if r.ok]}
                         for path in PATHS}
    return out


def _fmt(value: float | None, spec: str = ".2f") -> str:
    return "-" if value is None else format(value, spec)


def print_summary(report: dict) -> None:
    print(f"{'path':<10}{'TTFT p50':>10}{'p90':>9}{'p99':>9}{'e2e p50':>10}{'p90':>9}"
          f"{'p99':>9}{'errors':>8}   (ms)")
    for path in (*PATHS, "added_ms"):
        row = report[path]
        ttft, e2e = row["ttft_ms"], row["e2e_ms"]
        errors = str(row["num_errors"]) if path in PATHS else ""
        label = "router +" if path == "added_ms" else path
        print(f"{label:<10}{_fmt(ttft['p50']):>10}{_fmt(ttft['p90']):>9}{_fmt(ttft['p99']):>9}"
              f"{_fmt(e2e['p50']):>10}{_fmt(e2e['p90']):>9}{_fmt(e2e['p99']):>9}{errors:>8}")
    added, place = report["added_ms"], report["placement_us"]
    print(f"router adds {_fmt(added['ttft_ms']['paired_median'])} ms TTFT and "
          f"{_fmt(added['e2e_ms']['paired_median'])} ms end to end (median of paired "
          f"differences); placement {_fmt(place['p50'], '.0f')} us p50, "
          f"{_fmt(place['p99'], '.0f')} us p99")


def write_plot(path: Path, report: dict) -> bool:
    try:
        from matplotlib.figure import Figure
    except ImportError:
        print("note: matplotlib is not installed; no plot written", file=sys.stderr)
        return False
    fig = Figure(figsize=(11, 4), layout="constrained")
    for ax, metric, title in zip(fig.subplots(1, 2), ("ttft", "e2e"),
                                 ("Time to first token", "End-to-end latency")):
        for route in PATHS:
            values = sorted(report["samples_ms"][route][metric])
            if values:
                # empirical CDF: the horizontal gap between the curves is the added latency
                ax.step(values, [(i + 1) / len(values) for i in range(len(values))],
                        where="post", label=route)
        ax.set(title=title, xlabel="ms", ylabel="fraction of requests", ylim=(0, 1.02))
        ax.legend()
    fig.savefig(path, dpi=120)
    return True


def run_from_args(ns: argparse.Namespace) -> int:
    from quire.config_args import dataclass_from_namespace
    from quire_cli.stack import changed_engine_flags, resolve_model_once

    cfg = dataclass_from_namespace(OverheadBenchConfig, ns)
    flags = changed_engine_flags(ns)
    resolve_model_once(ns.model)
    machine = machine_info()

    async def run() -> dict:
        with running_engines(1, flags, cfg.startup_timeout_s) as (address,):
            return await measure(address, cfg, ns.seed)

    results = asyncio.run(run())
    machine["load_average_after"] = machine_info()["load_average"]
    report = {"config": dataclasses.asdict(cfg), "seed": ns.seed, "engine_flags": flags,
              "machine": machine, **results}
    print_summary(report)
    json_path, png_path = write_json(report, cfg.output_json), Path(cfg.output_png)
    wrote = [str(json_path)] + ([str(png_path)] if write_plot(png_path, report) else [])
    print(f"wrote {' and '.join(wrote)}")
    return 0
