"""quire bench serve's plot of a restart run: the hit rate per window as a time line with the
kill, the new process listening and its return to the router's pool."""

from __future__ import annotations

import pytest

from quire_cli.bench.harness import RequestResult
from quire_cli.bench.restart import restart_report
from quire_cli.bench.serve_report import _plot_restart, write_plot


def _result(i: int, sent_s: float, cached: int) -> RequestResult:
    return RequestResult(req_id=f"r{i}", engine_id="e0", sent_s=sent_s, end_s=sent_s + 0.2,
                         chunks=((sent_s + 0.1, 2),), prompt_tokens=100, cached_tokens=cached,
                         finish_reason="FINISH_REASON_LENGTH")


def _run() -> dict:
    results = [_result(i, 0.5 * i, 0 if 8 <= i < 11 else 90) for i in range(20)]
    events = {"killed_s": 4.0, "listening_s": 5.0, "rejoined_s": 5.5}
    report = restart_report(results, events, 2.0, retries=1, victim="e1", migrations=2)
    return {"policy": "prefix_aware", "workload": "restart", "restart": report,
            "ttft_ms": {"p50": 100.0, "p90": 100.0}, "output_token_throughput": 10.0,
            "cache_hit_rate": 0.8, "per_engine": {"e0": {"request_share": 1.0}}}


def test_the_restart_report_counts_moved_streams_and_the_windows():
    report = _run()["restart"]
    assert (report["router_retries"], report["router_migrations"]) == (1, 2)
    # 2 s windows of four requests; three cold ones (sent at 4.0-5.0 s) in the third
    assert [w["hit_rate"] for w in report["windows"]] == pytest.approx([0.9, 0.9, 0.225, 0.9,
                                                                        0.9])
    assert report["lowest_window_hit_rate_after_kill"] == pytest.approx(0.225)


def test_a_restart_run_is_plotted_as_a_time_line(tmp_path):
    from matplotlib.figure import Figure

    ax = Figure().subplots()
    _plot_restart(ax, [_run()])
    line = ax.get_lines()[0]
    assert list(line.get_xdata()) == pytest.approx([1.0, 3.0, 5.0, 7.0, 9.0])
    assert list(line.get_ydata())[2] == pytest.approx(0.225)
    verticals = [tuple(v.get_xdata()) for v in ax.get_lines() if v.get_label() in (
        "killed", "listening", "rejoined")]
    assert verticals == [(4.0, 4.0), (5.0, 5.0), (5.5, 5.5)]
    assert write_plot(tmp_path / "restart.png", [_run()], "t")
    assert (tmp_path / "restart.png").stat().st_size > 0
