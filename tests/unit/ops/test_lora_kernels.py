"""The CPU kernel sets' batched LoRA (csrc/cpu/lora.cpp) against the reference pair
(engine_worker/lora/ops.py), on every variant: mixed slots with base tokens between, one
adapter on every token, ranks that are not a multiple of the vector width; fp32 and bf16; the
vector tiles (a slot's few tokens) and the matmul path (a slot's many tokens, in one run or
scattered); a fused projection's block-diagonal B read slice by slice."""

from __future__ import annotations

import pytest
import torch

from engine_worker.lora.ops import REFERENCE_OPS, LoRAGroups, cpu_kernel_ops

TOLERANCE = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=2e-2,
                                                                            atol=2e-2)}


def _groups(token_slots: list[int]) -> LoRAGroups:
    slots = torch.tensor(token_slots, dtype=torch.int64)
    present = sorted(set(token_slots) - {0})
    if len(present) == 1 and 0 not in token_slots:
        return LoRAGroups(len(token_slots), ((present[0], None),), slots)
    return LoRAGroups(len(token_slots), tuple((s, (slots == s).nonzero().flatten())
                                              for s in present), slots)


@pytest.mark.cpu_ops("lora_shrink", "lora_expand")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("token_slots,rank,k,n", [
    ([0, 1, 2, 0, 3, 1, 1, 2, 0, 3], 24, 64, 96),
    ([2] * 7, 48, 576, 960),
    ([0, 0, 1], 5, 40, 36),  # rank and widths off the vector width
    ([0] * 3 + [1] * 20 + [2, 0, 3], 16, 64, 72),  # slot 1: a run of 20 (matmul path)
    ([1, 2] * 18 + [3] * 5, 12, 40, 100),  # slots 1 and 2: 18 scattered each (matmul path)
])
def test_lora_kernels_match_the_reference(cpu_kernels, dtype, token_slots, rank, k, n):
    g = torch.Generator().manual_seed(0)
    num_slots = 4
    a = torch.randn(num_slots, rank, k, generator=g).to(dtype)
    b = torch.randn(num_slots, n, rank, generator=g).to(dtype) * 0.1
    a[0] = 0  # slot 0, the base model, holds zeros and is never read
    b[0] = 0
    x = torch.randn(len(token_slots), k, generator=g).to(dtype)
    y = torch.randn(len(token_slots), n, generator=g).to(dtype)
    groups = _groups(token_slots)
    ops = cpu_kernel_ops("under-test", cpu_kernels.ops)
    assert ops.b_rank_major
    h_want = REFERENCE_OPS.shrink(x, a, groups)
    h_got = ops.shrink(x, a, groups)
    torch.testing.assert_close(h_got, h_want, **TOLERANCE[dtype])
    want, got = y.clone(), y.clone()
    REFERENCE_OPS.expand(want, h_want, b, groups)
    ops.expand(got, h_want, b.transpose(1, 2).contiguous(), groups, ())
    torch.testing.assert_close(got, want, **TOLERANCE[dtype])
    base = [t for t, s in enumerate(token_slots) if s == 0]
    assert torch.equal(got[base], y[base])  # base tokens untouched, bit for bit


@pytest.mark.cpu_ops("lora_expand")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("token_slots", [[0, 1, 2, 1, 0, 2], [1] * 17 + [0, 2]],
                         ids=["tiles", "matmul"])
def test_expand_by_slices_reads_only_the_diagonal_blocks(cpu_kernels, dtype, token_slots):
    """A fused projection (q, k, v of 40, 24, 24 outputs, rank 6 each): B block-diagonal as
    slots.py writes it. Given the slices, the kernel reads only the blocks, so garbage off them
    must not show; the result is the reference's over the zero-filled B."""
    g = torch.Generator().manual_seed(2)
    slices, rank = (40, 24, 24), 6
    n = sum(slices)
    b = torch.zeros(3, n, 3 * rank)
    row = 0
    for i, size in enumerate(slices):
        b[1:, row:row + size, i * rank:(i + 1) * rank] = \
            torch.randn(2, size, rank, generator=g) * 0.1
        row += size
    b = b.to(dtype)
    h = torch.randn(len(token_slots), 3 * rank, generator=g).to(dtype)
    y = torch.randn(len(token_slots), n, generator=g).to(dtype)
    groups = _groups(token_slots)
    want = y.clone()
    REFERENCE_OPS.expand(want, h, b, groups)
    rank_major = b.transpose(1, 2).contiguous()
    off_blocks = rank_major == 0
    rank_major[off_blocks] = float("nan")  # read off the blocks, it would poison the result
    rank_major[0] = 0
    got = y.clone()
    cpu_kernel_ops("under-test", cpu_kernels.ops).expand(got, h, rank_major, groups, slices)
    torch.testing.assert_close(got, want, **TOLERANCE[dtype])


@pytest.mark.cpu_ops("lora_shrink")
def test_a_slot_out_of_range_is_refused(cpu_kernels):
    a = torch.zeros(2, 4, 8)
    with pytest.raises(RuntimeError, match="slot 5 of 2"):
        cpu_kernels.ops.lora_shrink(torch.zeros(1, 8), a, torch.tensor([5]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_triton_lora_kernels_match_the_reference_in_the_interpreter(dtype):
    """Under TRITON_INTERPRET=1 (tests/conftest.py sets it): tiny shapes, tiles that do not
    divide them (masked edges), base tokens between adapters."""
    pytest.importorskip("triton")
    from engine_worker.lora import triton_kernels

    g = torch.Generator().manual_seed(1)
    token_slots = [0, 2, 1, 0, 2]
    a = torch.randn(3, 12, 40, generator=g).to(dtype)
    b = (torch.randn(3, 24, 12, generator=g) * 0.1).to(dtype)
    x = torch.randn(5, 40, generator=g).to(dtype)
    y = torch.randn(5, 24, generator=g).to(dtype)
    groups = _groups(token_slots)
    slots = groups.token_slots
    h_want = REFERENCE_OPS.shrink(x.float(), a.float(), groups)
    h_got = triton_kernels.lora_shrink(x, a, slots, block_r=8, block_k=16)
    tolerance = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else \
        dict(rtol=5e-3, atol=5e-3)
    torch.testing.assert_close(h_got.float(), h_want, **tolerance)
    want, got = y.float().clone(), y.clone()
    REFERENCE_OPS.expand(want, h_got.float(), b.float(), groups)
    triton_kernels.lora_expand(got, h_got, b, slots, block_n=16, block_r=8)
    torch.testing.assert_close(got.float(), want, **tolerance)
    assert torch.equal(got[[0, 3]], y[[0, 3]])


AOT_SCRIPT = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from engine_worker.lora.triton_kernels import _expand_kernel, _shrink_kernel
for arch in (80, 90):
    for t in ("fp16", "bf16", "fp32"):
        p = "*" + t
        shrink = ASTSource(fn=_shrink_kernel, signature={
            "x_ptr": p, "a_ptr": p, "slots_ptr": "*i64", "h_ptr": p, "K": "i32", "R": "i32",
            "BLOCK_R": "constexpr", "BLOCK_K": "constexpr"},
            constexprs={"BLOCK_R": 16, "BLOCK_K": 64})
        expand = ASTSource(fn=_expand_kernel, signature={
            "y_ptr": p, "h_ptr": p, "b_ptr": p, "slots_ptr": "*i64", "N": "i32", "R": "i32",
            "y_stride": "i64", "BLOCK_N": "constexpr", "BLOCK_R": "constexpr"},
            constexprs={"BLOCK_N": 64, "BLOCK_R": 16})
        for source in (shrink, expand):
            kernel = triton.compile(source, target=GPUTarget("cuda", arch, 32))
            print(arch, t, len(kernel.asm["cubin"]), flush=True)
"""


def test_triton_lora_kernels_compile_for_sm80_and_sm90():
    """What the interpreter cannot see (the GPU pipeline down to cubin), with no GPU."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    pytest.importorskip("triton")
    repo = Path(__file__).resolve().parents[3]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(repo), env.get("PYTHONPATH")]))
    result = subprocess.run([sys.executable, "-c", AOT_SCRIPT], capture_output=True, text=True,
                            env=env, cwd=repo, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert len(result.stdout.splitlines()) == 12
