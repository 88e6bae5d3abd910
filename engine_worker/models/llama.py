"""The Llama family (Llama 2/3, Mistral, Qwen2, SmolLM): pre-norm decoder, GQA, RoPE, SwiGLU.

Tokens are flat (``[num_tokens, ...]``) across the whole batch; where each token's K/V live in
the paged cache comes from the attention metadata. Checkpoint naming and layout quirks live in
``engine_worker.weights.loader``, never here.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from engine_worker.attention.metadata import AttentionMetadata
from engine_worker.layers.kernels import LAYER_KERNELS, LayerKernels
from engine_worker.layers.linear import Linear
from engine_worker.layers.norm import RMSNorm
from engine_worker.layers.rotary import RopeConfig, RotaryEmbedding


@dataclass(frozen=True, slots=True)
class LlamaConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeConfig
    tie_word_embeddings: bool
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim


class LlamaAttention(nn.Module):
    """RMSNorm, the fused QKV projection and RoPE (one kernel call), then paged attention.
    ``o_proj`` is applied by the layer's second half, together with the residual."""

    def __init__(self, cfg: LlamaConfig, rotary: RotaryEmbedding, backend,
                 kernels: LayerKernels) -> None:
        super().__init__()
        self.cfg = cfg
        self.qkv_proj = Linear(cfg.hidden_size, cfg.q_size + 2 * cfg.kv_size, cfg.qkv_bias,
                               kernels.linear, kernels.pack_weight)
        self.o_proj = Linear(cfg.q_size, cfg.hidden_size, cfg.o_bias, kernels.linear,
                             kernels.pack_weight)
        self.rotary = rotary
        self.backend = backend
        self.scale = cfg.head_dim ** -0.5
        self.norm_qkv_rope = kernels.norm_qkv_rope

    def forward(self, positions: torch.Tensor, x: torch.Tensor, norm: RMSNorm,
                kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        # x: [num_tokens, hidden_size] -> attention output [num_tokens, num_heads * head_dim]
        cfg = self.cfg
        q, k, v = self.norm_qkv_rope(x, positions, norm, self.qkv_proj, self.rotary,
                                     cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
        out = self.backend.forward(q, k, v, kv_cache, meta, self.scale)
        return out.reshape(-1, cfg.q_size)


class LlamaMLP(nn.Module):
    """SwiGLU over a fused gate/up projection; run by the layer's ``residual_mlp`` kernel."""

    def __init__(self, cfg: LlamaConfig, kernels: LayerKernels) -> None:
        super().__init__()
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * cfg.intermediate_size, cfg.mlp_bias,
                                   kernels.linear, kernels.pack_weight)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, cfg.mlp_bias,
                                kernels.linear, kernels.pack_weight)
        self.silu_and_mul = kernels.silu_and_mul


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: LlamaConfig, rotary: RotaryEmbedding, backend,
                 kernels: LayerKernels) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, kernels.rms_norm)
        self.self_attn = LlamaAttention(cfg, rotary, backend, kernels)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps,
                                                kernels.rms_norm)
        self.mlp = LlamaMLP(cfg, kernels)
        self.residual_mlp = kernels.residual_mlp

    def forward(self, positions: torch.Tensor, x: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        # h = x + o_proj(attention(norm(x)));  h + mlp(norm(h))
        attn = self.self_attn(positions, x, self.input_layernorm, kv_cache, meta)
        mlp = self.mlp
        return self.residual_mlp(x, attn, self.self_attn.o_proj, self.post_attention_layernorm,
                                 mlp.gate_up_proj, mlp.down_proj, mlp.silu_and_mul)


class LlamaForCausalLM(nn.Module):
    """``forward`` returns final hidden states; ``compute_logits`` projects the rows to sample."""

    def __init__(self, cfg: LlamaConfig, backend, max_position: int, device: torch.device,
                 kernels: LayerKernels = LAYER_KERNELS["torch"]) -> None:
        super().__init__()
        self.cfg = cfg
        self.kernels = kernels
        self.logits_packed = None
        self.layer_stack = None  # every layer in one kernel call, where the kernels allow
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        rotary = RotaryEmbedding(cfg.rope, max_position, device, kernels.rope)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, rotary, backend, kernels)
                                    for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, kernels.rms_norm)
        if cfg.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, False, kernels.linear,
                                  kernels.pack_weight)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[torch.Tensor], meta: AttentionMetadata) -> torch.Tensor:
        # input_ids, positions: [num_tokens] -> hidden states [num_tokens, hidden_size]
        x = self.embed_tokens(input_ids)
        if self.layer_stack is not None:
            x = self.layer_stack(x, positions, kv_caches, meta)
        else:
            for layer, kv_cache in zip(self.layers, kv_caches):
                x = layer(positions, x, kv_cache, meta)
        return self.norm(x)

    def pack_weights(self) -> None:
        """Once the checkpoint is loaded: every linear weight into its kernel's layout."""
        for module in self.modules():
            if isinstance(module, Linear):
                module.pack()
        self.logits_packed = (self.kernels.pack_weight(self.embed_tokens.weight)
                              if self.lm_head is None else self.lm_head.packed)
        self.layer_stack = self.kernels.layer_stack(self)

    def _logits_weight(self) -> torch.Tensor:
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # hidden: [num_rows, hidden_size] -> fp32 logits [num_rows, vocab_size]
        return self.kernels.linear(hidden, self._logits_weight(), None,
                                   self.logits_packed).float()
