"""The fused halves of a decoder layer (csrc/cpu/llama_block.cpp) against the layer's modules.

The fused ops run the same kernels in the same order as the layer's modules do one by one on
the ``cpu`` backend, so the results must be bit-identical, at every row count: up to 8 rows
through the skinny matmul, above through oneDNN. The ops take the weights as the model exports
them (``LlamaLayerWeights``). The ``cpu-avx2`` backend's layers (fp32 activations, so not the
bf16 modules' roundings) are checked whole-model in test_llama_layers.py.
"""

from __future__ import annotations

import pytest
import torch

from engine_worker.backends.cpu_linear import SKINNY_MAX_ROWS
from engine_worker.backends.reference import REFERENCE
from engine_worker.layers.rotary import RopeConfig, RotaryEmbedding
from engine_worker.models.llama import LlamaConfig, LlamaDecoderLayer
from tests.unit.ops.onednn import skip_without_onednn_bf16
from tests.unit.ops.weights import weights_to

pytestmark = pytest.mark.usefixtures("cpu_kernels")  # once per variant
# the AVX-512 packed-weight layouts the cpu backend's bf16 path streams (the AVX2 kernels pack
# bf16 weights their own way)
PACKED_BF16 = pytest.mark.cpu_ops("pack_coded", "pack_skinny", "skinny_linear_packed")

# the dtype each variant's fused ops take, and its weights for few and many rows
ACTIVATIONS = {"avx512": torch.bfloat16, "avx2": torch.float32}
FEW_AND_MANY = {"avx512": lambda packed: (packed.skinny, packed.onednn),
                "avx2": lambda packed: (packed.panels, packed.panels)}
HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTERMEDIATE = 576, 9, 3, 64, 1536
MAX_POSITION = 4096


def _layer(backend, bias: bool, dtype=torch.bfloat16) -> LlamaDecoderLayer:
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
    weights_to(layer, dtype)
    for lin in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj,
                layer.mlp.down_proj):
        lin.pack()
    return layer


def _residual_mlp(layer: LlamaDecoderLayer, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
    """The layer's second half, module by module: h = x + o_proj(attn); h + mlp(norm(h))."""
    h = x + layer.self_attn.o_proj(attn)
    return h + layer.mlp(layer.post_attention_layernorm(h))


ROWS = [1, 3, 8, 9, 40]


def _every_row_count(test):
    """On the AVX-512 layouts, skinny and oneDNN rows, with and without biases."""
    for mark in (PACKED_BF16, pytest.mark.parametrize("bias", [False, True]),
                 pytest.mark.parametrize("rows", ROWS)):
        test = mark(test)
    return test


@_every_row_count
def test_norm_qkv_rope_is_the_composition_bit_for_bit(rows, bias, cpu_kernels):
    if rows > SKINNY_MAX_ROWS:
        skip_without_onednn_bf16()
    layer = _layer(cpu_kernels.backend, bias)
    w = layer.export()
    rotary = layer.self_attn.rotary
    x = (torch.randn(rows, HIDDEN) * 2).bfloat16()
    positions = torch.randint(0, MAX_POSITION, (rows,))
    want = layer.self_attn.qkv_rope(positions, layer.input_layernorm(x))
    got = cpu_kernels.ops.norm_qkv_rope(
        x, w.input_norm, layer.input_layernorm.eps, w.qkv_proj.packed.skinny,
        w.qkv_proj.packed.onednn, w.qkv_proj.bias, positions, rotary.cos, rotary.sin, HEADS,
        KV_HEADS)
    for g, wt, shape in zip(got, want,
                            [(rows, HEADS, HEAD_DIM)] + [(rows, KV_HEADS, HEAD_DIM)] * 2):
        assert g.shape == shape
        assert torch.equal(g, wt)


@_every_row_count
def test_residual_mlp_is_the_composition_bit_for_bit(rows, bias, cpu_kernels):
    if rows > SKINNY_MAX_ROWS:
        skip_without_onednn_bf16()
    layer = _layer(cpu_kernels.backend, bias)
    w = layer.export()
    x = (torch.randn(rows, HIDDEN) * 2).bfloat16()
    x_before = x.clone()
    attn = torch.randn(rows, HEADS * HEAD_DIM).bfloat16()
    want = _residual_mlp(layer, x, attn)
    got = cpu_kernels.ops.residual_mlp(
        x, attn, w.o_proj.packed.skinny, w.o_proj.packed.onednn, w.o_proj.bias,
        w.post_attention_norm, layer.post_attention_layernorm.eps,
        w.gate_up_proj.packed.skinny, w.gate_up_proj.packed.onednn, w.gate_up_proj.bias,
        w.down_proj.packed.skinny, w.down_proj.packed.onednn, w.down_proj.bias)
    assert torch.equal(got, want)
    assert torch.equal(x, x_before)  # the residual stream's input is not written to
    # and it is the layer's math, not only the same kernels: close to the reference backend
    plain = _layer(REFERENCE, bias)
    plain.load_state_dict(layer.state_dict())
    torch.testing.assert_close(got.float(), _residual_mlp(plain, x, attn).float(),
                               atol=0.1, rtol=0.05)


# rows whose gate/up output (2 x 1,536 wide) passes the op's 12 MiB slice: 2,048 bf16 rows
# (AVX-512) or 1,024 fp32 rows (AVX2) fit in one, so these run in 3 and 5 slices
SLICED_ROWS = 4500


def _residual_mlp_op(ops, w, few_and_many, x, attn, eps):
    """The op on the layer's exported weights, its norm and biases in x's dtype."""
    o_few, o_many = few_and_many(w.o_proj.packed)
    gate_up_few, gate_up_many = few_and_many(w.gate_up_proj.packed)
    down_few, down_many = few_and_many(w.down_proj.packed)
    o_bias, gate_up_bias, down_bias = (lin.bias.to(x.dtype) for lin in
                                       (w.o_proj, w.gate_up_proj, w.down_proj))
    return ops.residual_mlp(x, attn, o_few, o_many, o_bias, w.post_attention_norm.to(x.dtype),
                            eps, gate_up_few, gate_up_many, gate_up_bias, down_few, down_many,
                            down_bias)


def test_residual_mlp_in_slices_is_every_row_alone(cpu_kernels):
    """Past its slice the op runs the MLP a slice of rows at a time (its widest buffer then
    stays in cache): every row's result is what the op gives it in calls of fewer rows than
    a slice (pieces of 1,000 rows: neither the slices nor their boundaries). The matmuls
    block their rows by the row count, so a row's last bits may move with it (oneDNN's bf16:
    about 1 element in 2,000 here): each dtype's tolerance, and on AVX-512 the unsliced
    composition of the layer's modules too."""
    if cpu_kernels.isa == "avx512":
        skip_without_onednn_bf16()
    layer = _layer(cpu_kernels.backend, True)
    w = layer.export()
    dtype = ACTIVATIONS[cpu_kernels.isa]
    few_and_many = FEW_AND_MANY[cpu_kernels.isa]
    eps = layer.post_attention_layernorm.eps
    torch.manual_seed(7)
    x = (torch.randn(SLICED_ROWS, HIDDEN) * 2).to(dtype)
    attn = torch.randn(SLICED_ROWS, HEADS * HEAD_DIM).to(dtype)
    got = _residual_mlp_op(cpu_kernels.ops, w, few_and_many, x, attn, eps)
    want = torch.cat([_residual_mlp_op(cpu_kernels.ops, w, few_and_many, x[i:i + 1000],
                                       attn[i:i + 1000], eps)
                      for i in range(0, SLICED_ROWS, 1000)])
    if dtype == torch.float32:
        torch.testing.assert_close(got, want)
        return
    # bf16: a relative 2^-6, and one unit in the last place of the residual stream's values
    # (about 2) where a row's sum cancels to near 0
    torch.testing.assert_close(got, want, rtol=1.6e-2, atol=2 ** -6)
    torch.testing.assert_close(got, _residual_mlp(layer, x, attn), rtol=1.6e-2, atol=2 ** -6)


@PACKED_BF16
def test_fp32_layers_are_not_packed_for_the_fused_stack(cpu_kernels):
    """The CPU layouts are bf16 only: an fp32 model runs its layers one by one."""
    backend = cpu_kernels.backend
    assert all(lin.packed is None for lin in _layer(backend, False, torch.float32).export().linears)
    assert all(lin.packed is not None for lin in _layer(backend, False).export().linears)


def test_fused_ops_name_what_is_wrong(cpu_kernels):
    layer = _layer(cpu_kernels.backend, False)
    w, rotary = layer.export(), layer.self_attn.rotary
    dtype = ACTIVATIONS[cpu_kernels.isa]
    few, many = FEW_AND_MANY[cpu_kernels.isa](w.qkv_proj.packed)
    norm = w.input_norm.to(dtype)
    wrong = torch.float32 if dtype == torch.bfloat16 else torch.bfloat16
    name = {torch.bfloat16: "bf16", torch.float32: "fp32"}[dtype]

    def call(x, qkv_few, qkv_many, heads=HEADS):
        return cpu_kernels.ops.norm_qkv_rope(x, norm, 1e-5, qkv_few, qkv_many, None,
                                       torch.zeros(len(x), dtype=torch.long), rotary.cos,
                                       rotary.sin, heads, KV_HEADS)

    with pytest.raises(RuntimeError, match=f"x must be contiguous {name}"):
        call(torch.zeros(2, HIDDEN, dtype=wrong), few, many)
    with pytest.raises(RuntimeError, match="heads \\+ 2 kv heads"):
        call(torch.zeros(2, HIDDEN, dtype=dtype), few, many, HEADS - KV_HEADS)
    not_packed = torch.zeros(2, 3, 4)  # fp32, neither a packed layout nor a plain weight
    with pytest.raises(RuntimeError, match="a linear weight must be .*, fp32 \\[N, K\\]"):
        call(torch.zeros(2, HIDDEN, dtype=dtype), not_packed, not_packed)
