"""Writing a benchmark's report: shared by the engine's and the router's benchmarks (torch-free)."""

from __future__ import annotations

import json
from pathlib import Path


def write_json(report: dict, path: str | Path) -> Path:
    """The report as indented JSON at ``path``, its directory made first; returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2) + "\n")
    return path
