"""quire_cli.bench.limits: the machine's limits measured on this device, and the fractions
the benchmarks print beside their speed."""

import pytest
import torch

from quire_cli.bench.limits import (MachineLimits, compute_fraction, decode_fraction,
                                    measure_limits, num_parameters, weight_bytes)


def test_measured_limits_are_those_of_a_real_machine():
    limits = measure_limits("cpu", copy_bytes=64 << 20, matmul_size=256, repeats=2)
    assert limits.device == "cpu"
    assert 0.5 < limits.memory_gb_per_s < 10_000  # a copy of 64 MiB: GB/s, not B/s or TB/s
    assert "float32" in limits.matmul_tflops
    assert all(0 < t < 1000 for t in limits.matmul_tflops.values())
    bf16 = torch.ops.mkldnn._is_mkldnn_bf16_supported()
    assert ("bfloat16" in limits.matmul_tflops) == bf16  # only where the CPU multiplies bf16


def test_fractions_are_the_arithmetic_the_readme_states():
    limits = MachineLimits("cpu", memory_gb_per_s=37.0, matmul_tflops={"float32": 0.1,
                                                                       "bfloat16": 0.7})
    # SmolLM2 in bf16 on a Zen 4: 269 MB a step, 117 tok/s -> 31.5 GB/s of 37
    assert decode_fraction(117, 269_000_000, limits) == pytest.approx(0.8505, rel=1e-3)
    # 1000 tokens in 2 s at 2 x 134.5M FLOPs a token, against the best dtype's 0.7 TFLOP/s
    assert compute_fraction(1000, 2.0, 134_500_000, limits) == pytest.approx(0.1921, rel=1e-3)


def test_weights_are_counted_once_when_tied():
    emb = torch.nn.Embedding(10, 4).to(torch.bfloat16)
    head = torch.nn.Linear(4, 10, bias=False).to(torch.bfloat16)
    head.weight = emb.weight
    model = torch.nn.ModuleDict({"emb": emb, "head": head})
    assert num_parameters(model) == 40 and weight_bytes(model) == 80


def test_a_step_streams_the_packed_decode_form_where_a_backend_has_one():
    """The AVX-512 set streams bf16 weights exponent-coded (12 bits a weight) at decode: a
    step's bytes are those, not the bf16 parameters' (a tied table: its packed form once)."""
    from engine_worker.backends.cpu_linear import CpuPackedWeight
    from engine_worker.layers.linear import Linear

    def linear(n: int, k: int, coded: bool) -> Linear:
        lin = Linear(k, n, False, kernel=None, pack=None).to(torch.bfloat16)
        skinny = torch.zeros(n * k * 3 // 2, dtype=torch.uint8) if coded else None
        lin.packed = CpuPackedWeight(onednn=None, skinny=skinny)
        return lin

    model = torch.nn.Module()
    model.proj = linear(64, 32, coded=True)  # 4096 bytes of bf16, 3072 streamed
    model.plain = linear(64, 32, coded=False)  # no decode form: its 4096 bytes
    model.embed_tokens = torch.nn.Embedding(100, 32).to(torch.bfloat16)  # 6400 bytes
    model.lm_head = None  # tied: the logits stream the table's packed form
    model.logits_packed = CpuPackedWeight(onednn=None, skinny=torch.zeros(4800, dtype=torch.uint8))
    assert weight_bytes(model) == 3072 + 4096 + 4800
    model.logits_packed = CpuPackedWeight(onednn=None, skinny=None)  # the table as loaded
    assert weight_bytes(model) == 3072 + 4096 + 6400
