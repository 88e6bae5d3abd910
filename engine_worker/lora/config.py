"""``LoRAConfig``: vLLM's LoRA engine arguments, validated (``ValueError`` naming the field)."""

from __future__ import annotations

from dataclasses import dataclass


def parse_lora_modules(spec) -> tuple[tuple[str, str], ...]:
    """vLLM's ``--lora-modules name=path ...``: a list of ``name=path`` strings (or one
    string of them separated by spaces or commas, as an environment variable gives it), or
    a ``{name: path}`` dict -> ((name, path), ...)."""
    if spec is None or spec == "" or spec == ():
        return ()
    if isinstance(spec, dict):
        items = [f"{k}={v}" for k, v in spec.items()]
    else:  # each string may hold several, as one flag value or variable holds them
        items = [part for item in ([spec] if isinstance(spec, str) else spec)
                 for part in ([item] if isinstance(item, (tuple, list))
                              else str(item).replace(",", " ").split())]
    pairs: list[tuple[str, str]] = []
    for item in items:
        if isinstance(item, (tuple, list)) and len(item) == 2:
            name, path = item
        else:
            name, sep, path = str(item).partition("=")
            if not sep or not name or not path:
                raise ValueError(f"lora_modules: expected name=path, got {item!r}")
        if any(name == n for n, _ in pairs):
            raise ValueError(f"lora_modules: the name {name!r} is given twice")
        pairs.append((str(name), str(path)))
    return tuple(pairs)


@dataclass(frozen=True, slots=True)
class LoRAConfig:
    """``max_loras``: adapters usable in one step (device slots); ``max_cpu_loras``:
    adapters kept loaded in host memory (LRU, at least ``max_loras``); ``max_lora_rank``:
    the largest rank accepted; ``lora_modules``: (name, path) loaded at start."""

    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    lora_modules: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        for name in ("max_loras", "max_lora_rank"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name}: must be a positive integer, got {value!r}")
        if self.max_cpu_loras is None:
            object.__setattr__(self, "max_cpu_loras", self.max_loras)
        elif not isinstance(self.max_cpu_loras, int) or self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras: must be an integer >= max_loras "
                             f"({self.max_loras}), got {self.max_cpu_loras!r}")
        object.__setattr__(self, "lora_modules", parse_lora_modules(self.lora_modules))
