"""`quire bench throughput` and `quire bench latency` end to end on a tiny random model: the
JSON they write is complete and its counts are consistent. No timing is asserted (benchmarks
are not tests)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from quire_cli.bench.step_profile import PARTS

pytestmark = pytest.mark.slow  # each benchmark runs in a process of its own that loads engines


def _bench(model_dir, tmp_path, *args) -> dict:
    out = tmp_path / "throughput.json"
    result = subprocess.run(
        [sys.executable, "-m", "quire_cli", "bench", "throughput", "--model", str(model_dir),
         "--dtype", "bfloat16", "--kv-cache-memory-bytes", str(1 << 24), "--num-prompts", "6",
         "--max-input-len", "40", "--min-output-len", "4", "--max-output-len", "12",
         "--hf-batch-size", "3",
         "--output-json", str(out), *args],
        capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert (tmp_path / "throughput.png").stat().st_size > 0
    return json.loads(out.read_text())


@pytest.mark.parametrize("ignore_eos, sampling", [
    (True, ()), (False, ()), (True, ("--temperature", "1", "--top-p", "0.9"))],
    ids=["ignore-eos", "eos", "sampled"])
def test_bench_throughput_counts_and_split(tiny_model_dir, tmp_path, ignore_eos, sampling):
    report = _bench(tiny_model_dir, tmp_path, "--batch-sizes", "1,4", "--sweep-prompt-len",
                    "16", "--sweep-output-len", "6", *(["--ignore-eos"] if ignore_eos else []),
                    *sampling)
    requested = report["workload"]["num_output_tokens"]
    quire, hf = report["quire"], report["hf"]
    assert quire["num_requests"] == hf["num_requests"] == 6
    if ignore_eos:
        assert quire["num_output_tokens"] == hf["num_output_tokens"] == requested
    else:  # a request may stop at EOS, never past its limit
        assert 6 <= quire["num_output_tokens"] <= requested
        assert 6 <= hf["num_output_tokens"] <= requested
    # a static batch decodes to its longest member: at least every useful token
    assert hf["num_generated_tokens"] >= hf["num_output_tokens"]
    assert report["ratio_output_tokens_per_s"] == pytest.approx(
        quire["output_tokens_per_s"] / hf["output_tokens_per_s"])
    from engine_worker.backends import BACKENDS

    assert report["environment"]["kernels"] in BACKENDS
    assert report["config"]["temperature"] == (1.0 if sampling else 0.0)
    machine = report["environment"]["machine"]  # measured in the run, the fraction derived
    assert machine["memory_gb_per_s"] > 0 and machine["matmul_tflops"]["float32"] > 0
    total = quire["num_input_tokens"] + quire["num_output_tokens"]
    assert machine["quire_fraction_of_matmul_peak"] == pytest.approx(
        total * 2 * machine["parameters"] / quire["elapsed_s"]
        / (max(machine["matmul_tflops"].values()) * 1e12), rel=1e-2)
    sweep = report["batch_size_sweep"]
    assert [p["batch_size"] for p in sweep] == [1, 4]
    for point in sweep:
        assert point["num_passes"] == 5  # 6 tokens each: the first from the prefill
        assert point["num_steps"] == 1  # the 5 passes in one multi-step run (LLM's default)
        assert set(point["decode_step_ms"]) == set(PARTS)
        assert all(v >= 0 for v in point["decode_step_ms"].values())
        assert point["decode_step_ms"]["model"] > 0 and point["decode_step_ms"]["attention"] > 0


def test_bench_latency_reports_both_systems(tiny_model_dir, tmp_path):
    out = tmp_path / "latency.json"
    result = subprocess.run(
        [sys.executable, "-m", "quire_cli", "bench", "latency", "--model", str(tiny_model_dir),
         "--dtype", "bfloat16", "--kv-cache-memory-bytes", str(1 << 24), "--prompt-len", "40",
         "--output-len", "12", "--repeats", "2", "--output-json", str(out)],
        capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(out.read_text())
    for system in ("quire", "hf"):
        r = report[system]
        assert len(r["ttft_runs_s"]) == len(r["decode_runs"]) == 2
        assert r["ttft_s"] > 0 and r["decode_tokens_per_s"] > 0
    assert report["ratio_decode"] == pytest.approx(
        report["quire"]["decode_tokens_per_s"] / report["hf"]["decode_tokens_per_s"])
    assert report["ratio_ttft"] == pytest.approx(report["hf"]["ttft_s"] / report["quire"]["ttft_s"])
    machine = report["machine"]
    assert machine["weight_bytes"] > 0 and machine["memory_gb_per_s"] > 0
    assert machine["decode_fraction_of_memory_bandwidth"] == pytest.approx(
        report["quire"]["decode_tokens_per_s"] * machine["weight_bytes"]
        / (machine["memory_gb_per_s"] * 1e9), rel=1e-2)


def test_bench_throughput_with_a_json_schema(tiny_model_dir, tmp_path):
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps({"type": "object", "required": ["a"], "properties": {
        "a": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99}}}}))
    report = _bench(tiny_model_dir, tmp_path, "--skip-hf", "--json-schema", str(schema),
                    "--schema-repeats", "2")
    plain, structured = report["quire"], report["json_schema"]
    turns = structured["turns"]  # each: with the schema, then without it at its lengths
    assert len(turns) == 2 and \
        turns[0]["json_schema"]["num_output_tokens"] == structured["num_output_tokens"]
    for turn in turns:
        assert turn["ratio"] == pytest.approx(turn["json_schema"]["output_tokens_per_s"]
                                              / turn["plain"]["output_tokens_per_s"])
        # the same token work on both sides (greedy: the same lengths in both turns)
        assert turn["plain"]["num_output_tokens"] == turn["json_schema"]["num_output_tokens"] \
            == structured["num_output_tokens"]
        assert turn["plain"]["num_input_tokens"] == plain["num_input_tokens"]
    assert structured["ratio_median"] == pytest.approx(
        (turns[0]["ratio"] + turns[1]["ratio"]) / 2)
    assert structured["ratio_output_tokens_per_s_vs_plain"] == turns[0]["ratio"]
    assert structured["schema"] == json.loads(schema.read_text())
    assert structured["system"] == "quire+json-schema" and structured["num_requests"] == 6
    assert 6 <= structured["num_output_tokens"] <= report["workload"]["num_output_tokens"]
