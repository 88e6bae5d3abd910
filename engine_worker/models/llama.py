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
from engine_worker.backends.base import Backend, LayersFn, LinearWeights, stack_takes_lora
from engine_worker.distributed.comm import Collectives, WholeModel
from engine_worker.distributed.shard import PPStage, TPShard, shard_lora
from engine_worker.layers.linear import Linear
from engine_worker.layers.norm import RMSNorm
from engine_worker.layers.rotary import RopeConfig, RotaryEmbedding

if TYPE_CHECKING:
    from engine_worker.distributed.shm import ShmSegment
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
    # this rank's shard under tensor parallelism: o_proj's and down's outputs are partial
    # sums, to be all-reduced where the per-layer path does; ``tp_all_reduce``, the group's
    # shared memory where a kernel can do that itself (None: a fused implementation that
    # cannot reduce declines the stack, and it runs layer by layer)
    tensor_parallel: bool = False
    tp_all_reduce: ShmSegment | None = None


def whole_shard(cfg: LlamaConfig) -> TPShard:
    """One rank holding every head, the whole MLP and the whole vocabulary."""
    return TPShard.whole(num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads,
                         intermediate_size=cfg.intermediate_size, vocab_size=cfg.vocab_size)


class LlamaAttention(nn.Module):
    """Grouped-query attention over the paged KV cache: a fused QKV projection, RoPE on q and
    k, attention (the backend's), and the output projection. Under tensor parallelism it holds
    its rank's heads (``shard``): q/k/v column-parallel, o row-parallel (its output is a
    partial sum the decoder layer all-reduces)."""

    def __init__(self, cfg: LlamaConfig, rotary: RotaryEmbedding, backend: Backend,
                 layer: int = 0, shard: TPShard | None = None) -> None:
        super().__init__()
        self.cfg = cfg
        self.layer = layer  # which slot of a LoRA batch's per-layer weights is this layer's
        shard = shard or whole_shard(cfg)
        self.num_heads, self.num_kv_heads = shard.num_heads, shard.num_kv_heads
        self.q_size = shard.num_heads * cfg.head_dim
        self.kv_size = shard.num_kv_heads * cfg.head_dim
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, cfg.qkv_bias,
                               backend.linear, backend.pack_weight)
        self.o_proj = Linear(self.q_size, cfg.hidden_size, cfg.o_bias, backend.linear,
                             backend.pack_weight)
        self.rotary = rotary
        self.attention = backend.attention
        self.scale = cfg.head_dim ** -0.5

    def forward(self, positions: torch.Tensor, x: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata, lora: LoRABatch | None = None) -> torch.Tensor:
        # x: [num_tokens, hidden_size] -> [num_tokens, hidden_size]
        q, k, v = self.qkv_rope(positions, x, lora)
        out = self.attention.forward(q, k, v, kv_cache, meta, self.scale)
        out = out.reshape(-1, self.q_size)
        y = self.o_proj(out)
        return y if lora is None else lora.add(y, out, self.layer, "o_proj")

    def qkv_rope(self, positions: torch.Tensor, x: torch.Tensor,
                 lora: LoRABatch | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        # x: [num_tokens, hidden_size] -> q [num_tokens, num_heads, head_dim],
        # k, v [num_tokens, num_kv_heads, head_dim]
        head_dim = self.cfg.head_dim
        qkv = self.qkv_proj(x)
        if lora is not None:  # each token's adapter delta, on top of the base projection
            qkv = lora.add(qkv, x, self.layer, "qkv_proj")
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, head_dim)
        k = k.view(-1, self.num_kv_heads, head_dim)
        v = v.view(-1, self.num_kv_heads, head_dim)
        q, k = self.rotary(positions, q, k)
        return q, k, v


class LlamaMLP(nn.Module):
    """SwiGLU (Shazeer, 2020) over a fused gate/up projection (gate/up column-parallel, down
    row-parallel under tensor parallelism)."""

    def __init__(self, cfg: LlamaConfig, backend: Backend, layer: int = 0,
                 shard: TPShard | None = None) -> None:
        super().__init__()
        self.layer = layer
        width = (shard or whole_shard(cfg)).intermediate_size
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * width, cfg.mlp_bias,
                                   backend.linear, backend.pack_weight)
        self.down_proj = Linear(width, cfg.hidden_size, cfg.mlp_bias,
                                backend.linear, backend.pack_weight)
        self.silu_and_mul = backend.silu_and_mul

    def forward(self, x: torch.Tensor, lora: LoRABatch | None = None) -> torch.Tensor:
        # x: [num_tokens, hidden_size] -> [num_tokens, hidden_size]
        if lora is None:
            return self.down_proj(self.silu_and_mul(self.gate_up_proj(x)))
        h = self.silu_and_mul(lora.add(self.gate_up_proj(x), x, self.layer, "gate_up_proj"))
        return lora.add(self.down_proj(h), h, self.layer, "down_proj")


class LlamaDecoderLayer(nn.Module):
    """Pre-norm: h = x + attention(norm(x)); out = h + mlp(norm(h)). Under tensor
    parallelism attention's and the MLP's outputs are partial sums: one all-reduce each."""

    def __init__(self, cfg: LlamaConfig, rotary: RotaryEmbedding, backend: Backend,
                 layer: int = 0, shard: TPShard | None = None,
                 comm: Collectives | None = None) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, backend.rms_norm)
        self.self_attn = LlamaAttention(cfg, rotary, backend, layer, shard)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps,
                                                backend.rms_norm)
        self.mlp = LlamaMLP(cfg, backend, layer, shard)
        self.all_reduce = (comm or WholeModel()).all_reduce

    def forward(self, positions: torch.Tensor, x: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata, lora: LoRABatch | None = None) -> torch.Tensor:
        h = x + self.all_reduce(self.self_attn(positions, self.input_layernorm(x), kv_cache,
                                               meta, lora))
        return h + self.all_reduce(self.mlp(self.post_attention_layernorm(h), lora))

    def export(self) -> LlamaLayerWeights:
        attn, mlp = self.self_attn, self.mlp
        return LlamaLayerWeights(
            input_norm=self.input_layernorm.weight, qkv_proj=attn.qkv_proj.export(),
            o_proj=attn.o_proj.export(), post_attention_norm=self.post_attention_layernorm.weight,
            gate_up_proj=mlp.gate_up_proj.export(), down_proj=mlp.down_proj.export())


class OtherStageLayer(nn.Module):
    """The place of a decoder layer another pipeline stage holds (no weights here)."""


class LlamaForCausalLM(nn.Module):
    """``forward`` returns final hidden states; ``compute_logits`` projects the rows to sample.
    ``shard``/``comm``: this rank's slice under tensor parallelism and its collectives (the
    whole model and identities by default); the embedding and logits are split by vocabulary
    rows, and ``compute_logits`` returns every rank the full logits. ``stage``: the layers
    this rank's pipeline stage holds; the hidden states come from the previous stage and go
    to the next, and the last stage's final hidden states to every rank."""

    def __init__(self, cfg: LlamaConfig, backend: Backend, max_position: int,
                 device: torch.device, shard: TPShard | None = None,
                 comm: Collectives | None = None, stage: PPStage | None = None) -> None:
        super().__init__()
        self.cfg = cfg
        self.shard = shard or whole_shard(cfg)
        self.comm = comm or WholeModel()
        self.stage = stage or PPStage.whole(cfg.num_layers)
        self.backend = backend
        self.logits_packed = None
        # the loader's other form of a tied embedding for the logits (a GGUF's blocks), if any
        self.tied_logits_weight: torch.Tensor | None = None
        self.layer_stack: LayersFn | None = None  # every layer in one call, where the backend can
        # (embedding table, final norm weight) where the stack runs the step's ends as well
        self._stack_ends: tuple[torch.Tensor, torch.Tensor] | None = None
        vocab_rows = self.shard.vocab_per_rank
        # the loader assigns the table: nothing to initialise (a random init on the meta
        # device still runs through torch's decompositions, whose first use imports
        # torch._dynamo: 1.2-1.4 s of every engine start)
        self.embed_tokens = nn.Embedding(vocab_rows, cfg.hidden_size,
                                         _weight=torch.empty(vocab_rows, cfg.hidden_size))
        self.rotary = RotaryEmbedding(cfg.rope, max_position, device, backend.rope)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(cfg, self.rotary, backend, i, self.shard, self.comm)
            if self.stage.owns(i) else OtherStageLayer() for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, backend.rms_norm)
        if cfg.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = Linear(cfg.hidden_size, vocab_rows, False, backend.linear,
                                  backend.pack_weight)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[torch.Tensor], meta: AttentionMetadata,
                lora: LoRABatch | None = None) -> torch.Tensor:
        """``lora``: the step's adapters per token (None: every token runs the base model).
        Through the fused stack where the backend has one and, with LoRA, where it runs it."""
        # input_ids, positions: [num_tokens] -> hidden states [num_tokens, hidden_size]
        stage = self.stage
        if stage.num_stages == 1:
            stack = self.layer_stack  # (a test may take it away after the load)
            if self._stack_ends is not None and getattr(stack, "folds_ends", False) and (
                    lora is None or stack_takes_lora(stack, lora)):
                return stack(input_ids, positions, kv_caches, meta, lora=lora,
                             ends=self._stack_ends)
            return self.norm(self._layers(self._embed(input_ids), positions, kv_caches, meta,
                                          lora))
        num_tokens = input_ids.shape[0]
        # pipeline stages: the step in micro-batches (LoRA steps whole: their per-token
        # adapter groups are the step's), each passed on as soon as it is done
        pieces = stage.micro_batches(num_tokens) if lora is None else [(0, num_tokens)]
        outs, sends = [], []
        for tag, (start, end) in enumerate(pieces):
            piece = meta if len(pieces) == 1 else meta.token_range(start, end)
            if stage.is_first:
                x = self._embed(input_ids[start:end])
            else:
                x = self.comm.recv_from_previous_stage(torch.empty(
                    end - start, self.cfg.hidden_size, dtype=self.norm.weight.dtype,
                    device=input_ids.device), tag)
            x = self._layers(x, positions[start:end], kv_caches, piece, lora)
            if stage.is_last:
                outs.append(self.norm(x))
            else:
                sends.append((x, self.comm.send_to_next_stage(x, tag)))
        for _, work in sends:
            work.wait()
        x = torch.cat(outs) if stage.is_last else torch.empty(
            num_tokens, self.cfg.hidden_size, dtype=self.norm.weight.dtype,
            device=input_ids.device)
        return self.comm.broadcast_from_last_stage(x)

    def _layers(self, x: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                meta: AttentionMetadata, lora: LoRABatch | None) -> torch.Tensor:
        """This stage's decoder layers on ``x``: one fused call where the backend has one
        (and, with LoRA, where it runs it), else layer by layer."""
        stage = self.stage
        if self.layer_stack is not None and lora is None:
            return self.layer_stack(x, positions, self._stage_caches(kv_caches), meta)
        stage_lora = (lora if lora is None or stage.num_stages == 1
                      else lora.layers(stage.layer_start, stage.layer_end))
        if self.layer_stack is not None and stack_takes_lora(self.layer_stack, stage_lora):
            return self.layer_stack(x, positions, self._stage_caches(kv_caches), meta,
                                    lora=stage_lora)
        for i in range(stage.layer_start, stage.layer_end):
            x = self.layers[i](positions, x, kv_caches[i], meta, lora)
        return x

    def _stage_caches(self, kv_caches: list[torch.Tensor]) -> list[torch.Tensor]:
        """The KV caches of this stage's layers, the layers the fused stack holds."""
        if self.stage.num_stages == 1:
            return kv_caches
        return kv_caches[self.stage.layer_start:self.stage.layer_end]

    def kv_cache_shapes(self, num_blocks: int, block_size: int) -> list[tuple[int, ...]]:
        """Each layer's KV cache tensor: [2, num_blocks, block_size, kv heads, head_dim] for
        this rank's layers and heads; no heads (no memory) for another stage's layers."""
        return [(2, num_blocks, block_size,
                 self.shard.num_kv_heads if self.stage.owns(i) else 0, self.cfg.head_dim)
                for i in range(self.cfg.num_layers)]

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Vocab-parallel under tensor parallelism: each rank looks up the ids in its rows
        (zeros for the others) and the all-reduce assembles every row."""
        if not self.shard.is_split:
            return self.embed_tokens(input_ids)
        local = input_ids - self.shard.vocab_start
        mine = (local >= 0) & (local < self.shard.vocab_per_rank)
        x = self.embed_tokens(torch.where(mine, local, 0)) * mine.unsqueeze(-1)
        return self.comm.all_reduce(x)

    def lora_projections(self, whole: bool = False
                         ) -> dict[str, tuple[tuple[str, int, int], ...]]:
        """Fused projection -> the PEFT modules it concatenates: (name, in, out) each, this
        rank's sizes under tensor parallelism (``whole``: the model's, which an adapter's
        file has)."""
        cfg, shard = self.cfg, (whole_shard(self.cfg) if whole else self.shard)
        h, i = cfg.hidden_size, shard.intermediate_size
        q, kv = shard.num_heads * cfg.head_dim, shard.num_kv_heads * cfg.head_dim
        return {"qkv_proj": (("q_proj", h, q), ("k_proj", h, kv), ("v_proj", h, kv)),
                "o_proj": (("o_proj", q, h),),
                "gate_up_proj": (("gate_proj", h, i), ("up_proj", h, i)),
                "down_proj": (("down_proj", i, h),)}

    def lora_shard(self, module: str, lora_a: torch.Tensor, lora_b: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's part of one PEFT module's A and B (``distributed.shard.shard_lora``)."""
        return shard_lora(module, lora_a, lora_b, self.shard, self.cfg.head_dim)

    def pack_weights(self) -> None:
        """Once the checkpoint is loaded: every linear weight into the backend's layout, then
        the layers' weights handed to the backend as data for its fused implementation of
        this stack, if it has one."""
        for module in self.modules():
            if isinstance(module, Linear):
                module.pack()
        if self.lm_head is not None:
            self.logits_packed = self.lm_head.packed
        elif self.tied_logits_weight is not None:  # blocks, with the table's same values
            self.logits_packed = self.backend.pack_weight(self.tied_logits_weight,
                                                          dense=self.embed_tokens.weight)
        else:
            self.logits_packed = self.backend.pack_weight(self._logits_weight())
        # one call over this stage's layers, where the backend fuses them (under tensor
        # parallelism: where its fused call can run the all-reduces between them too)
        self.layer_stack = self.backend.fuse(self.export())
        # the embedding lookup and the final norm inside the stack's call, where it runs them
        # exactly as forward would around it: the whole model on this rank (no vocabulary
        # split, no pipeline stages), the table and the norm in one dtype the norm's kernel
        # takes (RMSNorm's own kernel would otherwise decide)
        table, norm = self.embed_tokens.weight, self.norm.weight
        if getattr(self.layer_stack, "folds_ends", False) and self.stage.num_stages == 1 \
                and not self.shard.is_split and table.is_contiguous() \
                and table.dtype == norm.dtype and table.device.type == "cpu":
            self._stack_ends = (table.detach(), norm.detach())

    def export(self) -> LlamaStack:
        """The decoder layers' loaded (and packed) weights and shapes, as plain data."""
        cfg = self.cfg
        return LlamaStack(
            layers=tuple(layer.export() for layer in self.layers
                         if isinstance(layer, LlamaDecoderLayer)), hidden_size=cfg.hidden_size,
            num_heads=self.shard.num_heads, num_kv_heads=self.shard.num_kv_heads,
            head_dim=cfg.head_dim,
            rms_norm_eps=cfg.rms_norm_eps, attention_scale=cfg.head_dim ** -0.5,
            rope_cos=self.rotary.cos, rope_sin=self.rotary.sin,
            tensor_parallel=self.shard.is_split, tp_all_reduce=self.comm.kernel_all_reduce)

    def _logits_weight(self) -> torch.Tensor:
        if self.lm_head is not None:
            return self.lm_head.weight
        if self.tied_logits_weight is not None:
            return self.tied_logits_weight
        return self.embed_tokens.weight

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # hidden: [num_rows, hidden_size] -> fp32 logits [num_rows, vocab_size]
        logits = self.backend.logits(hidden, self._logits_weight(), self.logits_packed)
        if not self.shard.is_split:
            return logits
        # every rank gets the whole row and samples it as rank 0 does (vLLM v1's way), so
        # the ranks' request states stay equal without a second message
        return self.comm.all_gather_last(logits)[:, :self.cfg.vocab_size]
