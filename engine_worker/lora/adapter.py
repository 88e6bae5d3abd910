"""A PEFT LoRA directory read into per-module A/B tensors, checked against the model.

PEFT computes ``y = W x + scaling * B (A x)`` with ``scaling = lora_alpha / r``
(``lora_alpha / sqrt(r)`` under ``use_rslora``); ``rank_pattern`` / ``alpha_pattern`` override
r and alpha per module, matched as PEFT matches them. Everything that cannot be served is
refused here, at load, with a ``FieldError`` naming ``lora_path`` (or ``max_lora_rank``): a
rank above the engine's limit, a module the model lacks, a shape that does not fit, DoRA,
trained biases, extra saved modules, or a file safetensors cannot read.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from quire.errors import FieldError, NotFoundError

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_ATTENTION_MODULES = frozenset({"q_proj", "k_proj", "v_proj", "o_proj"})
_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.\w+)?"
                  r"\.weight$")


@dataclass(frozen=True, slots=True)
class LoRAModelSpec:
    """What a model offers adapters: its layer count and, per PEFT module name (``q_proj``,
    ``gate_proj``...), the (in_features, out_features) of that projection."""

    num_layers: int
    modules: dict[str, tuple[int, int]]


@dataclass(frozen=True, slots=True)
class LoRAModule:
    lora_a: torch.Tensor  # [r, in_features] fp32
    lora_b: torch.Tensor  # [out_features, r] fp32
    scaling: float


@dataclass(frozen=True, slots=True)
class LoRAAdapter:
    """One loaded adapter (in host memory): ``modules[(layer, module_name)]``."""

    name: str
    path: str
    rank: int  # the largest rank of its modules
    modules: dict[tuple[int, str], LoRAModule]


def _pattern_value(pattern: dict, module_key: str, default):
    # PEFT: a key matches a module whose dotted name ends with it
    for key, value in (pattern or {}).items():
        if re.match(rf"(.*\.)?({key})$", module_key):
            return value
    return default


def _read_config(directory: Path) -> dict:
    try:
        config = json.loads((directory / CONFIG_FILE).read_text())
    except FileNotFoundError:
        raise FieldError("lora_path", f"{directory}: no {CONFIG_FILE} (not a PEFT adapter "
                         f"directory)") from None
    except (OSError, ValueError) as e:
        raise FieldError("lora_path", f"{directory / CONFIG_FILE}: unreadable ({e})") from None
    if not isinstance(config, dict):
        raise FieldError("lora_path", f"{directory / CONFIG_FILE}: not a JSON object")
    kind = str(config.get("peft_type", "LORA")).upper()
    refusals = {
        kind != "LORA": f"peft_type {kind!r} (only LORA is served)",
        bool(config.get("use_dora")): "use_dora (DoRA is not served)",
        config.get("bias", "none") != "none": f"bias {config.get('bias')!r} (only 'none')",
        bool(config.get("modules_to_save")): "modules_to_save (only LoRA deltas are served)",
        bool(config.get("fan_in_fan_out")): "fan_in_fan_out (Conv1D layouts)",
    }
    for refused, why in refusals.items():
        if refused:
            raise FieldError("lora_path", f"{directory}: {why}")
    return config


def _read_tensors(directory: Path) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = directory / WEIGHTS_FILE
    if not path.is_file():
        raise FieldError("lora_path", f"{directory}: no {WEIGHTS_FILE}")
    try:
        return load_file(str(path))
    except (SafetensorError, OSError, ValueError, RuntimeError) as e:
        raise FieldError("lora_path", f"{path}: not a readable safetensors file ({e})") from None


def load_adapter(name: str, path: str, spec: LoRAModelSpec, max_lora_rank: int
                 ) -> LoRAAdapter:
    """Read and check the PEFT adapter at ``path`` for a model described by ``spec``."""
    directory = Path(path)
    if not directory.is_dir():
        # NOT_FOUND: the router's on-demand load tells "no such adapter" from a bad one
        raise NotFoundError("lora_path", f"{path}: no such directory")
    config = _read_config(directory)
    targets = config.get("target_modules")
    if isinstance(targets, list):
        lacking = sorted(set(targets) - set(spec.modules))
        if lacking:
            raise FieldError("lora_path", f"{path}: target module(s) {lacking} not in this "
                             f"model (it has {sorted(spec.modules)})")
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in _read_tensors(directory).items():
        match = _KEY.search(key)
        if match is None or match.group(2) not in spec.modules:
            raise FieldError("lora_path", f"{path}: tensor {key!r} is not a LoRA weight of a "
                             f"module this model has ({sorted(spec.modules)})")
        layer, module = int(match.group(1)), match.group(2)
        if layer >= spec.num_layers:
            raise FieldError("lora_path", f"{path}: {key!r} is for layer {layer}, the model "
                             f"has {spec.num_layers}")
        pairs.setdefault((layer, module), {})[match.group(3)] = tensor
    if not pairs:
        raise FieldError("lora_path", f"{path}: {WEIGHTS_FILE} holds no LoRA weights")
    modules = {k: _module(path, k, v, spec, config, max_lora_rank) for k, v in pairs.items()}
    return LoRAAdapter(name=name, path=str(path), modules=modules,
                       rank=max(m.lora_a.shape[0] for m in modules.values()))


def _module(path: str, key: tuple[int, str], ab: dict[str, torch.Tensor], spec: LoRAModelSpec,
            config: dict, max_lora_rank: int) -> LoRAModule:
    layer, module = key
    where = f"layers.{layer}.{module}"
    if set(ab) != {"A", "B"}:
        raise FieldError("lora_path", f"{path}: {where} has lora_{''.join(ab)} only")
    a, b = ab["A"], ab["B"]
    in_features, out_features = spec.modules[module]
    rank = a.shape[0] if a.dim() == 2 else -1
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != in_features or \
            b.shape != (out_features, rank):
        raise FieldError("lora_path", f"{path}: {where}: lora_A {tuple(a.shape)} / lora_B "
                         f"{tuple(b.shape)} do not fit a {in_features} -> {out_features} "
                         f"projection")
    if rank > max_lora_rank:
        raise FieldError("max_lora_rank", f"{path}: {where} has rank {rank}, above this "
                         f"engine's max_lora_rank={max_lora_rank}")
    if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
        raise FieldError("lora_path", f"{path}: {where} holds NaN or infinite values")
    block = "self_attn" if module in _ATTENTION_MODULES else "mlp"
    module_key = f"model.layers.{layer}.{block}.{module}"
    r = _pattern_value(config.get("rank_pattern"), module_key, config.get("r", rank))
    alpha = _pattern_value(config.get("alpha_pattern"), module_key,
                           config.get("lora_alpha", r))
    if r != rank:
        raise FieldError("lora_path", f"{path}: {where} has rank {rank}, its config says {r}")
    scaling = alpha / (math.sqrt(r) if config.get("use_rslora") else r)
    return LoRAModule(a.float().contiguous(), b.float().contiguous(), float(scaling))
