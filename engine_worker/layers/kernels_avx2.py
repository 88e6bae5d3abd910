"""The per-layer math on the AVX2 kernel set (``csrc/cpu/avx2``, ``torch.ops.quire_avx2``).

The same entry points as ``layers.kernels``' ``cpu_*`` functions, for CPUs with AVX2 and FMA
but no AVX-512 (or to test this set on one that has it). Such CPUs have no bf16 arithmetic,
so torch's bf16 matmul there is emulated and unusably slow; instead:

- a bf16 weight is packed once (``pack_bf16w``) and multiplied in fp32 by ``linear_bf16w``,
  widening each weight by a shift: half the bytes of an fp32 weight, which is what a decode
  step's time is made of;
- an fp32 weight stays with torch's fp32 matmul;
- the decoder layers run as one ``llama_layers`` call with fp32 activations, whichever the
  weights: bf16 models keep a residual stream in fp32 there, their KV cache in bf16.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine_worker.layers import blocks
from engine_worker.layers.activation import silu_and_mul
from engine_worker.layers.kernels import LayerKernels
from engine_worker.layers.norm import rms_norm
from engine_worker.layers.rotary import apply_rope
from engine_worker.platform import to_huge_pages

_PANEL_COLUMNS = 16  # pack_bf16w's panels: output columns in multiples of this


@dataclass(frozen=True, slots=True)
class Avx2PackedWeight:
    """A bf16 weight as ``linear_bf16w`` streams it: panels of 16 output columns, K-major
    (bf16 [out_features / 16, in_features, 16]; see csrc/cpu/avx2/linear.cpp)."""

    panels: torch.Tensor


def avx2_pack_weight(weight: torch.Tensor) -> Avx2PackedWeight | None:
    """Once per weight at load: bf16 weights whose output size the panels divide. On huge
    pages (platform.py): decode streams every panel every step."""
    if weight.dtype != torch.bfloat16 or weight.shape[0] % _PANEL_COLUMNS:
        return None
    return Avx2PackedWeight(to_huge_pages(torch.ops.quire_avx2.pack_bf16w(weight.detach())))


def avx2_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                packed: Avx2PackedWeight | None) -> torch.Tensor:
    # x: [num_tokens, in_features] -> [num_tokens, out_features] in x's dtype
    if packed is None:
        return F.linear(x, weight, bias)
    out = torch.ops.quire_avx2.linear_bf16w(
        x.float(), packed.panels, None if bias is None else bias.float())
    return out.to(x.dtype)


def avx2_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if x.dim() == 2 and x.shape[-1] % 8 == 0 and x.stride(1) == 1 and weight.dtype == x.dtype:
        return torch.ops.quire_avx2.rms_norm(x, weight, eps)
    return rms_norm(x, weight, eps)


def avx2_silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    if x.dim() == 2 and x.shape[-1] % 16 == 0 and x.is_contiguous():
        return torch.ops.quire_avx2.silu_and_mul(x)
    return silu_and_mul(x)


def avx2_rope(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
              sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """In place on q and k (views into the step's fused QKV output)."""
    if q.shape[-1] % 16 == 0 and cos.dtype == torch.float32:
        torch.ops.quire_avx2.rotary_embedding(q, k, positions, cos, sin)
        return q, k
    return apply_rope(positions, q, k, cos, sin)


def _weight(linear) -> torch.Tensor | None:
    """What the fused ops take for a linear layer: its panels, or its fp32 weight."""
    if linear.packed is not None:
        return linear.packed.panels
    return linear.weight.detach() if linear.weight.dtype == torch.float32 else None


def _bias(linear) -> torch.Tensor | None:
    return None if linear.bias is None else linear.bias.detach().float()


def _fusable(x: torch.Tensor, *linears) -> bool:
    """The fused halves take contiguous fp32 rows; every weight packed or fp32."""
    return (x.dtype == torch.float32 and x.is_contiguous()
            and all(_weight(lin) is not None for lin in linears))


def avx2_norm_qkv_rope(x, positions, norm, qkv_proj, rotary, num_heads: int, num_kv_heads: int,
                       head_dim: int):
    if (_fusable(x, qkv_proj) and head_dim % 16 == 0 and x.shape[-1] % 16 == 0
            and norm.weight.dtype == torch.float32):
        w = _weight(qkv_proj)
        return torch.ops.quire_avx2.norm_qkv_rope(
            x, norm.weight, norm.eps, w, w, _bias(qkv_proj), positions, rotary.cos, rotary.sin,
            num_heads, num_kv_heads)
    return blocks.norm_qkv_rope(x, positions, norm, qkv_proj, rotary, num_heads, num_kv_heads,
                                head_dim)


def avx2_residual_mlp(x, attn, o_proj, norm, gate_up_proj, down_proj, silu_and_mul):
    if (_fusable(x, o_proj, gate_up_proj, down_proj) and x.shape[-1] % 16 == 0
            and norm.weight.dtype == torch.float32):
        o, gate_up, down = _weight(o_proj), _weight(gate_up_proj), _weight(down_proj)
        return torch.ops.quire_avx2.residual_mlp(
            x, attn, o, o, _bias(o_proj), norm.weight, norm.eps, gate_up, gate_up,
            _bias(gate_up_proj), down, down, _bias(down_proj))
    return blocks.residual_mlp(x, attn, o_proj, norm, gate_up_proj, down_proj, silu_and_mul)


def avx2_llama_layers(model: torch.nn.Module) -> Callable | None:
    """A Llama's decoder layers as one ``quire_avx2.llama_layers`` call a step, activations in
    fp32 whatever the model's dtype (a bf16 model's rows are widened on the way in and
    rounded on the way out; its norms and biases are widened once, here). None where a layer
    needs the per-layer path: another attention backend, a head size the kernels do not take,
    a weight neither packed nor fp32."""
    from engine_worker.attention.avx2_backend import avx2_kernel_supports

    cfg = model.cfg
    first = model.layers[0].self_attn
    if (first.backend.name != "cpu_avx2" or not avx2_kernel_supports(cfg.head_dim)
            or cfg.hidden_size % 16):
        return None
    weights: list[torch.Tensor] = []
    biases: list[torch.Tensor | None] = []
    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
        packed = [_weight(lin) for lin in linears]
        if any(w is None for w in packed):
            return None
        qkv, o, gate_up, down = packed
        weights += [layer.input_layernorm.weight.detach().float(), qkv, qkv, o, o,
                    layer.post_attention_layernorm.weight.detach().float(), gate_up, gate_up,
                    down, down]
        biases += [_bias(lin) for lin in linears]
    eps, scale = cfg.rms_norm_eps, first.scale
    # the angle tables in fp32 (a model cast to bf16 as a whole casts them too)
    cos, sin = first.rotary.cos.float(), first.rotary.sin.float()

    def run(x: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor], meta,
            attention_ns: torch.Tensor | None = None) -> torch.Tensor:
        # attention_ns (int64 [1]): the op adds its cache-write and attention time to it
        out = torch.ops.quire_avx2.llama_layers(
            x.float().contiguous(), positions, cos, sin, weights, biases,
            kv_caches, meta.slot_mapping, meta.block_tables, meta.query_start_loc,
            meta.seq_lens, eps, scale, cfg.num_heads, cfg.num_kv_heads, attention_ns)
        return out.to(x.dtype)

    return run


AVX2_LAYER_KERNELS = LayerKernels(avx2_linear, avx2_pack_weight, avx2_rms_norm,
                                  avx2_silu_and_mul, avx2_rope, avx2_norm_qkv_rope,
                                  avx2_residual_mlp, avx2_llama_layers)
