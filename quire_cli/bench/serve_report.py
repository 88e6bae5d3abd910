"""The report of ``quire bench serve``: JSON, a summary table and plots.

JSON layout::

    {"config": {...}, "seed": int, "engine_flags": [...], "machine": {...},
     "engines": {"kind", and for vLLM "started_here", "vllm_version", "dtype", "num_kv_blocks",
                 "block_size", "urls"},
     "runs": [{"policy", "workload", "num_requests", "num_finished", "num_errors", "errors",
               "duration_s", "request_throughput", "output_token_throughput",
               "prompt_tokens", "cached_tokens", "output_tokens", "cache_hit_rate",
               "ttft_ms" | "tpot_ms" | "itl_ms" | "e2e_ms": {"p50", "p90", "p99", "mean"},
               "per_engine": {"engine-<i>": {"address", "num_requests", "request_share",
                                             "prompt_tokens", "prompt_token_share",
                                             "cached_tokens"}},
               "load_spread", "placement_us": {"mean", "p50", "p99"}, "requests": [...],
               "load_average_1m_before",
               "engine_cache_counters" (vLLM engines only: vLLM's prefix_cache_queries and
               _hits counters over the run): {"queries", "hits", "hit_rate",
                                              "per_engine": {"engine-<i>": {"queries", "hits"}}},
               the two_tenants workload only: "two_tenants" (``quire_cli.bench.two_tenants``),
               "light_requests", "flow_timeline"}],
     "medians": {workload: {policy: {"num_runs", "ttft_p50_ms", "ttft_p90_ms",
                                     "output_token_throughput", "cache_hit_rate"}}},
     "comparisons": {workload: {baseline: {"num_runs", "ttft_p50_speedup", "ttft_p90_speedup",
                                           "ttft_p90_speedup_per_repeat", "throughput_ratio",
                                           "cache_hit_rate_delta"}}}}

Each run carries its ``repeat`` (``--repeats``: every pair of workload and policy runs that
many times, the policy order rotated each time). ``cache_hit_rate`` is cached / prompt tokens
from the usage the engines returned. Speedups are baseline / prefix_aware of the medians over
the repeats (above 1: prefix_aware is faster); the throughput ratio is prefix_aware /
baseline. JSON cannot hold infinity, so an infinite rate is written as "inf".
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import sys
from pathlib import Path

from quire_cli.bench.report import write_json

REFERENCE_POLICY = "prefix_aware"


def _json_safe(value):
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


def _ratio(num: float | None, den: float | None) -> float | None:
    return num / den if num is not None and den else None


def median_of_known(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


def medians(runs: list[dict]) -> dict:
    """Per workload and policy, the median of each compared figure over that pair's runs
    (one run each unless ``--repeats``)."""
    groups: dict[tuple[str, str], list[dict]] = {}
    for r in runs:
        groups.setdefault((r["workload"], r["policy"]), []).append(r)
    out: dict[str, dict] = {}
    for (workload, policy), group in groups.items():
        out.setdefault(workload, {})[policy] = {
            "num_runs": len(group),
            "ttft_p50_ms": median_of_known([r["ttft_ms"]["p50"] for r in group]),
            "ttft_p90_ms": median_of_known([r["ttft_ms"]["p90"] for r in group]),
            "output_token_throughput": median_of_known([r["output_token_throughput"]
                                                        for r in group]),
            "cache_hit_rate": median_of_known([r["cache_hit_rate"] for r in group]),
        }
    return out


def compare(runs: list[dict], mid: dict | None = None) -> dict:
    """prefix_aware against every other policy, per workload: ratios of the medians over
    the repeats (``mid``: ``medians(runs)``, computed here unless given), and the p90 ratio
    of each repeat's pair (the same position in the machine's day, so the pairs show how
    steady the median's ratio is)."""
    mid = medians(runs) if mid is None else mid
    by_repeat = {(r["workload"], r["policy"], r.get("repeat", 0)): r for r in runs}
    out: dict[str, dict] = {}
    for workload, policies in mid.items():
        ref = policies.get(REFERENCE_POLICY)
        if ref is None:
            continue
        for policy, base in policies.items():
            if policy == REFERENCE_POLICY:
                continue
            pairs = [_ratio(base_run["ttft_ms"]["p90"], ref_run["ttft_ms"]["p90"])
                     for (w, p, k), ref_run in by_repeat.items()
                     if (w, p) == (workload, REFERENCE_POLICY)
                     and (base_run := by_repeat.get((workload, policy, k))) is not None]
            out.setdefault(workload, {})[policy] = {
                "num_runs": min(ref["num_runs"], base["num_runs"]),
                "ttft_p50_speedup": _ratio(base["ttft_p50_ms"], ref["ttft_p50_ms"]),
                "ttft_p90_speedup": _ratio(base["ttft_p90_ms"], ref["ttft_p90_ms"]),
                "ttft_p90_speedup_per_repeat": pairs,
                "throughput_ratio": _ratio(ref["output_token_throughput"],
                                           base["output_token_throughput"]),
                "cache_hit_rate_delta": ref["cache_hit_rate"] - base["cache_hit_rate"],
            }
    return out


def build_report(cfg, *, seed: int, engine_flags: list[str], engines: dict, runs: list[dict],
                 machine: dict) -> dict:
    config = {k: _json_safe(v) for k, v in dataclasses.asdict(cfg).items()}
    mid = medians(runs)
    return {"config": config, "seed": seed, "engine_flags": engine_flags, "engines": engines,
            "machine": machine, "runs": runs, "medians": mid, "comparisons": compare(runs, mid)}


def _fmt(value: float | None, spec: str = ".0f") -> str:
    return "-" if value is None else format(value, spec)


def print_summary(report: dict) -> None:
    header = (f"{'workload':<14}{'policy':<14}{'run':>4}{'TTFT p50':>9}{'p90':>8}{'p99':>8}"
              f"{'TPOT p50':>9}{'ITL p50':>8}{'req/s':>7}{'out tok/s':>10}{'hit rate':>9}"
              f"{'per engine':>12}{'err':>5}{'place us':>9}")
    print("latencies in ms")
    print(header)
    for r in report["runs"]:
        spread = "/".join(str(e["num_requests"]) for e in r["per_engine"].values())
        print(f"{r['workload']:<14}{r['policy']:<14}{r.get('repeat', 0):>4}"
              f"{_fmt(r['ttft_ms']['p50']):>9}"
              f"{_fmt(r['ttft_ms']['p90']):>8}{_fmt(r['ttft_ms']['p99']):>8}"
              f"{_fmt(r['tpot_ms']['p50']):>9}{_fmt(r['itl_ms']['p50']):>8}"
              f"{_fmt(r['request_throughput'], '.2f'):>7}"
              f"{_fmt(r['output_token_throughput'], '.1f'):>10}{r['cache_hit_rate']:>9.1%}"
              f"{spread:>12}{r['num_errors']:>5}{_fmt(r['placement_us']['mean']):>9}")
    for r in report["runs"]:
        counters = r.get("engine_cache_counters")
        if counters:
            print(f"{r['workload']}: {r['policy']}: vLLM's prefix-cache counters: "
                  f"{counters['hits']:.0f} of {counters['queries']:.0f} prompt tokens hit "
                  f"({counters['hit_rate']:.1%})")
    for r in report["runs"]:
        if "two_tenants" in r:
            from quire_cli.bench.two_tenants import print_two_tenants

            print_two_tenants(r)
        if "restart" in r:
            from quire_cli.bench.restart import print_restart

            print_restart(r)
    for workload, baselines in report["comparisons"].items():
        for policy, c in baselines.items():
            runs_note = ""
            if c["num_runs"] > 1:
                pairs = ", ".join(_fmt(x, ".2f") for x in c["ttft_p90_speedup_per_repeat"])
                runs_note = f" (medians of {c['num_runs']} runs; p90 per repeat x{pairs})"
            print(f"{workload}: {REFERENCE_POLICY} vs {policy}{runs_note}: TTFT p50 "
                  f"x{_fmt(c['ttft_p50_speedup'], '.2f')} faster, p90 "
                  f"x{_fmt(c['ttft_p90_speedup'], '.2f')}, throughput "
                  f"x{_fmt(c['throughput_ratio'], '.2f')}, hit rate "
                  f"{c['cache_hit_rate_delta']:+.1%}")


def write_outputs(report: dict, json_path: str, png_path: str) -> None:
    json_path, png_path = write_json(report, json_path), Path(png_path)
    wrote = [str(json_path)]
    engines = report.get("engines", {})
    title = f"quire bench serve: {len(report['runs'][0]['per_engine'])} " \
            f"{engines.get('kind', 'quire')} engines" if report["runs"] else None
    if write_plot(png_path, report["runs"], title):
        wrote.append(str(png_path))
    print(f"wrote {' and '.join(wrote)}")


def write_plot(path: Path, runs: list[dict], title: str | None = None) -> bool:
    try:
        from matplotlib.figure import Figure
    except ImportError:
        print("note: matplotlib is not installed; no plot written", file=sys.stderr)
        return False
    workloads = list(dict.fromkeys(r["workload"] for r in runs))
    policies = list(dict.fromkeys(r["policy"] for r in runs))
    by_key = _median_runs(runs)
    fig = Figure(figsize=(13, 8), layout="constrained")
    if title:
        fig.suptitle(title)
    (ax_ttft, ax_tp), (ax_hit, ax_share) = fig.subplots(2, 2)
    width = 0.8 / len(policies)
    for j, policy in enumerate(policies):
        xs = [i + (j - (len(policies) - 1) / 2) * width for i in range(len(workloads))]
        runs_j = [by_key.get((w, policy)) for w in workloads]
        p50 = [r["ttft_ms"]["p50"] or 0 if r else 0 for r in runs_j]
        p90 = [r["ttft_ms"]["p90"] or 0 if r else 0 for r in runs_j]
        # p90 drawn behind p50, lighter: one bar per policy shows both
        ax_ttft.bar(xs, p90, width=width, color=f"C{j}", alpha=0.4)
        ax_ttft.bar(xs, p50, width=width, color=f"C{j}", label=policy)
        ax_tp.bar(xs, [r["output_token_throughput"] or 0 if r else 0 for r in runs_j],
                  width=width, color=f"C{j}", label=policy)
        ax_hit.bar(xs, [r["cache_hit_rate"] if r else 0 for r in runs_j], width=width,
                   color=f"C{j}", label=policy)
    for ax, title, ylabel in (
            (ax_ttft, "TTFT p50 (solid) and p90 (light)", "ms"),
            (ax_tp, "Output token throughput", "tokens/s"),
            (ax_hit, "Prefix cache hit rate (engine-reported)", "cached / prompt tokens")):
        ax.set(title=title, ylabel=ylabel, xticks=range(len(workloads)), xticklabels=workloads)
        ax.legend(fontsize="small")
    restarts = [r for r in runs if r.get("restart")]
    if restarts:  # a restart run's hit rate is a time line, not one bar
        ax_hit.clear()
        _plot_restart(ax_hit, restarts)
    _plot_shares(ax_share, runs)
    fig.savefig(path, dpi=120)
    return True


def _median_runs(runs: list[dict]) -> dict[tuple[str, str], dict]:
    """One bar's figures per (workload, policy): its run, or with repeats the medians of its
    runs (what the comparisons use)."""
    out = {}
    for workload, policies in medians(runs).items():
        for policy, m in policies.items():
            out[workload, policy] = {
                "ttft_ms": {"p50": m["ttft_p50_ms"], "p90": m["ttft_p90_ms"]},
                "output_token_throughput": m["output_token_throughput"],
                "cache_hit_rate": m["cache_hit_rate"]}
    return out


def _plot_restart(ax, runs: list[dict]) -> None:
    """Hit rate per window of sending time, with when the engine was killed, listened again
    and served in the router again (the first run's events as lines)."""
    for k, run in enumerate(runs):
        s = run["restart"]
        half = s["window_s"] / 2
        points = [(w["start_s"] + half, w["hit_rate"]) for w in s["windows"]
                  if w["hit_rate"] is not None]
        ax.plot([x for x, _ in points], [y for _, y in points], marker="o", color=f"C{k}",
                label=f"{run['policy']}" + (f" #{run['repeat']}" if run.get("repeat") else ""))
        if s["steady_hit_rate"] is not None:
            ax.axhline(s["steady_hit_rate"], color=f"C{k}", alpha=0.3, linestyle=":")
    events = runs[0]["restart"]["events_s"]
    for (name, t), style in zip(events.items(), ("-", "--", "-.")):
        ax.axvline(t, color="black", alpha=0.5, linestyle=style, label=name.removesuffix("_s"))
    ax.set(title="Restart: prefix cache hit rate per window (engine-reported)",
           xlabel="request sent at (s)", ylabel="cached / prompt tokens", ylim=(0, 1.05))
    ax.legend(fontsize="small")


def _plot_shares(ax, runs: list[dict]) -> None:
    """Stacked request share per engine, one bar per run: flat bars are even spreads."""
    labels = [f"{r['workload']}\n{r['policy']}" + (f" #{r['repeat']}" if r.get("repeat") else "")
              for r in runs]
    engines = list(dict.fromkeys(e for r in runs for e in r["per_engine"]))
    bottoms = [0.0] * len(runs)
    for k, engine in enumerate(engines):
        shares = [r["per_engine"].get(engine, {}).get("request_share", 0.0) for r in runs]
        ax.bar(range(len(runs)), shares, bottom=bottoms, color=f"C{k}", alpha=0.7,
               label=engine)
        bottoms = [b + s for b, s in zip(bottoms, shares)]
    ax.set(title="Request share per engine", ylabel="share of requests",
           xticks=range(len(runs)), ylim=(0, 1))
    ax.set_xticklabels(labels, fontsize="x-small", rotation=30, ha="right")
    ax.legend(fontsize="small")
