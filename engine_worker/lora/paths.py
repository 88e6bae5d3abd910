"""Where adapters loaded at run time may come from: inside the configured directories only.

A load request names a path on the engine's filesystem; resolving it (symlinks and ``..``
included) before the check keeps a caller from reading any directory the engine can.
"""

from __future__ import annotations

import os
from pathlib import Path

from quire.errors import FieldError


def parse_adapter_dirs(spec: str | None) -> tuple[Path, ...]:
    """``a,b`` (or with the OS path separator) -> resolved directories."""
    if not spec:
        return ()
    parts = [p for chunk in spec.split(",") for p in chunk.split(os.pathsep) if p.strip()]
    return tuple(Path(p.strip()).resolve() for p in parts)


def check_adapter_path(path: str, allowed: tuple[Path, ...]) -> str:
    """The resolved path, if inside one of ``allowed``; else a FieldError naming lora_path."""
    if not allowed:
        raise FieldError("lora_path", "loading adapters at run time is off on this engine "
                         "(start it with --lora-adapter-dirs DIR[,DIR...])")
    if "\x00" in path:
        raise FieldError("lora_path", "must not contain a NUL character")
    resolved = Path(path).resolve()
    if not any(resolved == d or d in resolved.parents for d in allowed):
        raise FieldError("lora_path", f"{path!r} is outside the adapter directories "
                         f"({', '.join(str(d) for d in allowed)})")
    return str(resolved)
