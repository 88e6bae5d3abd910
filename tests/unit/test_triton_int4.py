"""The Triton 4-bit linear kernel (engine_worker/backends/triton_int4_kernel.py) in Triton's CPU
interpreter (tests/conftest.py sets TRITON_INTERPRET=1 before any kernel module is imported),
against de-quantize-then-matmul in fp32 of AWQ / GPTQ weights as the formats' reference
de-quantization gives them; through the ``triton`` backend's own pack_weight / linear.
test_triton_int4_compile.py compiles it for real GPUs. Shapes stay tiny (~10 ms an iteration).

The kernel's weights are exact (integer codes minus zero, each group's sum scaled once in
fp32), so the tolerance is x's dtype and fp32 summation: the reference multiplies x as rounded
to that dtype.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from engine_worker.backends.triton import resolve_triton  # noqa: E402
from engine_worker.backends.triton_int4 import Int4GroupsWeight  # noqa: E402
from engine_worker.weights.int4_checkpoint import int4_layers, parse_int4_config  # noqa: E402
from engine_worker.weights.int4_layouts import LAYOUT_INT4_GROUPS, pack_layers  # noqa: E402
from tests.int4_checkpoints import (pack_awq, pack_gptq, quantize_rtn,  # noqa: E402
                                    reference_awq, reference_gptq)

N, K = 40, 256  # 40: a partial tile of output columns


def _layer(method: str, group: int, sym: bool):
    w = torch.randn(N, K, generator=torch.Generator().manual_seed(group)) * 0.05
    codes, zeros, scales = quantize_rtn(w, group, sym=sym, min_zero=1)
    if method == "awq":
        packed = pack_awq(codes, zeros, scales)
        ref = reference_awq(packed["qweight"], packed["qzeros"], packed["scales"], group)
    else:
        packed = pack_gptq(codes, zeros, scales, group)
        ref = reference_gptq(packed["qweight"], packed["qzeros"], packed["scales"],
                             packed["g_idx"])
    cfg = parse_int4_config({"quantization_config": {"quant_method": method,
                                                     "group_size": group, "sym": sym}})
    layers = int4_layers({f"l.{k}": v for k, v in packed.items()}, cfg)
    return pack_layers(layers, LAYOUT_INT4_GROUPS, torch.float32)["l.weight"], ref


TOLERANCE = {torch.float32: (1e-5, 1e-5), torch.float16: (2e-3, 2e-3),
             torch.bfloat16: (1.6e-2, 1e-2)}


@pytest.mark.parametrize("method, group, sym", [("awq", 128, False), ("gptq", 32, False),
                                                ("gptq", 128, True)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16],
                         ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("rows", [1, 19])  # 19: a partial tile of rows
def test_int4_kernel_matches_dequantize_then_matmul(method, group, sym, dtype, rows):
    backend = resolve_triton(torch.device("cpu"))
    assert "INT4_GROUPS" in backend.quantized_types
    weight, ref = _layer(method, group, sym)
    packed = backend.pack_weight(weight)
    assert isinstance(packed, Int4GroupsWeight) and packed.group == group
    x = torch.randn(rows, K, generator=torch.Generator().manual_seed(rows)).to(dtype)
    bias = torch.randn(N).to(dtype)
    out = backend.linear(x, weight, bias, packed)
    assert out.shape == (rows, N) and out.dtype == dtype
    expected = x.float() @ ref.T + bias.float()
    rtol, atol = TOLERANCE[dtype]
    torch.testing.assert_close(out.float(), expected, rtol=rtol, atol=atol)


def test_float_weights_still_go_through_f_linear():
    backend = resolve_triton(torch.device("cpu"))
    w = torch.randn(8, 16)
    assert backend.pack_weight(w) is None
    x = torch.randn(3, 16)
    torch.testing.assert_close(backend.linear(x, w, None, None), x @ w.T)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("group", [32, 128])
def test_int4_dequantize_kernel_is_exact(dtype, group):
    """The many-rows path's de-quantization (then cuBLAS): each value (code - zero) * scale in
    fp32, rounded once to the dtype, exactly as the reference computes it."""
    from engine_worker.backends.triton_int4 import int4_dequantize
    from engine_worker.weights.int4_layouts import dequantize_int4_groups

    weight, _ = _layer("gptq", group, sym=False)
    out = int4_dequantize(resolve_triton(torch.device("cpu")).pack_weight(weight), dtype)
    assert torch.equal(out, dequantize_int4_groups(weight).to(dtype))
