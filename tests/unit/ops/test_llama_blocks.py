"""The fused halves of a decoder layer (csrc/cpu/llama_block.cpp) against the layer's modules.

The fused ops run the same kernels in the same order as the layer's modules do one by one on
the ``cpu`` backend, so the results must be bit-identical, at every row count: up to 8 rows
through the skinny matmul, above through oneDNN. The ops take the weights as the model exports
them (``LlamaLayerWeights``).
"""

from __future__ import annotations

import pytest
import torch

from engine_worker.backends import BACKENDS
from engine_worker.layers.rotary import RopeConfig, RotaryEmbedding
from engine_worker.models.llama import LlamaConfig, LlamaDecoderLayer
from engine_worker.ops import cpu_ops

# once per variant this CPU runs that has the AVX-512 packed-weight layouts the cpu backend's
# bf16 path streams (the AVX2 kernels pack bf16 weights their own way)
pytestmark = [pytest.mark.usefixtures("cpu_isa"),
              pytest.mark.cpu_ops("pack_coded", "pack_skinny", "skinny_linear_packed")]

CPU = BACKENDS["cpu"]
HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTERMEDIATE = 576, 9, 3, 64, 1536
MAX_POSITION = 4096


def _layer(bias: bool, dtype=torch.bfloat16, backend=CPU) -> LlamaDecoderLayer:
    """A decoder layer with random weights, loaded and packed as the engine does."""
    torch.manual_seed(int(bias))
    rope = RopeConfig(head_dim=HEAD_DIM, theta=10000.0, max_position_embeddings=MAX_POSITION)
    cfg = LlamaConfig(vocab_size=1, hidden_size=HIDDEN, intermediate_size=INTERMEDIATE,
                      num_layers=1, num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM,
                      rms_norm_eps=1e-5, rope=rope, tie_word_embeddings=True, qkv_bias=bias,
                      o_bias=bias, mlp_bias=bias)
    rotary = RotaryEmbedding(rope, MAX_POSITION, torch.device("cpu"), backend.rope)
    layer = LlamaDecoderLayer(cfg, rotary, backend)
    with torch.no_grad():
        for name, p in layer.named_parameters():
            if name.endswith("layernorm.weight"):
                p.copy_(1 + torch.randn_like(p) / 4)
            elif name.endswith("bias"):
                p.copy_(torch.randn_like(p) / 4)
            else:
                p.copy_(torch.randn_like(p) / p.shape[1] ** 0.5)
        for p in layer.parameters():  # the rotary tables stay fp32, as in the engine
            p.data = p.data.to(dtype)
    for lin in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj,
                layer.mlp.down_proj):
        lin.pack()
    return layer


def _residual_mlp(layer: LlamaDecoderLayer, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
    """The layer's second half, module by module: h = x + o_proj(attn); h + mlp(norm(h))."""
    h = x + layer.self_attn.o_proj(attn)
    return h + layer.mlp(layer.post_attention_layernorm(h))


ROWS = [1, 3, 8, 9, 40]


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", ROWS)
def test_norm_qkv_rope_is_the_composition_bit_for_bit(rows, bias):
    layer = _layer(bias)
    w = layer.export()
    rotary = layer.self_attn.rotary
    x = (torch.randn(rows, HIDDEN) * 2).bfloat16()
    positions = torch.randint(0, MAX_POSITION, (rows,))
    want = layer.self_attn.qkv_rope(positions, layer.input_layernorm(x))
    got = cpu_ops().norm_qkv_rope(
        x, w.input_norm, layer.input_layernorm.eps, w.qkv_proj.packed.skinny,
        w.qkv_proj.packed.onednn, w.qkv_proj.bias, positions, rotary.cos, rotary.sin, HEADS,
        KV_HEADS)
    for g, wt, shape in zip(got, want,
                            [(rows, HEADS, HEAD_DIM)] + [(rows, KV_HEADS, HEAD_DIM)] * 2):
        assert g.shape == shape
        assert torch.equal(g, wt)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", ROWS)
def test_residual_mlp_is_the_composition_bit_for_bit(rows, bias):
    layer = _layer(bias)
    w = layer.export()
    x = (torch.randn(rows, HIDDEN) * 2).bfloat16()
    x_before = x.clone()
    attn = torch.randn(rows, HEADS * HEAD_DIM).bfloat16()
    want = _residual_mlp(layer, x, attn)
    got = cpu_ops().residual_mlp(
        x, attn, w.o_proj.packed.skinny, w.o_proj.packed.onednn, w.o_proj.bias,
        w.post_attention_norm, layer.post_attention_layernorm.eps,
        w.gate_up_proj.packed.skinny, w.gate_up_proj.packed.onednn, w.gate_up_proj.bias,
        w.down_proj.packed.skinny, w.down_proj.packed.onednn, w.down_proj.bias)
    assert torch.equal(got, want)
    assert torch.equal(x, x_before)  # the residual stream's input is not written to
    # and it is the layer's math, not only the same kernels: close to the reference backend
    plain = _layer(bias, backend=BACKENDS["torch"])
    plain.load_state_dict(layer.state_dict())
    torch.testing.assert_close(got.float(), _residual_mlp(plain, x, attn).float(),
                               atol=0.1, rtol=0.05)


def test_fp32_layers_are_not_packed_for_the_fused_stack():
    """The CPU layouts are bf16 only: an fp32 model runs its layers one by one."""
    w = _layer(False, torch.float32).export()
    assert all(lin.packed is None for lin in w.linears)
    assert all(lin.packed is not None for lin in _layer(False).export().linears)


def test_fused_ops_name_what_is_wrong():
    layer = _layer(False)
    w, rotary = layer.export(), layer.self_attn.rotary
    with pytest.raises(RuntimeError, match="x must be contiguous bf16"):
        cpu_ops().norm_qkv_rope(
            torch.zeros(2, HIDDEN), w.input_norm, 1e-5, w.qkv_proj.packed.skinny,
            w.qkv_proj.packed.onednn, None, torch.zeros(2, dtype=torch.long), rotary.cos,
            rotary.sin, HEADS, KV_HEADS)
    with pytest.raises(RuntimeError, match="heads \\+ 2 kv heads"):
        cpu_ops().norm_qkv_rope(
            torch.zeros(2, HIDDEN).bfloat16(), w.input_norm, 1e-5, w.qkv_proj.packed.skinny,
            w.qkv_proj.packed.onednn, None, torch.zeros(2, dtype=torch.long), rotary.cos,
            rotary.sin, HEADS, 1)
