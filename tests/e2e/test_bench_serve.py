"""`quire bench serve` and `quire bench router-overhead` end to end on a tiny random model:
the JSON they write is complete and consistent. No timing is asserted (benchmarks are not
tests); only counts, shares and the cache hit rate, which do not depend on speed."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow  # each benchmark starts engine processes

ENGINE_FLAGS = ("--dtype", "float32", "--kv-cache-memory-bytes", str(1 << 24))


def _bench(model_dir, tmp_path, name: str, *args) -> dict:
    out = tmp_path / f"{name}.json"
    result = subprocess.run(
        [sys.executable, "-m", "quire_cli", "bench", name, "--model", str(model_dir),
         *ENGINE_FLAGS, "--output-json", str(out), "--output-png",
         str(tmp_path / f"{name}.png"), *args],
        capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "wrote" in result.stdout
    return json.loads(out.read_text())


def test_bench_serve_compares_policies(tiny_model_dir, tmp_path):
    # One request at a time (all arrive at once, then queue in the client): prefix_aware
    # then finds a group's cached system prompt (unless a load report caught that engine
    # mid-prefill), so round robin cannot beat its hit rate.
    report = _bench(tiny_model_dir, tmp_path, "serve", "--num-groups", "2",
                    "--prompts-per-group", "3", "--system-prompt-len", "48", "--question-len",
                    "8", "--output-len", "4", "--request-rate", "inf", "--max-concurrency", "1",
                    "--num-engines", "2", "--policies", "prefix_aware,round_robin")
    assert report["config"]["request_rate"] == "inf"
    assert {"cpu_count", "load_average", "load_average_after"} <= set(report["machine"])
    runs = {(r["workload"], r["policy"]): r for r in report["runs"]}
    assert set(runs) == {(w, p) for w in ("shared_prefix", "no_sharing")
                         for p in ("prefix_aware", "round_robin")}
    for run in runs.values():
        assert run["num_requests"] == run["num_finished"] == 6 and run["num_errors"] == 0
        assert run["prompt_tokens"] == 6 * 56 and run["output_tokens"] == 6 * 4
        assert 0.0 <= run["cache_hit_rate"] <= 1.0
        engines = run["per_engine"]
        assert set(engines) == {"engine-0", "engine-1"}
        assert sum(e["num_requests"] for e in engines.values()) == 6
        assert abs(sum(e["prompt_token_share"] for e in engines.values()) - 1) < 1e-9
        for metric in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
            assert set(run[metric]) == {"p50", "p90", "p99", "mean"}
            assert run[metric]["p50"] <= run[metric]["p99"]
        assert run["placement_us"]["mean"] > 0
        assert all(r["finish_reason"] == "FINISH_REASON_LENGTH" and r["output_tokens"] == 4
                   for r in run["requests"])
    # round robin alternates between the two engines
    assert [e["num_requests"] for e in runs["shared_prefix", "round_robin"]["per_engine"]
            .values()] == [3, 3]
    assert runs["no_sharing", "prefix_aware"]["cache_hit_rate"] == 0.0
    shared = runs["shared_prefix", "prefix_aware"]
    # at most 2 groups x 2 followers find the 48-token system prompt (3 full blocks) cached
    assert 0 < shared["cached_tokens"] <= 4 * 48 and shared["cached_tokens"] % 16 == 0
    assert shared["cache_hit_rate"] >= runs["shared_prefix", "round_robin"]["cache_hit_rate"]
    comparison = report["comparisons"]["shared_prefix"]["round_robin"]
    assert {"ttft_p50_speedup", "ttft_p90_speedup", "throughput_ratio",
            "cache_hit_rate_delta"} <= set(comparison)
    assert {r["repeat"] for r in report["runs"]} == {0} and comparison["num_runs"] == 1
    assert report["medians"]["shared_prefix"]["prefix_aware"]["ttft_p90_ms"] == \
        shared["ttft_ms"]["p90"]
    assert (tmp_path / "serve.png").stat().st_size > 0


def test_bench_router_overhead(tiny_model_dir, tmp_path):
    report = _bench(tiny_model_dir, tmp_path, "router-overhead", "--num-requests", "6",
                    "--prompt-len", "32", "--output-len", "4")
    for path in ("direct", "routed"):
        assert report[path]["num_requests"] == 6 and report[path]["num_errors"] == 0
        assert len(report["samples_ms"][path]["ttft"]) == 6
    assert set(report["added_ms"]) == {"ttft_ms", "e2e_ms"}
    assert "paired_median" in report["added_ms"]["ttft_ms"]
    assert report["placement_us"]["num_decisions"] == 6
    assert (tmp_path / "router-overhead.png").stat().st_size > 0


def test_bench_serve_two_tenants(tiny_model_dir, tmp_path):
    """One tenant floods, the other sends now and then: every heavy request completes or is
    refused with RESOURCE_EXHAUSTED, none fails otherwise, and nothing is left running."""
    report = _bench(tiny_model_dir, tmp_path, "serve", "--workloads", "two_tenants",
                    "--policies", "least_loaded", "--num-engines", "2", "--max-num-seqs", "2",
                    "--system-prompt-len", "16", "--question-len", "8", "--output-len", "48",
                    "--flood-rate", "40", "--flood-duration-s", "3", "--light-interval-s", "1",
                    "--light-idle-requests", "2", "--tenant-max-queue", "4")
    (run,) = report["runs"]
    scenario = run["two_tenants"]
    heavy = scenario["heavy"]
    assert heavy["sent"] == heavy["completed"] + heavy["refused_429"] > 0
    assert heavy["other_errors"] == 0 and scenario["light_errors"] == 0, scenario["errors"]
    assert scenario["light_idle_ms"]["num_ok"] == 2 and scenario["light_flood_ms"]["num_ok"] >= 2
    assert scenario["left_running"] == {"router_inflight": 0, "router_queued": 0,
                                        "engine_running": 0, "engine_waiting": 0}
    assert scenario["light_p90_over_idle_p50"] > 0
    assert run["num_errors"] == heavy["refused_429"]


def test_bench_serve_restart(tiny_model_dir, tmp_path):
    """An engine killed with SIGKILL under shared-prefix traffic and restarted at its address:
    no request fails before its first token (the router retries it on the other engine), the
    router serves the new process, and the hit rate is reported per window."""
    report = _bench(tiny_model_dir, tmp_path, "serve", "--workloads", "restart",
                    "--policies", "prefix_aware", "--num-engines", "2", "--num-groups", "2",
                    "--system-prompt-len", "48", "--question-len", "8", "--output-len", "4",
                    "--request-rate", "8", "--restart-kill-at-s", "3", "--restart-after-s", "3",
                    "--restart-window-s", "1")
    (run,) = report["runs"]
    restart = run["restart"]
    events = restart["events_s"]
    assert events["killed_s"] < events["listening_s"] <= events["rejoined_s"]
    assert restart["client_errors_before_tokens"] == 0, restart["errors"]
    assert restart["client_errors"] == run["num_errors"] == restart["client_errors_after_tokens"]
    windows = restart["windows"]
    assert sum(w["requests"] for w in windows) == run["num_requests"]
    assert windows[-1]["start_s"] >= events["rejoined_s"] + 1  # traffic went on after
    assert all(w["hit_rate"] is None or 0.0 <= w["hit_rate"] <= 1.0 for w in windows)
    # two system prompts of 3 full blocks each: once computed, later requests find them
    assert restart["steady_hit_rate"] > 0 and restart["hit_rate_after_return"] > 0
