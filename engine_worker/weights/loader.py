"""Build a model from a local Hugging Face directory: config.json plus safetensors, or
config.json beside a GGUF file whose tensors are read natively (``weights.gguf_weights``).

Checkpoint quirks live here: Hugging Face names (``model.layers.N.self_attn.q_proj``...) are
mapped onto our module tree, and separate Q/K/V and gate/up projections are fused on load.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

from engine_worker.backends.base import Backend
from engine_worker.distributed.shard import (MIN_MICRO_BATCH_TOKENS, PPStage, TPShard,
                                             shard_llama_state, shard_vocab_rows)
from engine_worker.weights.gguf_weights import dequantize_blocks, read_gguf_state
from engine_worker.weights.int4_checkpoint import Int4Config, int4_layers, parse_int4_config
from engine_worker.weights.int4_layouts import int4_layout, pack_layers
from engine_worker.models.registry import lookup_architecture
from engine_worker.progress import progress

logger = logging.getLogger(__name__)

# Our parameter -> the checkpoint tensors concatenated (along dim 0) to form it.
_FUSED = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
}
_IGNORED = re.compile(r"rotary_emb\.inv_freq$")


@dataclass(frozen=True, slots=True)
class LoadedModel:
    model: nn.Module
    architecture: str
    hf_config: dict[str, Any]
    max_model_len: int
    weights_summary: str = ""  # a GGUF's tensor types / an AWQ or GPTQ config, as loaded


def read_hf_config(model_dir: Path) -> dict[str, Any]:
    with open(model_dir / "config.json") as f:
        return json.load(f)


def derive_max_model_len(hf_config: dict[str, Any], requested: int | None) -> int:
    """The longest sequence this model can hold: the checkpoint's limit unless asked lower."""
    limit = int(hf_config.get("max_position_embeddings") or 2048)
    window = hf_config.get("sliding_window")
    if window and hf_config.get("use_sliding_window", True):
        limit = min(limit, int(window))  # full attention is exact only inside the window
    if requested is None:
        return limit
    if requested > limit:
        raise ValueError(f"max_model_len: {requested} exceeds the model's limit of {limit}")
    return requested


def load_model(model_dir: Path, *, dtype: torch.dtype, device: torch.device, backend: Backend,
               max_model_len: int | None, gguf: Path | None = None,
               strict_quantization: bool = False, comm: Any = None,
               int4_native: bool = False,
               micro_batch_tokens: int = MIN_MICRO_BATCH_TOKENS) -> LoadedModel:
    """Build the model on the meta device, load the checkpoint into it (cast to ``dtype`` on
    ``device``), then let ``backend`` pack the weights its way. With ``gguf``, the weights come
    from that file, the block types ``backend`` multiplies natively kept as blocks
    (``strict_quantization``: another block type in a linear layer is an error, not widened).
    ``comm`` (a ``distributed.comm.ParallelComm``): load this rank's tensor-parallel slice of
    its pipeline stage's layers, cut from the full checkpoint, into a model whose layers
    reduce, gather and pass hidden states over it.
    An AWQ / GPTQ checkpoint's layers are repacked into the layout ``backend`` multiplies
    (``int4_native``) or de-quantized to ``dtype``."""
    hf_config = read_hf_config(model_dir)
    arch_name, arch = lookup_architecture(hf_config)
    cfg = arch.parse_config(hf_config)
    max_len = derive_max_model_len(hf_config, max_model_len)
    shard = stage = None
    if comm is not None:
        shard = TPShard.of(comm.tp.rank, comm.tp.world_size, num_heads=cfg.num_heads,
                           num_kv_heads=cfg.num_kv_heads,
                           intermediate_size=cfg.intermediate_size, vocab_size=cfg.vocab_size)
        stage = PPStage.of(comm.stage, comm.num_stages, cfg.num_layers, micro_batch_tokens)
    with torch.device("meta"):
        model = arch.model_cls(cfg, backend, max_len, device, shard=shard, comm=comm,
                               stage=stage)
    summary, tied_logits = "", None
    if gguf is not None:
        with progress(logger, f"Loading weights from {gguf.name} (native GGUF blocks)"):
            gstate = read_gguf_state(gguf, dtype=dtype, native_types=backend.quantized_types,
                                     strict=strict_quantization, num_heads=cfg.num_heads,
                                     num_kv_heads=cfg.num_kv_heads)
            state = _fused_state(gstate.tensors, dtype=dtype, device=device)
        summary = gstate.summary()
        if getattr(cfg, "tie_word_embeddings", False):
            tied_logits = gstate.tied_logits  # the logits stream blocks too, if any
    else:
        int4 = parse_int4_config(hf_config)
        layout = int4_layout(backend.quantized_types) if int4_native else None
        with progress(logger, f"Loading weights from {model_dir.name}"):
            state = _read_state_dict(model_dir, dtype=dtype, device=device, int4=int4,
                                     int4_layout=layout)
        if int4 is not None:
            summary = f"{int4.describe()}, " + (f"as {layout}" if layout else "de-quantized")
    if shard is not None:  # packed quantized weights slice as floats do
        state = shard_llama_state(state, shard=shard, num_heads=cfg.num_heads,
                                  num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim)
        if tied_logits is not None:
            tied_logits = shard_vocab_rows(tied_logits, shard)
    _assign_blocks(model, state)
    if tied_logits is not None:
        model.tied_logits_weight = tied_logits
    expected = set(model.state_dict())
    if stage is not None:  # other stages' layers: theirs to load
        state = {k: v for k, v in state.items()
                 if k in expected or not k.startswith("layers.")}
    missing = expected - state.keys()
    unexpected = state.keys() - expected
    if missing:
        raise ValueError(f"model: checkpoint in {model_dir} lacks tensors {sorted(missing)[:5]}")
    if unexpected:
        logger.warning("ignoring unexpected checkpoint tensors: %s", sorted(unexpected)[:5])
        state = {k: v for k, v in state.items() if k in expected}
    model.load_state_dict(state, strict=True, assign=True)
    model.requires_grad_(False)
    model.eval()
    with progress(logger, f"Packing weights for the {backend.name} backend"):
        model.pack_weights()
    return LoadedModel(model=model, architecture=arch_name, hf_config=hf_config,
                       max_model_len=max_len, weights_summary=summary)


def _assign_blocks(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Block-quantized weights (uint8 [N, K / 32, bytes], or an int4 layout's int32) replace
    their float parameters first, so that ``load_state_dict`` finds the shapes equal and
    assigns them as they are."""
    for name, tensor in state.items():
        if _is_packed(tensor):
            module_name, _, param = name.rpartition(".")
            setattr(model.get_submodule(module_name), param,
                    nn.Parameter(tensor, requires_grad=False))


def _is_packed(tensor: torch.Tensor) -> bool:
    """Quantized weights kept as packed (never cast): GGUF blocks, the int4 group layout."""
    return tensor.dtype in (torch.uint8, torch.int32) and tensor.dim() == 3


def _read_state_dict(model_dir: Path, *, dtype: torch.dtype, device: torch.device,
                     int4: Int4Config | None = None,
                     int4_layout: str | None = None) -> dict[str, torch.Tensor]:
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ValueError(f"model: no *.safetensors files in {model_dir}")
    raw: dict[str, torch.Tensor] = {}
    for i, path in enumerate(files, 1):
        if len(files) > 1:
            logger.info("Reading %s (file %d of %d)", path.name, i, len(files))
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                if not _IGNORED.search(name):
                    raw[name.removeprefix("model.")] = f.get_tensor(name)
    if int4 is not None:  # AWQ / GPTQ: each layer's packed tensors become its weight
        raw.update(pack_layers(int4_layers(raw, int4), int4_layout, dtype))
    return _fused_state(raw, dtype=dtype, device=device)


def _fused_state(raw: dict[str, torch.Tensor], *, dtype: torch.dtype,
                 device: torch.device) -> dict[str, torch.Tensor]:
    """Q/K/V and gate/up fused; float tensors cast to ``dtype``, block-quantized ones kept."""
    state: dict[str, torch.Tensor] = {}
    for name in list(raw):
        if name not in raw:
            continue  # consumed by a fusion
        fused = _fuse(name, raw, dtype)
        target, tensor = fused if fused else (name, raw.pop(name))
        if not _is_packed(tensor):
            tensor = tensor.to(dtype=dtype)
        state[target] = tensor.to(device=device).contiguous()
    return state


def _cat_rows(parts: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """Parts stacked along the output rows: blocks of one type as blocks, else as values (a
    mix of types, as GGUF's Q4_K_M gives V another type than Q and K, is de-quantized)."""
    if all(_is_packed(p) and p.dtype == parts[0].dtype for p in parts) \
            and len({p.shape[1:] for p in parts}) == 1:
        return torch.cat(parts, dim=0)
    return torch.cat([dequantize_blocks(p, dtype) if p.dtype == torch.uint8 else p.to(dtype)
                      for p in parts], dim=0)


def _fuse(name: str, raw: dict[str, torch.Tensor],
          dtype: torch.dtype) -> tuple[str, torch.Tensor] | None:
    for target, parts in _FUSED.items():
        for part in parts:
            marker = f".{part}."
            if marker not in name:
                continue
            prefix, suffix = name.split(marker)
            names = [f"{prefix}.{p}.{suffix}" for p in parts]
            if not all(n in raw for n in names):
                raise ValueError(f"model: checkpoint has {name} but not all of {names}")
            return f"{prefix}.{target}.{suffix}", _cat_rows([raw.pop(n) for n in names], dtype)
    return None
