"""The fused halves of a decoder layer (csrc/cpu/llama_block.cpp) against their compositions.

The fused ops run the same kernels in the same order as the per-op CPU path, so the results
must be bit-identical to ``layers.blocks`` run on modules with the CPU kernels, at every row
count: up to 8 rows through the skinny matmul, above through oneDNN.
"""

from __future__ import annotations

import pytest
import torch

from engine_worker.layers import blocks
from engine_worker.layers.kernels import LAYER_KERNELS
from engine_worker.layers.linear import Linear
from engine_worker.layers.norm import RMSNorm
from engine_worker.layers.rotary import RopeConfig, RotaryEmbedding
from engine_worker.ops import cpu_ops

# once per variant this CPU runs that has the AVX-512 packed-weight layouts kernels.py's cpu
# path streams (the AVX2 kernels pack bf16 weights their own way)
pytestmark = [pytest.mark.usefixtures("cpu_isa"),
              pytest.mark.cpu_ops("pack_coded", "pack_skinny", "skinny_linear_packed")]

CPU = LAYER_KERNELS["cpu"]
HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTERMEDIATE = 576, 9, 3, 64, 1536


def _linear(in_features, out_features, bias, dtype):
    lin = Linear(in_features, out_features, bias, CPU.linear, CPU.pack_weight)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(out_features, in_features) / in_features ** 0.5)
        if bias:
            lin.bias.copy_(torch.randn(out_features) / 4)
    lin.to(dtype)
    lin.pack()
    return lin


def _norm(dtype):
    norm = RMSNorm(HIDDEN, 1e-5, CPU.rms_norm).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(1 + torch.randn(HIDDEN) / 4)
    return norm


def _layer(bias: bool, dtype=torch.bfloat16):
    torch.manual_seed(int(bias))
    rope = RopeConfig(head_dim=HEAD_DIM, theta=10000.0, max_position_embeddings=4096)
    return {
        "norm1": _norm(dtype), "norm2": _norm(dtype),
        "qkv": _linear(HIDDEN, (HEADS + 2 * KV_HEADS) * HEAD_DIM, bias, dtype),
        "o": _linear(HEADS * HEAD_DIM, HIDDEN, bias, dtype),
        "gate_up": _linear(HIDDEN, 2 * INTERMEDIATE, bias, dtype),
        "down": _linear(INTERMEDIATE, HIDDEN, bias, dtype),
        "rotary": RotaryEmbedding(rope, 4096, torch.device("cpu"), CPU.rope),
    }


ROWS = [1, 3, 8, 9, 40]


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", ROWS)
def test_norm_qkv_rope_is_the_composition_bit_for_bit(rows, bias):
    m = _layer(bias)
    x = (torch.randn(rows, HIDDEN) * 2).bfloat16()
    positions = torch.randint(0, 4096, (rows,))
    args = (x, positions, m["norm1"], m["qkv"], m["rotary"], HEADS, KV_HEADS, HEAD_DIM)
    want = blocks.norm_qkv_rope(*args)
    got = cpu_ops().norm_qkv_rope(
        x, m["norm1"].weight, m["norm1"].eps, m["qkv"].packed.skinny, m["qkv"].packed.onednn,
        m["qkv"].bias, positions, m["rotary"].cos, m["rotary"].sin, HEADS, KV_HEADS)
    for g, w, shape in zip(got, want, [(rows, HEADS, HEAD_DIM)] + [(rows, KV_HEADS, HEAD_DIM)] * 2):
        assert g.shape == shape
        assert torch.equal(g, w)
    # the kernel table's entry takes the fused op here
    assert all(torch.equal(g, w) for g, w in zip(CPU.norm_qkv_rope(*args), want))


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", ROWS)
def test_residual_mlp_is_the_composition_bit_for_bit(rows, bias):
    m = _layer(bias)
    x = (torch.randn(rows, HIDDEN) * 2).bfloat16()
    x_before = x.clone()
    attn = torch.randn(rows, HEADS * HEAD_DIM).bfloat16()
    args = (x, attn, m["o"], m["norm2"], m["gate_up"], m["down"], CPU.silu_and_mul)
    want = blocks.residual_mlp(*args)
    got = cpu_ops().residual_mlp(
        x, attn, m["o"].packed.skinny, m["o"].packed.onednn, m["o"].bias, m["norm2"].weight,
        m["norm2"].eps,
        m["gate_up"].packed.skinny, m["gate_up"].packed.onednn, m["gate_up"].bias,
        m["down"].packed.skinny, m["down"].packed.onednn, m["down"].bias)
    assert torch.equal(got, want)
    assert torch.equal(CPU.residual_mlp(*args), want)
    assert torch.equal(x, x_before)  # the residual stream's input is not written to
    # and it is the layer's math, not only the same kernels: close to the plain torch ops
    plain = blocks.residual_mlp(x, attn, *(_plain(m[k]) for k in ("o", "norm2", "gate_up",
                                                                  "down")),
                                LAYER_KERNELS["torch"].silu_and_mul)
    torch.testing.assert_close(got.float(), plain.float(), atol=0.1, rtol=0.05)


def _plain(module):
    """The same weights through the pure-torch kernels."""
    torch_kernels = LAYER_KERNELS["torch"]
    if isinstance(module, RMSNorm):
        out = RMSNorm(HIDDEN, module.eps, torch_kernels.rms_norm).to(module.weight.dtype)
        out.load_state_dict(module.state_dict())
        return out
    out = Linear(module.in_features, module.out_features, module.bias is not None,
                 torch_kernels.linear).to(module.weight.dtype)
    out.load_state_dict(module.state_dict())
    return out


def test_fp32_layers_take_the_composition():
    m = _layer(False, torch.float32)
    x = torch.randn(2, HIDDEN)
    attn = torch.randn(2, HEADS * HEAD_DIM)
    args = (x, attn, m["o"], m["norm2"], m["gate_up"], m["down"], CPU.silu_and_mul)
    assert m["o"].packed is None  # the CPU layouts are bf16 only
    assert torch.equal(CPU.residual_mlp(*args), blocks.residual_mlp(*args))


def test_fused_ops_name_what_is_wrong():
    m = _layer(False)
    with pytest.raises(RuntimeError, match="x must be contiguous bf16"):
        cpu_ops().norm_qkv_rope(
            torch.zeros(2, HIDDEN), m["norm1"].weight, 1e-5, m["qkv"].packed.skinny,
            m["qkv"].packed.onednn, None, torch.zeros(2, dtype=torch.long), m["rotary"].cos,
            m["rotary"].sin, HEADS, KV_HEADS)
    with pytest.raises(RuntimeError, match="heads \\+ 2 kv heads"):
        cpu_ops().norm_qkv_rope(
            torch.zeros(2, HIDDEN).bfloat16(), m["norm1"].weight, 1e-5, m["qkv"].packed.skinny,
            m["qkv"].packed.onednn, None, torch.zeros(2, dtype=torch.long), m["rotary"].cos,
            m["rotary"].sin, HEADS, 1)
