"""AWQ / GPTQ weights on the CPU kernels (every variant): repacked at load into GGUF blocks
(``weights.int4_layouts.to_gguf_blocks``) and multiplied by csrc/cpu/quant_linear.cpp through
the backend's own ``pack_weight`` / ``linear``, against de-quantize-then-matmul in fp32 of the
checkpoint's values as the formats' reference de-quantization gives them.

Error budget, asserted row by row: decode rounds x to int8 per block of 32
(``x_rounding_bound``, as for GGUF weights); an asymmetric layer's Q4_1 offset m = -d z is
rounded to fp16 (at most 2^-11 |d z| a weight, so sum_k |x_k| 2^-11 |d z|(k) a row); a symmetric
GPTQ layer is Q4_0 and exact. Prefill de-quantizes the blocks and runs a float matmul.
"""

from __future__ import annotations

import pytest
import torch

from engine_worker.backends.cpu_linear import GgufBlocks
from engine_worker.weights.int4_checkpoint import int4_layers, parse_int4_config
from engine_worker.weights.int4_layouts import LAYOUT_GGUF_BLOCKS, pack_layers
from tests.int4_checkpoints import (pack_awq, pack_gptq, quantize_rtn, reference_awq,
                                    reference_gptq)
from tests.unit.ops.test_quant_linear import x_rounding_bound

N, K, GROUP = 72, 384, 128


def _checkpoint_layer(method: str, sym: bool):
    """(the layer's weight as the loader makes it for the CPU sets, the reference values
    fp32 [N, K], the per-weight bound of the fp16 offset rounding [N, K])."""
    w = torch.randn(N, K, generator=torch.Generator().manual_seed(5)) * 0.05
    codes, zeros, scales = quantize_rtn(w, GROUP, sym=sym, min_zero=1 if method == "gptq" else 0)
    if method == "awq":
        packed = pack_awq(codes, zeros, scales)
        ref = reference_awq(packed["qweight"], packed["qzeros"], packed["scales"], GROUP)
    else:
        packed = pack_gptq(codes, zeros, scales, GROUP)
        ref = reference_gptq(packed["qweight"], packed["qzeros"], packed["scales"],
                             packed["g_idx"])
    cfg = parse_int4_config({"quantization_config": {"quant_method": method, "sym": sym}})
    layers = int4_layers({f"l.{k}": v for k, v in packed.items()}, cfg)
    weight = pack_layers(layers, LAYOUT_GGUF_BLOCKS, torch.float32)["l.weight"]
    offset = 0.0 if sym else (scales.float() * zeros.float()).repeat_interleave(GROUP, 1) * 2**-11
    return weight, ref, torch.as_tensor(offset, dtype=torch.float32).expand(N, K)


CASES = [("awq", False), ("gptq", True), ("gptq", False)]


@pytest.mark.cpu_ops("quant_linear")
@pytest.mark.parametrize("method, sym", CASES)
@pytest.mark.parametrize("rows", [1, 3, 8, 16])
def test_awq_gptq_on_the_cpu_kernels_match_dequantize_then_matmul(cpu_kernels, method, sym,
                                                                   rows):
    weight, ref, offset = _checkpoint_layer(method, sym)
    assert weight.shape[2] == (18 if sym else 20)  # Q4_0 where every zero is 8, else Q4_1
    packed = cpu_kernels.backend.pack_weight(weight)
    assert isinstance(packed, GgufBlocks)
    x = torch.randn(rows, K, generator=torch.Generator().manual_seed(rows))
    bias = torch.randn(N)
    out = cpu_kernels.backend.linear(x, weight, bias, packed)
    expected = x @ ref.T + bias
    bound = x.abs() @ offset.T + 1e-4
    if rows <= 8:  # decode: x rounded to int8 per block
        bound = bound + x_rounding_bound(x, ref) * 1.01
    else:
        bound = bound + 1e-4 * expected.abs()
    assert out.shape == (rows, N)
    assert ((out - expected).abs() <= bound).all(), (out - expected).abs().max()
    # the bound means something: the offsets' share is small, the whole well below the output
    assert (x.abs() @ offset.T).mean() < 0.05 * expected.abs().mean()
    assert bound.mean() < 0.2 * expected.abs().mean()
