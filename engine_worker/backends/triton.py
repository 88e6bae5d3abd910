"""The ``triton`` backend: Triton paged attention (``attention/triton_backend.py``) for the
whole varlen step, Triton kernels for the layer's small ops (``backends/triton_ops.py``:
RMSNorm, residual add + RMSNorm, SiLU-and-mul, RoPE in place), AWQ / GPTQ 4-bit weights
through the Triton int4 kernel (``backends/triton_int4.py``) and cuBLAS matmuls through
``F.linear`` for the rest. The default on CUDA. On a CPU it runs only under Triton's
interpreter (``TRITON_INTERPRET=1``), which is how the tests check it without a GPU.

Its fused Llama stack runs the same layers with each residual add folded into the RMSNorm
after it (vLLM's ``fused_add_rms_norm``): per layer two norm launches instead of two adds and
two norms of five to eight kernels each. It launches only shape-dependent kernels, so CUDA
graphs capture it (``graph_ready``)."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, ClassVar

import torch

from engine_worker.attention.metadata import AttentionMetadata
from engine_worker.backends import triton_int4
from engine_worker.backends.base import AttentionBackend, Backend, LinearFn
from engine_worker.backends.reference import REFERENCE
from engine_worker.ops import Unavailable
from engine_worker.weights.int4_layouts import INT4_GROUPS_TYPE

if TYPE_CHECKING:
    from engine_worker.lora.slots import LoRABatch
    from engine_worker.models.llama import LlamaLayerWeights, LlamaStack


def triton_unavailable_reason(device: torch.device) -> str | None:
    from engine_worker.attention.triton_backend import interpreting

    try:
        import triton  # noqa: F401
    except ImportError as e:
        return f"triton is not installed ({e})"
    if device.type != "cuda" and not interpreting():
        return f"Triton kernels need a CUDA GPU (or TRITON_INTERPRET=1), the device is {device}"
    return None


DESCRIPTION = ("Triton paged attention, fused norm / SwiGLU / RoPE kernels and int4 linear "
               "layers")


def _attention():
    # imported only once the backend is chosen: a CPU-only install may lack triton
    from engine_worker.attention.triton_backend import TritonAttentionBackend

    return TritonAttentionBackend()


def resolve_triton(device: torch.device) -> Backend | Unavailable:
    """The registry's entry: the backend, where Triton runs on ``device``."""
    reason = triton_unavailable_reason(device)
    if reason is not None:
        return Unavailable(reason)
    from engine_worker.backends import triton_ops

    attention = _attention()
    return dataclasses.replace(
        REFERENCE, name="triton", description=DESCRIPTION, rms_norm=triton_ops.rms_norm,
        silu_and_mul=triton_ops.silu_and_mul, rope=triton_ops.rope, attention=attention,
        linear=triton_int4.linear, pack_weight=triton_int4.pack_weight,
        quantized_types=frozenset({INT4_GROUPS_TYPE}),
        # a tensor-parallel shard runs layer by layer (its all-reduces go over NCCL there)
        fused_stacks={"llama": lambda stack: None if stack.tensor_parallel else
                      TritonLlamaLayers(stack, triton_int4.linear, attention)})


class TritonLlamaLayers:
    """A Llama-layout stack's layers, the residual stream kept beside the normed activations
    so that each add runs inside the next norm's kernel. The same ops as the per-layer path
    (``models/llama.py``) otherwise, in the model's dtype. ``x`` (the embeddings) is read,
    never written. It runs LoRA steps too (``takes_lora``): each adapter delta added onto its
    projection's output by the step's pair (the Triton one on CUDA), slots in the model's
    dtype (``lora_dtype``: None, the engine's own)."""

    # launches depend on tensor shapes only: CUDA graphs may capture it (engine.py)
    graph_ready: ClassVar[bool] = True

    __slots__ = ("stack", "linear", "attention", "q_size", "kv_size")

    def __init__(self, stack: LlamaStack, linear: LinearFn, attention: AttentionBackend) -> None:
        self.stack = stack
        self.linear = linear
        self.attention = attention
        self.q_size = stack.num_heads * stack.head_dim
        self.kv_size = stack.num_kv_heads * stack.head_dim

    lora_dtype: ClassVar[None] = None

    def takes_lora(self, lora: LoRABatch) -> bool:
        return not lora.ops.b_rank_major and len(lora.a) == len(self.stack.layers)

    def __call__(self, x: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                 meta: AttentionMetadata, attention_ns: torch.Tensor | None = None,
                 lora: LoRABatch | None = None) -> torch.Tensor:
        # x: [num_tokens, hidden_size] -> the residual stream after every layer
        from engine_worker.backends.triton_ops import fused_add_rms_norm, rms_norm

        stack = self.stack
        eps = stack.rms_norm_eps
        layers = stack.layers
        if not layers:
            return x
        residual = x.clone()
        h = rms_norm(residual, layers[0].input_norm, eps)
        for i, (layer, kv_cache) in enumerate(zip(layers, kv_caches)):
            attn = self._attention(i, layer, h, positions, kv_cache, meta, lora)
            h = fused_add_rms_norm(attn, residual, layer.post_attention_norm, eps)
            mlp = self._mlp(i, layer, h, lora)
            if i + 1 < len(layers):
                h = fused_add_rms_norm(mlp, residual, layers[i + 1].input_norm, eps)
            else:
                residual.add_(mlp)
        return residual

    def _attention(self, i: int, layer: LlamaLayerWeights, h: torch.Tensor,
                   positions: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
                   lora: LoRABatch | None) -> torch.Tensor:
        from engine_worker.backends.triton_ops import rope

        stack = self.stack
        lin = layer.qkv_proj
        qkv = self.linear(h, lin.weight, lin.bias, lin.packed)
        if lora is not None:
            qkv = lora.add(qkv, h, i, "qkv_proj")
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = rope(positions, q.view(-1, stack.num_heads, stack.head_dim),
                    k.view(-1, stack.num_kv_heads, stack.head_dim), stack.rope_cos,
                    stack.rope_sin)
        out = self.attention.forward(q, k, v.view(-1, stack.num_kv_heads, stack.head_dim),
                                     kv_cache, meta, stack.attention_scale)
        lin = layer.o_proj
        out = out.reshape(-1, self.q_size)
        y = self.linear(out, lin.weight, lin.bias, lin.packed)
        return y if lora is None else lora.add(y, out, i, "o_proj")

    def _mlp(self, i: int, layer: LlamaLayerWeights, h: torch.Tensor,
             lora: LoRABatch | None) -> torch.Tensor:
        from engine_worker.backends.triton_ops import silu_and_mul

        up, down = layer.gate_up_proj, layer.down_proj
        if lora is None:
            return self.linear(silu_and_mul(self.linear(h, up.weight, up.bias, up.packed)),
                               down.weight, down.bias, down.packed)
        gate_up = lora.add(self.linear(h, up.weight, up.bias, up.packed), h, i, "gate_up_proj")
        act = silu_and_mul(gate_up)
        return lora.add(self.linear(act, down.weight, down.bias, down.packed), act, i,
                        "down_proj")


def with_attention(backend: Backend, attention_backend: str) -> Backend:
    """``backend`` with another attention implementation (``--attention-backend``); the fused
    layer stacks, which have their own attention inside, are then off."""
    attention = REFERENCE.attention if attention_backend == "torch" else _attention()
    return dataclasses.replace(backend, attention=attention, fused_stacks={},
                               description=f"{backend.description}, {attention_backend} "
                                           "attention")
