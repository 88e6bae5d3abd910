"""Which slice of a Llama-family model one tensor-parallel rank holds (Megatron-LM's split).

Column-parallel layers (q/k/v, gate/up) keep a rank's output rows; row-parallel layers (o,
down) keep its input columns, and their partial outputs are summed by one all-reduce each. The
embedding and the logits are split by vocabulary rows. Attention is split by KV head: each rank
holds ``num_kv_heads / tp`` KV heads and their query heads; where ``tp`` exceeds the KV heads,
each KV head is replicated on ``tp / num_kv_heads`` ranks (vLLM's rule), so the KV cache of a
rank is always whole heads. Slicing happens at load, on the full checkpoint's tensors; the model
code sees only its own sizes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class TPShard:
    """One rank's sizes. ``TPShard.whole(...)`` is the single-process model."""

    rank: int
    size: int
    num_heads: int  # this rank's query heads
    num_kv_heads: int  # this rank's KV heads (replicas included)
    kv_head_start: int  # the model's index of this rank's first KV head
    intermediate_size: int
    vocab_start: int
    vocab_per_rank: int  # rows of this rank's embedding / logits slice (the last one padded)

    @classmethod
    def whole(cls, *, num_heads: int, num_kv_heads: int, intermediate_size: int,
              vocab_size: int) -> TPShard:
        return cls(0, 1, num_heads, num_kv_heads, 0, intermediate_size, 0, vocab_size)

    @classmethod
    def of(cls, rank: int, size: int, *, num_heads: int, num_kv_heads: int,
           intermediate_size: int, vocab_size: int) -> TPShard:
        """Rank ``rank`` of ``size``; ValueError naming both numbers where they do not split."""
        check_divisible(size, num_heads=num_heads, num_kv_heads=num_kv_heads,
                        intermediate_size=intermediate_size)
        if num_kv_heads >= size:
            kv_local, kv_start = num_kv_heads // size, rank * (num_kv_heads // size)
        else:  # replicated: ranks [k * tp / kv, (k + 1) * tp / kv) share KV head k
            kv_local, kv_start = 1, rank // (size // num_kv_heads)
        vocab_per_rank = -(-vocab_size // size)
        return cls(rank, size, num_heads // size, kv_local, kv_start, intermediate_size // size,
                   rank * vocab_per_rank, vocab_per_rank)

    @property
    def is_split(self) -> bool:
        return self.size > 1


# the fewest tokens a pipeline micro-batch holds (PPStage.micro_batches)
MIN_MICRO_BATCH_TOKENS = 64


@dataclass(frozen=True, slots=True)
class PPStage:
    """One pipeline stage: decoder layers ``[layer_start, layer_end)``, contiguous, split as
    evenly as the count allows. ``PPStage.whole(n)`` is the single-stage model."""

    stage: int
    num_stages: int
    layer_start: int
    layer_end: int
    micro_batch_tokens: int = MIN_MICRO_BATCH_TOKENS  # 0: steps whole

    @classmethod
    def whole(cls, num_layers: int) -> PPStage:
        return cls(0, 1, 0, num_layers)

    @classmethod
    def of(cls, stage: int, num_stages: int, num_layers: int,
           micro_batch_tokens: int = MIN_MICRO_BATCH_TOKENS) -> PPStage:
        if num_layers < num_stages:
            raise ValueError(f"pipeline_parallel_size: {num_stages} exceeds the model's "
                             f"{num_layers} layers")
        return cls(stage, num_stages, stage * num_layers // num_stages,
                   (stage + 1) * num_layers // num_stages, micro_batch_tokens)

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.num_stages - 1

    def owns(self, layer: int) -> bool:
        return self.layer_start <= layer < self.layer_end

    def micro_batches(self, num_tokens: int) -> list[tuple[int, int]]:
        """A step's tokens as the pieces the stages pass along one after another, so stage
        s + 1 runs piece i while stage s runs piece i + 1: up to two a stage, none under
        ``micro_batch_tokens`` (a piece's matmuls must stay compute-bound: a decode step's
        weights would be streamed once a piece for nothing). One piece, the whole step, with
        one stage, a small step, or micro-batches off (0)."""
        if self.num_stages == 1 or self.micro_batch_tokens == 0:
            return [(0, num_tokens)]
        pieces = min(2 * self.num_stages, num_tokens // self.micro_batch_tokens)
        if pieces < 2:
            return [(0, num_tokens)]
        bounds = [num_tokens * k // pieces for k in range(pieces + 1)]
        return list(zip(bounds, bounds[1:]))


def check_divisible(size: int, *, num_heads: int, num_kv_heads: int,
                    intermediate_size: int) -> None:
    """ValueError (naming ``tensor_parallel_size`` and the model's number) unless ``size``
    splits the model: it must divide the attention heads and the MLP width, and either divide
    the KV heads or be a multiple of them (then KV heads are replicated)."""
    prefix = f"tensor_parallel_size: {size}"
    if num_heads % size:
        raise ValueError(f"{prefix} does not divide the model's {num_heads} attention heads")
    if num_kv_heads % size and size % num_kv_heads:
        raise ValueError(f"{prefix} neither divides the model's {num_kv_heads} KV heads nor is "
                         f"a multiple of them")
    if intermediate_size % size:
        raise ValueError(f"{prefix} does not divide the model's MLP width {intermediate_size}")


def shard_llama_state(state: dict[str, torch.Tensor], *, shard: TPShard, num_heads: int,
                      num_kv_heads: int, head_dim: int) -> dict[str, torch.Tensor]:
    """A full checkpoint's tensors (Q/K/V and gate/up already fused, as the loader makes them)
    sliced to ``shard``. Row-parallel biases stay on rank 0 only (zeros elsewhere), so the
    all-reduce adds them once.

    Packed quantized weights slice the same way, GGUF blocks (uint8 ``[N, K / block,
    bytes]``, as the file has them, or AWQ / GPTQ repacked so) and the int4 group layout
    (int32 ``[N, K / group, words]``): by output rows, or, for o and down, by whole blocks
    (groups) of input columns (each keeps its own scale, so a rank's partial sum is exactly
    its blocks' share); a width whose blocks ``shard.size`` does not divide is an error
    naming both numbers."""
    if not shard.is_split:
        return state
    out = {}
    for name, tensor in state.items():
        packed = tensor.dtype in (torch.uint8, torch.int32) and tensor.dim() == 3
        if packed and name.endswith(("o_proj.weight", "down_proj.weight")) \
                and tensor.shape[1] % shard.size:
            raise ValueError(f"tensor_parallel_size: {shard.size} does not divide the "
                             f"{tensor.shape[1]} quantized blocks of a row of {name} (its "
                             f"input columns split by whole blocks); use "
                             f"quantization=dequantize")
        out[name] = _slice(name, tensor, shard, num_heads, num_kv_heads, head_dim).contiguous()
    return out


def shard_vocab_rows(t: torch.Tensor, shard: TPShard) -> torch.Tensor:
    """This rank's rows of a vocabulary-sized tensor (embedding, logits; floats or blocks),
    the last rank's padded with zero rows (a zero block is a zero weight in every format)."""
    rows = t[shard.vocab_start:shard.vocab_start + shard.vocab_per_rank]
    pad = shard.vocab_per_rank - rows.shape[0]
    return (torch.cat([rows, rows.new_zeros(pad, *t.shape[1:])]) if pad else rows).contiguous()


def _slice(name: str, t: torch.Tensor, shard: TPShard, num_heads: int, num_kv_heads: int,
           head_dim: int) -> torch.Tensor:
    if name.endswith("qkv_proj.weight") or name.endswith("qkv_proj.bias"):
        parts = t.split([num_heads * head_dim, num_kv_heads * head_dim,
                         num_kv_heads * head_dim], dim=0)
        return torch.cat([part[output_rows(module, part.shape[0], shard, head_dim)]
                          for module, part in zip(("q_proj", "k_proj", "v_proj"), parts)])
    if name.endswith("gate_up_proj.weight") or name.endswith("gate_up_proj.bias"):
        gate, up = t.chunk(2, dim=0)
        rows = _part(gate.shape[0], shard)
        return torch.cat([gate[rows], up[rows]], dim=0)
    if name.endswith(("o_proj.weight", "down_proj.weight")):
        return t[:, _part(t.shape[1], shard)]
    if name.endswith(("o_proj.bias", "down_proj.bias")):
        return t if shard.rank == 0 else torch.zeros_like(t)
    if name in ("embed_tokens.weight", "lm_head.weight"):
        return shard_vocab_rows(t, shard)
    return t  # norms: every rank holds them whole


def output_rows(module: str, out_features: int, shard: TPShard, head_dim: int) -> slice:
    """This rank's output rows of a column-parallel module (its own heads for q, its KV
    heads for k and v, an equal part for gate and up)."""
    if module == "q_proj":
        step = shard.num_heads * head_dim
        return slice(shard.rank * step, (shard.rank + 1) * step)
    if module in ("k_proj", "v_proj"):
        start = shard.kv_head_start * head_dim
        return slice(start, start + shard.num_kv_heads * head_dim)
    return _part(out_features, shard)


def shard_lora(module: str, lora_a: torch.Tensor, lora_b: torch.Tensor, shard: TPShard,
               head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's part of one PEFT module's A [r, in] and B [out, r], sliced as its base
    layer is (vLLM's LoRA layers do the same): a column-parallel module keeps its output rows
    of B and all of A; a row-parallel one (o, down) its input columns of A and all of B, so
    its delta is a partial sum that the layer's all-reduce completes."""
    if not shard.is_split:
        return lora_a, lora_b
    if module in ("o_proj", "down_proj"):
        return lora_a[:, _part(lora_a.shape[1], shard)], lora_b
    return lora_a, lora_b[output_rows(module, lora_b.shape[0], shard, head_dim)]


def _part(n: int, shard: TPShard) -> slice:
    step = n // shard.size
    return slice(shard.rank * step, (shard.rank + 1) * step)
