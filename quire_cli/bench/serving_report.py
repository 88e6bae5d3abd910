"""The report of ``quire bench serving``: figures read from vLLM's client result JSON, the
ratios the issue's targets are stated in, a table and a plot. Pure functions over plain data
(no torch, no vLLM), so the tests check them exactly.

Every serving figure is the client's own (``vllm bench serve --save-result``): nothing is
recomputed here, only picked out and divided. Beside them, each server's CPU time during the
run (``cpu_time``, read from ``/proc`` around the client), so a run also says where the cores
went.
"""

from __future__ import annotations

import sys
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from quire_cli.bench import cpu_time
from quire_cli.bench.serve_report import median_of_known

# (report name, key in vLLM's result JSON); percentiles need --metric-percentiles 50,90
CLIENT_METRICS = (
    ("output_tokens_per_s", "output_throughput"),
    ("ttft_p50_ms", "median_ttft_ms"),
    ("ttft_p90_ms", "p90_ttft_ms"),
    ("tpot_p50_ms", "median_tpot_ms"),
    ("itl_p50_ms", "median_itl_ms"),
    ("num_completed", "completed"),
    ("num_failed", "failed"),
    ("num_output_tokens", "total_output_tokens"),
    ("duration_s", "duration"),
)


# each system's server CPU time in a run (cpu_time.summarize), medians over repeats
CPU_FIGURES = ("server_cpu_s", "front_cpu_s", "engine_main_thread_cpu_s",
               "engine_other_threads_cpu_s", "server_cpu_ms_per_output_token")


@dataclass(frozen=True, slots=True)
class ServingFigures:
    """One system's serving run of one scenario, as the client measured it."""

    output_tokens_per_s: float
    ttft_p50_ms: float
    ttft_p90_ms: float
    tpot_p50_ms: float
    itl_p50_ms: float
    num_completed: int
    num_failed: int
    num_output_tokens: int
    duration_s: float


def figures_from_client(result: dict) -> ServingFigures:
    """The figures of one client result JSON; ValueError naming a missing key (a client run
    without ``--metric-percentiles 50,90``, or one whose requests all failed)."""
    missing = [key for _, key in CLIENT_METRICS if result.get(key) is None]
    if missing:
        raise ValueError(f"client result: no {', '.join(missing)} (completed "
                         f"{result.get('completed')}, failed {result.get('failed')})")
    return ServingFigures(**{name: result[key] for name, key in CLIENT_METRICS})


def _ratio(numerator: float | None, denominator: float | None) -> float | None:
    if numerator is None or not denominator:
        return None
    return numerator / denominator


def scenario_ratios(quire: ServingFigures, vllm: ServingFigures | None,
                    offline_tokens_per_s: float | None) -> dict[str, float | None]:
    """Quire / vLLM per figure (throughput above 1 is better for Quire; TTFT and TPOT below 1
    are), and Quire's serving throughput over its own offline throughput."""
    v = vllm
    return {
        "output_throughput_quire_over_vllm":
            _ratio(quire.output_tokens_per_s, v and v.output_tokens_per_s),
        "ttft_p50_quire_over_vllm": _ratio(quire.ttft_p50_ms, v and v.ttft_p50_ms),
        "ttft_p90_quire_over_vllm": _ratio(quire.ttft_p90_ms, v and v.ttft_p90_ms),
        "tpot_p50_quire_over_vllm": _ratio(quire.tpot_p50_ms, v and v.tpot_p50_ms),
        "itl_p50_quire_over_vllm": _ratio(quire.itl_p50_ms, v and v.itl_p50_ms),
        "quire_serving_over_offline": _ratio(quire.output_tokens_per_s, offline_tokens_per_s),
    }


def cpu_figures(run: dict, num_output_tokens: int) -> dict[str, float | None]:
    """A run's server CPU (``cpu_time.summarize``), each figure None where the run measured
    none (a server without a known process)."""
    if run.get("server_cpu") is None:
        return dict.fromkeys(CPU_FIGURES)
    return cpu_time.summarize(run["server_cpu"], num_output_tokens)


def scenario_report(name: str, runs: dict[str, dict], offline: dict | None) -> dict:
    """One scenario's entry: each system's figures (from its client JSON, kept whole under
    ``client_result``) and server CPU time, Quire's offline run, and the ratios."""
    figures = {system: figures_from_client(run["client_result"])
               for system, run in runs.items()}
    offline_tps = offline["output_tokens_per_s"] if offline else None
    return {"scenario": name,
            "serving": {system: {**asdict(figures[system]),
                                 **cpu_figures(run, figures[system].num_output_tokens), **run}
                        for system, run in runs.items()},
            "offline_quire": offline,
            "ratios": scenario_ratios(figures["quire"], figures.get("vllm"), offline_tps)}


# counts over repeats: the worst run's (a median would hide one run's failures)
COUNT_SUMMARY = {"num_completed": min, "num_failed": max, "num_output_tokens": min}


def repeated_report(name: str, runs: list[dict[str, dict]],
                    offlines: list[dict | None]) -> dict:
    """One scenario over its repeats (one ``{system: run}`` and one offline result a repeat).
    One repeat: ``scenario_report``'s entry. Several: each system's figures are the medians
    over the runs (the counts: the worst run's), each ratio the median of the runs' own ratios
    (Quire/vLLM: each from two client runs back to back, so a slow phase of the machine falls
    on both sides of it; serving/offline pairs a repeat's serving run with its offline run,
    which ran after all the serving), with its range; ``runs`` keeps every run's whole
    entry."""
    entries = [scenario_report(name, r, o) for r, o in zip(runs, offlines, strict=True)]
    if len(entries) == 1:
        return entries[0]
    serving = {system: {key: COUNT_SUMMARY.get(key, median_of_known)(
                            [e["serving"][system][key] for e in entries])
                        for key in (*(f.name for f in fields(ServingFigures)), *CPU_FIGURES)}
               for system in entries[0]["serving"]}
    offline_tps = median_of_known([o and o["output_tokens_per_s"] for o in offlines])
    offline = None if offline_tps is None else {"output_tokens_per_s": offline_tps}
    ratios = {key: median_of_known([e["ratios"][key] for e in entries])
              for key in entries[0]["ratios"]}
    ranges = {key: [min(known), max(known)] if (known := [e["ratios"][key] for e in entries
                                                          if e["ratios"][key] is not None])
              else None for key in ratios}
    return {"scenario": name, "repeats": len(entries), "serving": serving,
            "offline_quire": offline, "ratios": ratios, "ratio_ranges": ranges,
            "runs": entries}


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def format_table(scenarios: list[dict]) -> str:
    """The figures and ratios of every scenario as aligned text (medians, and the runs'
    ranges, for repeated scenarios)."""
    lines = [f"{'scenario':<26}{'system':<15}{'out tok/s':>10}{'TTFT p50':>10}{'TTFT p90':>10}"
             f"{'TPOT p50':>10}{'ITL p50':>9}  (ms)"]
    for s in scenarios:
        for system, run in s["serving"].items():
            lines.append(f"{s['scenario']:<26}{system + ' serving':<15}"
                         f"{run['output_tokens_per_s']:>10.1f}{run['ttft_p50_ms']:>10.0f}"
                         f"{run['ttft_p90_ms']:>10.0f}{run['tpot_p50_ms']:>10.1f}"
                         f"{run['itl_p50_ms']:>9.1f}")
        for system, run in s["serving"].items():
            if run.get("server_cpu_s") is not None:
                lines.append(f"{'':<26}{system} CPU s: {run['server_cpu_s']:.1f} in all: "
                             f"front {run['front_cpu_s']:.1f}, engine processes' main threads "
                             f"{run['engine_main_thread_cpu_s']:.1f}, their other threads "
                             f"{run['engine_other_threads_cpu_s']:.1f} "
                             f"({_fmt(run['server_cpu_ms_per_output_token'], '.2f')} ms a "
                             f"token)")
        if s["offline_quire"]:
            lines.append(f"{s['scenario']:<26}{'quire offline':<15}"
                         f"{s['offline_quire']['output_tokens_per_s']:>10.1f}")
        r = s["ratios"]
        lines.append(f"{'':<26}Quire/vLLM: throughput "
                     f"{_fmt(r['output_throughput_quire_over_vllm'], '.2f')}x, TTFT p50 "
                     f"{_fmt(r['ttft_p50_quire_over_vllm'], '.2f')}, TPOT p50 "
                     f"{_fmt(r['tpot_p50_quire_over_vllm'], '.2f')}; Quire serving/offline "
                     f"{_fmt(r['quire_serving_over_offline'], '.2f')}")
        if s.get("repeats", 1) > 1:
            span = s["ratio_ranges"]
            lines.append(f"{'':<26}medians of {s['repeats']} runs; the runs' throughput ratios "
                         f"{_span(span['output_throughput_quire_over_vllm'], 'x')}, "
                         f"serving/offline {_span(span['quire_serving_over_offline'], '')}")
    return "\n".join(lines)


def _span(pair: list[float] | None, unit: str) -> str:
    return "-" if pair is None else f"{pair[0]:.2f}-{pair[1]:.2f}{unit}"


SERIES = (("quire", "Quire serving", "tab:blue"), ("vllm", "vLLM serving", "tab:gray"))


def _series(scenarios: list[dict], system: str, key: str) -> list[float]:
    return [s["serving"].get(system, {}).get(key, 0.0) for s in scenarios]


def write_plot(path: Path, scenarios: list[dict], title: str) -> bool:
    """Grouped bars per scenario: output throughput (with Quire offline), TTFT p50, TPOT p50.
    False (and a note) without matplotlib."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        print("note: matplotlib is not installed (pip install quire[bench]); no plot written",
              file=sys.stderr)
        return False
    names = [s["scenario"].replace("/", "\n") for s in scenarios]
    offline = [(s["offline_quire"] or {}).get("output_tokens_per_s", 0.0) for s in scenarios]
    panels = (("Output throughput", "tokens/s", "output_tokens_per_s", offline, "%.0f"),
              ("TTFT p50", "ms", "ttft_p50_ms", None, "%.0f"),
              ("TPOT p50", "ms", "tpot_p50_ms", None, "%.1f"))
    fig = Figure(figsize=(15, 4.8), layout="constrained")
    for ax, (panel, ylabel, key, extra, fmt) in zip(fig.subplots(1, 3), panels):
        series = [(label, color, _series(scenarios, system, key))
                  for system, label, color in SERIES]
        if extra is not None:
            series.append(("Quire offline", "tab:cyan", extra))
        width = 0.8 / len(series)
        for i, (label, color, values) in enumerate(series):
            xs = [x + (i - (len(series) - 1) / 2) * width for x in range(len(names))]
            ax.bar_label(ax.bar(xs, values, width, label=label, color=color), fmt=fmt,
                         fontsize=7)
        ax.set_xticks(range(len(names)), names, fontsize=8)
        ax.set(title=panel, ylabel=ylabel)
        ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=10)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    return True
