"""What a kernel backend is, and the data a model hands it.

A backend is a bundle of functions over tensors: the per-op kernels the model's modules call
(linear, RMSNorm, SwiGLU, RoPE, paged attention) and, where it has one, a fused implementation
of a whole decoder stack. It is given weights as data (``LinearWeights``, ``LlamaLayerWeights``,
exported by the model once after loading) and never walks the model's modules.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from engine_worker.attention.metadata import AttentionMetadata

# (x, weight, bias, packed weight or None) -> x @ weight.T + bias
LinearFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None, Any], torch.Tensor]
# a loaded linear weight -> the backend's own layout of it (what LinearFn takes as ``packed``)
PackFn = Callable[[torch.Tensor], Any]
# (x, weight, eps) -> RMSNorm(x)
NormFn = Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]
# (positions, q, k, cos, sin) -> (q, k) rotated
RopeFn = Callable[..., tuple[torch.Tensor, torch.Tensor]]


class AttentionBackend(Protocol):
    """Writes the step's new K/V into the paged cache and attends over it."""

    name: str

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float) -> torch.Tensor:
        # q: [num_tokens, num_heads, head_dim]; k, v: [num_tokens, num_kv_heads, head_dim]
        # -> [num_tokens, num_heads, head_dim]
        ...


@dataclass(frozen=True, slots=True)
class LinearWeights:
    weight: torch.Tensor  # [out_features, in_features], the checkpoint's tensor
    bias: torch.Tensor | None  # [out_features]
    packed: Any  # the backend's layout of ``weight`` (its PackFn's result), or None


@dataclass(frozen=True, slots=True)
class LlamaLayerWeights:
    """One pre-norm decoder layer, QKV and gate/up fused as the model holds them."""

    input_norm: torch.Tensor  # [hidden_size]
    qkv_proj: LinearWeights  # [(num_heads + 2 * num_kv_heads) * head_dim, hidden_size]
    o_proj: LinearWeights  # [hidden_size, num_heads * head_dim]
    post_attention_norm: torch.Tensor  # [hidden_size]
    gate_up_proj: LinearWeights  # [2 * intermediate_size, hidden_size]
    down_proj: LinearWeights  # [hidden_size, intermediate_size]

    @property
    def linears(self) -> tuple[LinearWeights, ...]:
        return (self.qkv_proj, self.o_proj, self.gate_up_proj, self.down_proj)


@dataclass(frozen=True, slots=True)
class LlamaStack:
    """A Llama's decoder layers as data: what a fused implementation needs to run them all."""

    layers: tuple[LlamaLayerWeights, ...]
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    attention_scale: float
    rope_cos: torch.Tensor  # [max_position, head_dim] fp32
    rope_sin: torch.Tensor  # [max_position, head_dim] fp32


# (x, positions, kv_caches, meta, attention_ns=None) -> x after every layer. ``attention_ns``
# (int64 [1]), where given, gets the fused call's cache-write and attention time added to it.
LayersFn = Callable[..., torch.Tensor]


@dataclass(frozen=True, slots=True)
class Backend:
    """The kernels one engine runs, chosen once at start (see ``backends.select_backend``)."""

    name: str
    description: str  # what it is, for the start-up line and GetModelInfo
    linear: LinearFn
    pack_weight: PackFn
    rms_norm: NormFn
    silu_and_mul: Callable[[torch.Tensor], torch.Tensor]  # [n, 2 * w] -> [n, w]
    rope: RopeFn
    attention: AttentionBackend
    # a loaded Llama's layers -> all of them as one call, or None where the backend has no
    # fused stack for them (the model then runs its layers one by one through the ops above)
    llama_layers: Callable[[LlamaStack], LayersFn | None]
    # the device -> None where this backend runs there, else why not
    unavailable_reason: Callable[[torch.device], str | None]
