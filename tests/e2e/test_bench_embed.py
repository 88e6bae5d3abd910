"""`quire bench embed` end to end on a tiny random model: its JSON is complete and both sides
computed the same vectors. No timing is asserted (benchmarks are not tests)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow  # runs in a process of its own that loads an engine and a model


@pytest.mark.parametrize("pooling_type", ["LAST", "MEAN"])
def test_bench_embed_report(tiny_model_dir, tmp_path, pooling_type):
    out = tmp_path / "embed.json"
    result = subprocess.run(
        [sys.executable, "-m", "quire_cli", "bench", "embed", "--model", str(tiny_model_dir),
         "--kv-cache-memory-bytes", str(1 << 24), "--num-inputs", "10", "--min-len", "1",
         "--max-len", "70", "--hf-batch-size", "4", "--max-num-batched-tokens", "64",
         "--pooler-config", json.dumps({"pooling_type": pooling_type}), "--repeats", "2",
         "--output-json", str(out)],
        capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["num_inputs"] == 10 and report["pooling_type"] == pooling_type
    assert report["dtype"] == report["hf_dtype"] == "float32" and report["normalize"] is True
    assert report["min_cosine_similarity"] > 1 - 1e-5  # padded batches and ours agree
    assert report["ratio"] == pytest.approx(report["hf"]["elapsed_s"]
                                            / report["quire"]["elapsed_s"])
    assert report["quire"]["tokens_per_s"] * report["quire"]["elapsed_s"] == \
        pytest.approx(report["num_tokens"])
    first, second = report["turns"]  # taking turns; the first heads the report
    assert first["quire_s"] == report["quire"]["elapsed_s"] and first["hf_s"] == \
        report["hf"]["elapsed_s"]
    assert second["ratio"] == pytest.approx(second["hf_s"] / second["quire_s"])
    assert report["ratio_median"] == pytest.approx((first["ratio"] + second["ratio"]) / 2)
    # the bound: the tiny model's linear weights, at the fp32 matmul peak measured in the run
    ceiling = report["matmul_ceiling"]
    # tiny_model_dir: 3 layers of q, o (64 x 64), k, v (32 x 64: 2 KV heads of 16), 3 MLP (64 x 128)
    assert ceiling["linear_parameters"] == 3 * (2 * 64 * 64 + 2 * 32 * 64 + 3 * 64 * 128)
    assert ceiling["matmul_gflops"] == pytest.approx(
        report["machine"]["matmul_tflops"]["float32"] * 1000, rel=1e-3)
    assert ceiling["tokens_per_s"] == pytest.approx(
        ceiling["matmul_gflops"] * 1e9 / (2 * ceiling["linear_parameters"]))
    assert ceiling["ratio_to_hf"] == pytest.approx(
        ceiling["tokens_per_s"] / report["hf"]["tokens_per_s"])


def test_bench_embed_with_transformers_in_its_own_dtype(tiny_model_dir, tmp_path):
    # a Zen 3's comparison: Quire's bf16 weights (its AVX2 kernels widen them) against
    # transformers in fp32, whose bf16 matmul is emulated there; the ceiling is fp32's
    out = tmp_path / "embed.json"
    result = subprocess.run(
        [sys.executable, "-m", "quire_cli", "bench", "embed", "--model", str(tiny_model_dir),
         "--kv-cache-memory-bytes", str(1 << 24), "--num-inputs", "6", "--min-len", "1",
         "--max-len", "40", "--hf-batch-size", "4", "--dtype", "bfloat16", "--hf-dtype",
         "float32", "--output-json", str(out)],
        capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "bfloat16 (transformers float32)" in result.stdout
    report = json.loads(out.read_text())
    assert (report["dtype"], report["hf_dtype"]) == ("bfloat16", "float32")
    # bf16 weights and activations against fp32: close, not equal
    assert 0.99 < report["min_cosine_similarity"] < 1 - 1e-7
    assert report["matmul_ceiling"]["matmul_gflops"] == pytest.approx(
        report["machine"]["matmul_tflops"]["float32"] * 1000, rel=1e-3)
