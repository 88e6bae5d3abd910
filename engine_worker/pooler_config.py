"""The engines' pooling settings, torch-free (the CLI builds its flags from them): vLLM's
``--runner`` and ``--pooler-config``. How vectors are computed is ``engine_worker.pooler``."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

POOLING_TYPES = ("LAST", "MEAN", "CLS")  # vLLM's pooling_type names; engine_worker.pooler
RUNNERS = ("generate", "pooling")  # vLLM's --runner names


@dataclass(frozen=True, slots=True)
class PoolerConfig:
    """vLLM's ``--pooler-config``: ``{"pooling_type": "LAST" | "MEAN" | "CLS", "normalize":
    true | false}``. Either may be left out: the model's own (sentence-transformers) config,
    else LAST and normalized, as vLLM does for decoder embedding models."""

    pooling_type: str | None = None
    normalize: bool | None = None

    def __post_init__(self) -> None:
        if self.pooling_type is not None:
            name = str(self.pooling_type).upper()
            if name not in POOLING_TYPES:
                raise ValueError(f"pooler_config.pooling_type: must be one of "
                                 f"{list(POOLING_TYPES)}, got {self.pooling_type!r}")
            object.__setattr__(self, "pooling_type", name)
        if self.normalize is not None and not isinstance(self.normalize, bool):
            raise ValueError(f"pooler_config.normalize: must be a boolean, got "
                             f"{self.normalize!r}")

    @classmethod
    def parse(cls, value) -> PoolerConfig:
        """From a ``PoolerConfig``, a dict, a JSON object text or None."""
        if isinstance(value, PoolerConfig):
            return value
        if value is None or value == "":
            return cls()
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"pooler_config: not valid JSON ({e})") from None
        if not isinstance(value, dict):
            raise ValueError("pooler_config: must be a JSON object")
        unknown = sorted(set(value) - {"pooling_type", "normalize"})
        if unknown:
            raise ValueError(f"pooler_config.{unknown[0]}: unknown field (known: "
                             f"pooling_type, normalize)")
        return cls(**value)

    def resolved(self, model_dir: Path) -> PoolerConfig:
        """Every field set: what was given, else the model's config, else LAST, normalized."""
        default = model_pooler_config(model_dir)
        return PoolerConfig(
            pooling_type=self.pooling_type or default.pooling_type or "LAST",
            normalize=self.normalize if self.normalize is not None else
            (default.normalize if default.normalize is not None else True))


def model_pooler_config(model_dir: Path) -> PoolerConfig:
    """What a sentence-transformers model directory says: its Pooling module's mode
    (``1_Pooling/config.json``) and whether a Normalize module follows. Empty otherwise."""
    modules_file = Path(model_dir) / "modules.json"
    if not modules_file.is_file():
        return PoolerConfig()
    try:
        modules = json.loads(modules_file.read_text())
    except (OSError, json.JSONDecodeError):
        return PoolerConfig()
    pooling_type = None
    normalize = any(str(m.get("type", "")).endswith("Normalize") for m in modules)
    for module in modules:
        if str(module.get("type", "")).endswith("Pooling"):
            config_file = Path(model_dir) / module.get("path", "") / "config.json"
            try:
                config = json.loads(config_file.read_text())
            except (OSError, json.JSONDecodeError):
                continue
            for key, name in (("pooling_mode_lasttoken", "LAST"),
                              ("pooling_mode_mean_tokens", "MEAN"),
                              ("pooling_mode_cls_token", "CLS")):
                if config.get(key):
                    pooling_type = name
                    break
    return PoolerConfig(pooling_type=pooling_type, normalize=normalize)
