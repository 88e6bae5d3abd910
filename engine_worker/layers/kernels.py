"""The per-layer math a model calls, picked once per engine (``--kernels``).

``torch`` is the pure-PyTorch reference of every op. ``cpu`` calls the fused kernels of
``csrc/cpu`` (``ops.cpu_ops()``: the instruction-set variant in use) where their shape and
dtype rules hold and the reference elsewhere; tests compare each kernel with its reference.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine_worker.layers import blocks
from engine_worker.layers.activation import silu_and_mul
from engine_worker.layers.linear import LinearFn, PackFn, no_packing, torch_linear
from engine_worker.layers.norm import rms_norm
from engine_worker.layers.rotary import apply_rope
from engine_worker.ops import cpu_ops
from engine_worker.platform import to_huge_pages

SKINNY_MAX_ROWS = 8  # up to here a linear layer is a weight stream: the bf16 kernel wins


@dataclass(frozen=True, slots=True)
class LayerKernels:
    linear: LinearFn  # (x, weight, bias, packed) -> x @ weight.T + bias
    pack_weight: PackFn  # a linear weight -> what ``linear`` takes as ``packed``
    rms_norm: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]  # (x, weight, eps)
    silu_and_mul: Callable[[torch.Tensor], torch.Tensor]  # [n, 2 * w] -> [n, w]
    rope: Callable[..., tuple[torch.Tensor, torch.Tensor]]  # (positions, q, k, cos, sin)
    # the decoder layer's halves around attention: see layers.blocks for their arguments
    norm_qkv_rope: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = \
        blocks.norm_qkv_rope
    residual_mlp: Callable[..., torch.Tensor] = blocks.residual_mlp
    # a loaded model -> its decoder layers as one call (x, positions, kv_caches, meta) -> x,
    # or None where the layers run one by one
    layer_stack: Callable[[torch.nn.Module], Callable | None] = lambda model: None


@dataclass(frozen=True, slots=True)
class CpuPackedWeight:
    """A bf16 weight in the two layouts the CPU path streams: oneDNN's blocked one for many
    rows, and for the skinny kernel (up to 8 rows) row groups interleaved per 32-wide slice,
    one sequential stream per thread (~28 GB/s here against ~18 for the plain layout). The
    skinny layout is exponent-coded where every row uses at most 16 exponents (12 bits a
    weight, decoded losslessly in the kernel: a quarter fewer bytes a decode step; see
    csrc/cpu/linear.cpp), else plain bf16."""

    onednn: torch.Tensor | None
    skinny: torch.Tensor | None


def cpu_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
               packed: CpuPackedWeight | None) -> torch.Tensor:
    # x: [num_tokens, in_features]; more rows go to oneDNN, which reuses each weight load
    if x.shape[0] <= SKINNY_MAX_ROWS and x.dtype == torch.bfloat16 and x.shape[1] % 32 == 0:
        if packed is not None and packed.skinny is not None:
            return cpu_ops().skinny_linear_packed(x, packed.skinny, bias)
        return cpu_ops().skinny_linear(x, weight, bias)
    if packed is not None and packed.onednn is not None:
        return torch.ops.mkldnn._linear_pointwise(x, packed.onednn, bias, "none", [], "")
    return F.linear(x, weight, bias)


def cpu_pack_weight(weight: torch.Tensor) -> CpuPackedWeight | None:
    """Once per weight at load. oneDNN's layout: F.linear would re-lay the plain weight out on
    every call (10-45 % of a decode-sized matmul here)."""
    if weight.dtype != torch.bfloat16:
        return None
    onednn = (torch.ops.mkldnn._reorder_linear_weight(weight, None)
              if torch.backends.mkldnn.is_available() else None)
    out_features, in_features = weight.shape
    skinny = None
    if out_features % 4 == 0 and in_features % 32 == 0:
        skinny = cpu_ops().pack_coded(weight)
        if skinny.numel() == 0:  # a row with more than 16 exponents
            skinny = cpu_ops().pack_skinny(weight)
        # what decode streams every step: on huge pages (platform.py)
        skinny = to_huge_pages(skinny)
    return CpuPackedWeight(onednn, skinny)


def cpu_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if x.shape[-1] % 16 == 0 and x.dim() == 2 and x.stride(1) == 1:
        return cpu_ops().rms_norm(x, weight, eps)
    return rms_norm(x, weight, eps)


def cpu_silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    if x.shape[-1] % 32 == 0 and x.dim() == 2 and x.is_contiguous():
        return cpu_ops().silu_and_mul(x)
    return silu_and_mul(x)


def cpu_rope(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
             sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """In place on q and k (views into the step's fused QKV output)."""
    if q.shape[-1] % 32 == 0:
        cpu_ops().rotary_embedding(q, k, positions, cos, sin)
        return q, k
    return apply_rope(positions, q, k, cos, sin)


def _packed_both(*linears) -> bool:
    return all(lin.packed is not None and lin.packed.skinny is not None
               and lin.packed.onednn is not None for lin in linears)


def _fusable(x: torch.Tensor, *linears) -> bool:
    """The fused halves take bf16 rows and weights packed in both CPU layouts."""
    return x.dtype == torch.bfloat16 and _packed_both(*linears)


def cpu_norm_qkv_rope(x, positions, norm, qkv_proj, rotary, num_heads: int, num_kv_heads: int,
                      head_dim: int):
    if _fusable(x, qkv_proj) and head_dim % 32 == 0 and x.is_contiguous():
        return cpu_ops().norm_qkv_rope(
            x, norm.weight, norm.eps, qkv_proj.packed.skinny, qkv_proj.packed.onednn,
            qkv_proj.bias, positions, rotary.cos, rotary.sin, num_heads, num_kv_heads)
    return blocks.norm_qkv_rope(x, positions, norm, qkv_proj, rotary, num_heads, num_kv_heads,
                                head_dim)


def cpu_residual_mlp(x, attn, o_proj, norm, gate_up_proj, down_proj, silu_and_mul):
    if _fusable(x, o_proj, gate_up_proj, down_proj) and x.is_contiguous():
        return cpu_ops().residual_mlp(
            x, attn, o_proj.packed.skinny, o_proj.packed.onednn, o_proj.bias, norm.weight,
            norm.eps, gate_up_proj.packed.skinny, gate_up_proj.packed.onednn, gate_up_proj.bias,
            down_proj.packed.skinny, down_proj.packed.onednn, down_proj.bias)
    return blocks.residual_mlp(x, attn, o_proj, norm, gate_up_proj, down_proj, silu_and_mul)


def cpu_llama_layers(model: torch.nn.Module) -> Callable | None:
    """A Llama's decoder layers as one ``quire.llama_layers`` call a step: the fused halves and
    the paged-attention kernel for every layer, with no Python between layers (about 2 ms of
    a 13 ms single-request decode step here). None where any layer needs the per-layer path:
    the reference attention, a head size the kernels do not take, a weight not packed for both
    CPU layouts (not bf16). The weight lists are built once, here."""
    from engine_worker.attention.cpu_backend import kernel_supports

    cfg = model.cfg
    first = model.layers[0].self_attn
    if (first.backend.name != "cpu" or not kernel_supports(cfg.head_dim)
            or cfg.head_dim % 32 or cfg.hidden_size % 32):
        return None
    weights: list[torch.Tensor] = []
    biases: list[torch.Tensor | None] = []
    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
        if not _packed_both(*linears):
            return None
        weights.append(layer.input_layernorm.weight)
        weights += [attn.qkv_proj.packed.skinny, attn.qkv_proj.packed.onednn,
                    attn.o_proj.packed.skinny, attn.o_proj.packed.onednn]
        weights.append(layer.post_attention_layernorm.weight)
        weights += [mlp.gate_up_proj.packed.skinny, mlp.gate_up_proj.packed.onednn,
                    mlp.down_proj.packed.skinny, mlp.down_proj.packed.onednn]
        biases += [lin.bias for lin in linears]
    rotary, eps, scale = first.rotary, cfg.rms_norm_eps, first.scale

    def run(x: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor], meta,
            attention_ns: torch.Tensor | None = None) -> torch.Tensor:
        # attention_ns (int64 [1]): the op adds its cache-write and attention time to it
        return cpu_ops().llama_layers(
            x, positions, rotary.cos, rotary.sin, weights, biases, kv_caches,
            meta.slot_mapping, meta.block_tables, meta.query_start_loc, meta.seq_lens, eps,
            scale, cfg.num_heads, cfg.num_kv_heads, attention_ns)

    return run


LAYER_KERNELS: dict[str, LayerKernels] = {
    "torch": LayerKernels(torch_linear, no_packing, rms_norm, silu_and_mul, apply_rope),
    "cpu": LayerKernels(cpu_linear, cpu_pack_weight, cpu_rms_norm, cpu_silu_and_mul, cpu_rope,
                        cpu_norm_qkv_rope, cpu_residual_mlp, cpu_llama_layers),
}
