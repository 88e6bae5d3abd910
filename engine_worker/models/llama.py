"""The Llama family (Llama 2/3, Mistral, Qwen2, SmolLM): pre-norm decoder, GQA, RoPE, SwiGLU.

Tokens are flat (``[num_tokens, ...]``) across the whole batch; where each token's K/V live in
the paged cache comes from the attention metadata. Every op comes from the engine's backend
(``engine_worker.backends``); once loaded, the model exports its weights as data
(``LlamaStack``, described here, next to the model) and a backend with a fused implementation
of that kind of stack runs all layers in one call.
Checkpoint naming and layout quirks live in ``engine_worker.weights.loader``, never here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch
from torch import nn

from engine_worker.attention.metadata import AttentionMetadata
from engine_worker.backends.base import Backend, LayersFn, LinearWeights
from engine_worker.layers.linear import Linear
from engine_worker.layers.norm import RMSNorm
from engine_worker.layers.rotary import RopeConfig, RotaryEmbedding

if TYPE_CHECKING:
    from engine_worker.lora.slots import LoRABatch


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
    """The decoder layers as data: what a fused implementation needs to run them all. Llama,
    Mistral and Qwen2 (its q/k/v biases are ``LinearWeights.bias``) share this layout."""

    # what backends key their fused implementation of this layout by (Backend.fused_stacks)
    kind: ClassVar[str] = "llama"

    layers: tuple[LlamaLayerWeights, ...]
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    attention_scale: float
    rope_cos: torch.Tensor  # [max_position, head_dim] fp32
    rope_sin: torch.Tensor  # [max_position, head_dim] fp32


class LlamaAttention(nn.Module):
    """Grouped-query attention over the paged KV cache: a fused QKV projection, RoPE on q and
    k, attention (the backend's), and the output projection."""

    def __init__(self, cfg: LlamaConfig, rotary: RotaryEmbedding, backend: Backend,
                 layer: int = 0) -> None:
        super().__init__()
        self.cfg = cfg
        self.layer = layer  # which slot of a LoRA batch's per-layer weights is this layer's
        self.qkv_proj = Linear(cfg.hidden_size, cfg.q_size + 2 * cfg.kv_size, cfg.qkv_bias,
                               backend.linear, backend.pack_weight)
        self.o_proj = Linear(cfg.q_size, cfg.hidden_size, cfg.o_bias, backend.linear,
                             backend.pack_weight)
        self.rotary = rotary
        self.attention = backend.attention
        self.scale = cfg.head_dim ** -0.5

    def forward(self, positions: torch.Tensor, x: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata, lora: LoRABatch | None = None) -> torch.Tensor:
        # x: [num_tokens, hidden_size] -> [num_tokens, hidden_size]
        q, k, v = self.qkv_rope(positions, x, lora)
        out = self.attention.forward(q, k, v, kv_cache, meta, self.scale)
        out = out.reshape(-1, self.cfg.q_size)
        y = self.o_proj(out)
        return y if lora is None else lora.add(y, out, self.layer, "o_proj")

    def qkv_rope(self, positions: torch.Tensor, x: torch.Tensor,
                 lora: LoRABatch | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        # x: [num_tokens, hidden_size] -> q [num_tokens, num_heads, head_dim],
        # k, v [num_tokens, num_kv_heads, head_dim]
        cfg = self.cfg
        qkv = self.qkv_proj(x)
        if lora is not None:  # each token's adapter delta, on top of the base projection
            qkv = lora.add(qkv, x, self.layer, "qkv_proj")
        q, k, v = qkv.split([cfg.q_size, cfg.kv_size, cfg.kv_size], dim=-1)
        q = q.view(-1, cfg.num_heads, cfg.head_dim)
        k = k.view(-1, cfg.num_kv_heads, cfg.head_dim)
        v = v.view(-1, cfg.num_kv_heads, cfg.head_dim)
        q, k = self.rotary(positions, q, k)
        return q, k, v


class LlamaMLP(nn.Module):
    """SwiGLU (Shazeer, 2020) over a fused gate/up projection."""

    def __init__(self, cfg: LlamaConfig, backend: Backend, layer: int = 0) -> None:
        super().__init__()
        self.layer = layer
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * cfg.intermediate_size, cfg.mlp_bias,
                                   backend.linear, backend.pack_weight)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, cfg.mlp_bias,
                                backend.linear, backend.pack_weight)
        self.silu_and_mul = backend.silu_and_mul

    def forward(self, x: torch.Tensor, lora: LoRABatch | None = None) -> torch.Tensor:
        # x: [num_tokens, hidden_size] -> [num_tokens, hidden_size]
        if lora is None:
            return self.down_proj(self.silu_and_mul(self.gate_up_proj(x)))
        h = self.silu_and_mul(lora.add(self.gate_up_proj(x), x, self.layer, "gate_up_proj"))
        return lora.add(self.down_proj(h), h, self.layer, "down_proj")


class LlamaDecoderLayer(nn.Module):
    """Pre-norm: h = x + attention(norm(x)); out = h + mlp(norm(h))."""

    def __init__(self, cfg: LlamaConfig, rotary: RotaryEmbedding, backend: Backend,
                 layer: int = 0) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, backend.rms_norm)
        self.self_attn = LlamaAttention(cfg, rotary, backend, layer)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps,
                                                backend.rms_norm)
        self.mlp = LlamaMLP(cfg, backend, layer)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata, lora: LoRABatch | None = None) -> torch.Tensor:
        h = x + self.self_attn(positions, self.input_layernorm(x), kv_cache, meta, lora)
        return h + self.mlp(self.post_attention_layernorm(h), lora)

    def export(self) -> LlamaLayerWeights:
        attn, mlp = self.self_attn, self.mlp
        return LlamaLayerWeights(
            input_norm=self.input_layernorm.weight, qkv_proj=attn.qkv_proj.export(),
            o_proj=attn.o_proj.export(), post_attention_norm=self.post_attention_layernorm.weight,
            gate_up_proj=mlp.gate_up_proj.export(), down_proj=mlp.down_proj.export())


class LlamaForCausalLM(nn.Module):
    """``forward`` returns final hidden states; ``compute_logits`` projects the rows to sample."""

    def __init__(self, cfg: LlamaConfig, backend: Backend, max_position: int,
                 device: torch.device) -> None:
        super().__init__()
        self.cfg = cfg
        self.backend = backend
        self.logits_packed = None
        # the loader's other form of a tied embedding for the logits (a GGUF's blocks), if any
        self.tied_logits_weight: torch.Tensor | None = None
        self.layer_stack: LayersFn | None = None  # every layer in one call, where the backend can
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.rotary = RotaryEmbedding(cfg.rope, max_position, device, backend.rope)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, self.rotary, backend, i)
                                    for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, backend.rms_norm)
        if cfg.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, False, backend.linear,
                                  backend.pack_weight)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[torch.Tensor], meta: AttentionMetadata,
                lora: LoRABatch | None = None) -> torch.Tensor:
        """``lora``: the step's adapters per token (None: every token runs the base model,
        through the fused stack where the backend has one)."""
        # input_ids, positions: [num_tokens] -> hidden states [num_tokens, hidden_size]
        x = self.embed_tokens(input_ids)
        if self.layer_stack is not None and lora is None:
            x = self.layer_stack(x, positions, kv_caches, meta)
        else:
            for layer, kv_cache in zip(self.layers, kv_caches):
                x = layer(positions, x, kv_cache, meta, lora)
        return self.norm(x)

    def lora_projections(self) -> dict[str, tuple[tuple[str, int, int], ...]]:
        """Fused projection -> the PEFT modules it concatenates: (name, in, out) each."""
        cfg = self.cfg
        h, q, kv, i = cfg.hidden_size, cfg.q_size, cfg.kv_size, cfg.intermediate_size
        return {"qkv_proj": (("q_proj", h, q), ("k_proj", h, kv), ("v_proj", h, kv)),
                "o_proj": (("o_proj", q, h),),
                "gate_up_proj": (("gate_proj", h, i), ("up_proj", h, i)),
                "down_proj": (("down_proj", i, h),)}

    def pack_weights(self) -> None:
        """Once the checkpoint is loaded: every linear weight into the backend's layout, then
        the layers' weights handed to the backend as data for its fused implementation of
        this stack, if it has one."""
        for module in self.modules():
            if isinstance(module, Linear):
                module.pack()
        self.logits_packed = (self.backend.pack_weight(self._logits_weight())
                              if self.lm_head is None else self.lm_head.packed)
        self.layer_stack = self.backend.fuse(self.export())

    def export(self) -> LlamaStack:
        """The decoder layers' loaded (and packed) weights and shapes, as plain data."""
        cfg = self.cfg
        return LlamaStack(
            layers=tuple(layer.export() for layer in self.layers), hidden_size=cfg.hidden_size,
            num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
            rms_norm_eps=cfg.rms_norm_eps, attention_scale=cfg.head_dim ** -0.5,
            rope_cos=self.rotary.cos, rope_sin=self.rotary.sin)

    def _logits_weight(self) -> torch.Tensor:
        if self.lm_head is not None:
            return self.lm_head.weight
        if self.tied_logits_weight is not None:
            return self.tied_logits_weight
        return self.embed_tokens.weight

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # hidden: [num_rows, hidden_size] -> fp32 logits [num_rows, vocab_size]
        return self.backend.linear(hidden, self._logits_weight(), None,
                                   self.logits_packed).float()
