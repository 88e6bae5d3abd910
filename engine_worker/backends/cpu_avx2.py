"""The ``cpu-avx2`` backend: the AVX2 + FMA build of the kernels of ``csrc/cpu``
(``torch.ops.quire_avx2``; its own linear layers in ``csrc/cpu/avx2``), for x86 CPUs without
AVX-512 (AMD Zen 3 and older, many Intel client parts), or to test the set on one that has it.

Such CPUs have no bf16 arithmetic, so torch's bf16 matmul is emulated there and unusably
slow. This backend never calls it:

- a bf16 weight is packed once (``pack_bf16w``: panels of 16 output columns, K-major, on huge
  pages) and multiplied in fp32 by ``linear_bf16w``, widening each weight by a 16-bit shift:
  half the bytes of an fp32 weight, which is what a decode step's time is made of;
- an fp32 weight stays with torch's fp32 matmul (MKL / oneDNN);
- the decoder layers run as one ``llama_layers`` call with fp32 activations whatever the
  weights: a bf16 model keeps its residual stream in fp32 there and its KV cache in bf16.

Every op is tested against its reference (tests/unit/ops/test_cpu_kernels.py).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine_worker.backends.base import Backend, LayersFn, LinearWeights, LlamaStack
from engine_worker.backends.cpu import (CpuPagedAttentionBackend, kernel_supports,
                                        kernels_unavailable_reason, one_call_layers)
from engine_worker.layers.activation import silu_and_mul
from engine_worker.layers.norm import rms_norm
from engine_worker.layers.rotary import apply_rope
from engine_worker.platform import to_huge_pages

ISA = "avx2"
_PANEL_COLUMNS = 16  # pack_bf16w's panels: output columns in multiples of this


def _ops():
    """The AVX2 set's namespace (loaded by ``engine_worker.ops``)."""
    from engine_worker.ops import load_cpu_ops

    ops = load_cpu_ops(ISA)
    assert ops is not None, "cpu-avx2 used without its kernels (unavailable_reason said so)"
    return ops


@dataclass(frozen=True, slots=True)
class Avx2PackedWeight:
    """A bf16 weight as ``linear_bf16w`` streams it: bf16 [out / 16, in, 16]."""

    panels: torch.Tensor


def avx2_pack_weight(weight: torch.Tensor) -> Avx2PackedWeight | None:
    """Once per weight at load: bf16 weights whose output size the panels divide."""
    if weight.dtype != torch.bfloat16 or weight.shape[0] % _PANEL_COLUMNS:
        return None
    return Avx2PackedWeight(to_huge_pages(_ops().pack_bf16w(weight.detach())))


def avx2_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                packed: Avx2PackedWeight | None) -> torch.Tensor:
    # x: [num_tokens, in_features] -> [num_tokens, out_features] in x's dtype
    if packed is None:
        return F.linear(x, weight, bias)
    out = _ops().linear_bf16w(x.float(), packed.panels, None if bias is None else bias.float())
    return out.to(x.dtype)


def avx2_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if x.dim() == 2 and x.shape[-1] % 8 == 0 and x.stride(1) == 1 and weight.dtype == x.dtype:
        return _ops().rms_norm(x, weight, eps)
    return rms_norm(x, weight, eps)


def avx2_silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    if x.dim() == 2 and x.shape[-1] % 16 == 0 and x.is_contiguous():
        return _ops().silu_and_mul(x)
    return silu_and_mul(x)


def avx2_rope(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
              sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """In place on q and k (views into the step's fused QKV output)."""
    if q.shape[-1] % 16 == 0 and cos.dtype == torch.float32:
        _ops().rotary_embedding(q, k, positions, cos, sin)
        return q, k
    return apply_rope(positions, q, k, cos, sin)


def _weight(lin: LinearWeights) -> torch.Tensor | None:
    """What the fused ops take for a linear layer: its panels, or its fp32 weight."""
    if lin.packed is not None:
        return lin.packed.panels
    return lin.weight.detach() if lin.weight.dtype == torch.float32 else None


def _bias(lin: LinearWeights) -> torch.Tensor | None:
    return None if lin.bias is None else lin.bias.detach().float()


def avx2_llama_layers(stack: LlamaStack) -> LayersFn | None:
    """A Llama's decoder layers as one ``llama_layers`` call a step, activations in fp32
    whatever the model's dtype (a bf16 model's rows are widened on the way in and rounded on
    the way out; its norms and biases are widened once, here). None where a layer needs the
    per-layer path: a head size the kernels do not take, a weight neither packed nor fp32."""
    if not kernel_supports(stack.head_dim) or stack.hidden_size % 16:
        return None
    weights: list[torch.Tensor] = []
    biases: list[torch.Tensor | None] = []
    for layer in stack.layers:
        packed = [_weight(lin) for lin in layer.linears]
        if any(w is None for w in packed):
            return None
        qkv, o, gate_up, down = packed
        # each linear's two slots: "up to 8 rows" and "more rows"; one tensor serves both
        weights += [layer.input_norm.detach().float(), qkv, qkv, o, o,
                    layer.post_attention_norm.detach().float(), gate_up, gate_up, down, down]
        biases += [_bias(lin) for lin in layer.linears]
    return one_call_layers(_ops(), stack, weights, biases, torch.float32)


CPU_AVX2 = Backend(
    name="cpu-avx2", description="compiled CPU kernels, AVX2", linear=avx2_linear,
    pack_weight=avx2_pack_weight, rms_norm=avx2_rms_norm, silu_and_mul=avx2_silu_and_mul,
    rope=avx2_rope,
    # the same varlen call; under fp32 queries the AVX2 set also reads bf16 / fp16 caches
    attention=CpuPagedAttentionBackend("cpu-avx2", _ops), llama_layers=avx2_llama_layers,
    unavailable_reason=functools.partial(kernels_unavailable_reason, ISA))
