"""The pre-norm decoder layer's two halves around attention, as compositions of its modules.

    norm_qkv_rope:  x -> RMSNorm -> fused QKV projection -> RoPE            -> q, k, v
    residual_mlp:   h = x + o_proj(attn);  h + down(silu(gate) * up)(RMSNorm(h))

These are the references: each module runs its own kernel. ``layers.kernels`` may replace a
whole half with one fused op (``csrc/cpu/llama_block.cpp``) that must give the same result.
"""

from __future__ import annotations

import torch

from engine_worker.layers.linear import Linear
from engine_worker.layers.norm import RMSNorm
from engine_worker.layers.rotary import RotaryEmbedding


def norm_qkv_rope(x: torch.Tensor, positions: torch.Tensor, norm: RMSNorm, qkv_proj: Linear,
                  rotary: RotaryEmbedding, num_heads: int, num_kv_heads: int,
                  head_dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # x: [num_tokens, hidden_size] -> q [num_tokens, num_heads, head_dim], k, v [.., num_kv_heads, ..]
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    q, k, v = qkv_proj(norm(x)).split([q_size, kv_size, kv_size], dim=-1)
    q = q.view(-1, num_heads, head_dim)
    k = k.view(-1, num_kv_heads, head_dim)
    v = v.view(-1, num_kv_heads, head_dim)
    q, k = rotary(positions, q, k)
    return q, k, v


def residual_mlp(x: torch.Tensor, attn: torch.Tensor, o_proj: Linear, norm: RMSNorm,
                 gate_up_proj: Linear, down_proj: Linear, silu_and_mul) -> torch.Tensor:
    # x: [num_tokens, hidden_size]; attn: [num_tokens, num_heads * head_dim]
    h = x + o_proj(attn)
    return h + down_proj(silu_and_mul(gate_up_proj(norm(h))))
