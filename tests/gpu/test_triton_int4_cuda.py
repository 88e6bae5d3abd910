"""The Triton 4-bit linear kernel on a real GPU against de-quantize-then-matmul in fp32, at
Llama-sized shapes (decode rows and prefill rows). Skipped without a GPU (these machines and
CI have none: there it runs under the interpreter, tests/unit/test_triton_int4.py, and is
compiled for sm_80/sm_90 without running). Prints its time against F.linear on the
de-quantized fp16 weight (no timing asserted). Run with `pytest -m gpu tests/gpu -s`."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU here")]

triton = pytest.importorskip("triton")

from engine_worker.backends.triton_int4 import int4_linear, pack_weight  # noqa: E402
from engine_worker.weights.int4_checkpoint import Int4Groups  # noqa: E402
from engine_worker.weights.int4_layouts import to_int4_groups  # noqa: E402
from tests.int4_checkpoints import quantize_rtn  # noqa: E402


def _time_ms(fn, iters: int = 50) -> float:
    for _ in range(5):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows", [1, 7, 64, 300])
@pytest.mark.parametrize("n, k, group", [(4096, 4096, 128), (11008, 4096, 128), (576, 1536, 32)])
def test_int4_kernel_on_gpu_matches_reference(dtype, rows, n, k, group):
    gen = torch.Generator().manual_seed(rows + n)
    w = torch.randn(n, k, generator=gen) * 0.02
    codes, zeros, scales = quantize_rtn(w, group, sym=False)
    layer = Int4Groups(codes.to(torch.uint8), zeros.to(torch.uint8), scales)
    ref = layer.dequantize().cuda()  # fp32 [N, K]
    weight = pack_weight(to_int4_groups(layer).cuda())
    x = torch.randn(rows, k, generator=gen).to(dtype).cuda()
    out = int4_linear(x, weight, None)
    expected = x.float() @ ref.T
    rtol, atol = {torch.float32: (1e-4, 1e-4), torch.float16: (3e-3, 3e-3),
                  torch.bfloat16: (2e-2, 2e-2)}[dtype]
    torch.testing.assert_close(out.float(), expected, rtol=rtol, atol=atol)
    if dtype == torch.float16:
        dense = ref.half()
        t_int4 = _time_ms(lambda: int4_linear(x, weight, None))
        t_dense = _time_ms(lambda: torch.nn.functional.linear(x, dense))
        print(f"\n[{rows}x{k}] @ [{n}x{k}]^T fp16: int4 {t_int4 * 1e3:.1f} us, "
              f"F.linear fp16 {t_dense * 1e3:.1f} us ({t_dense / t_int4:.2f}x)")
