"""Build a model from a local Hugging Face directory: config.json plus safetensors.

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
               max_model_len: int | None) -> LoadedModel:
    """Build the model on the meta device, load the checkpoint into it (cast to ``dtype`` on
    ``device``), then let ``backend`` pack the weights its way."""
    hf_config = read_hf_config(model_dir)
    arch_name, arch = lookup_architecture(hf_config)
    cfg = arch.parse_config(hf_config)
    max_len = derive_max_model_len(hf_config, max_model_len)
    with torch.device("meta"):
        model = arch.model_cls(cfg, backend, max_len, device)
    with progress(logger, f"Loading weights from {model_dir.name}"):
        state = _read_state_dict(model_dir, dtype=dtype, device=device)
    expected = set(model.state_dict())
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
                       max_model_len=max_len)


def _read_state_dict(model_dir: Path, *, dtype: torch.dtype,
                     device: torch.device) -> dict[str, torch.Tensor]:
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
    state: dict[str, torch.Tensor] = {}
    for name in list(raw):
        if name not in raw:
            continue  # consumed by a fusion
        fused = _fuse(name, raw)
        target, tensor = fused if fused else (name, raw.pop(name))
        state[target] = tensor.to(device=device, dtype=dtype).contiguous()
    return state


def _fuse(name: str, raw: dict[str, torch.Tensor]) -> tuple[str, torch.Tensor] | None:
    for target, parts in _FUSED.items():
        for part in parts:
            marker = f".{part}."
            if marker not in name:
                continue
            prefix, suffix = name.split(marker)
            names = [f"{prefix}.{p}.{suffix}" for p in parts]
            if not all(n in raw for n in names):
                raise ValueError(f"model: checkpoint has {name} but not all of {names}")
            return f"{prefix}.{target}.{suffix}", torch.cat([raw.pop(n) for n in names], dim=0)
    return None
