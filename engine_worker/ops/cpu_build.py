"""Builds ``csrc/cpu`` once per machine and loads it as torch ops (``torch.ops.quire.*``).

The sources are compiled on first use with ``-march=native`` by torch's extension builder
(ninja and a C++ compiler), into the Quire cache directory; later loads take milliseconds.
Concurrent builds (several engines starting together) are serialised by torch's lock file.
Where the build cannot run (no compiler, no AVX-512) the reason is kept and callers use the
reference ops.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import os
import shutil
import sys
from pathlib import Path

import torch

from engine_worker.config import quire_cache_dir

logger = logging.getLogger(__name__)

CSRC_DIR = Path(__file__).resolve().parents[2] / "csrc" / "cpu"
SOURCES = ("paged_attention.cpp", "linear.cpp", "elementwise.cpp", "llama_block.cpp")
HEADERS = ("vec.h", "ops.h", "decode_bf16.h", "prefill_bf16.h")
CFLAGS = ("-O3", "-march=native", "-fopenmp", "-std=c++17")


def _build_dir() -> Path:
    digest = hashlib.sha256(torch.__version__.encode())
    for name in SOURCES + HEADERS:
        digest.update((CSRC_DIR / name).read_bytes())
    return quire_cache_dir() / "kernels" / f"cpu-{digest.hexdigest()[:12]}"


@contextlib.contextmanager
def _ninja_on_path():
    """torch's builder runs ``ninja`` from PATH; the ``ninja`` wheel puts it beside this
    interpreter, which a venv's python run without activation does not have on PATH."""
    here = str(Path(sys.executable).parent)
    if shutil.which("ninja") or not shutil.which("ninja", path=here):
        yield
        return
    saved = os.environ.get("PATH", "")
    os.environ["PATH"] = here + os.pathsep + saved
    try:
        yield
    finally:
        os.environ["PATH"] = saved


@functools.cache
def cpu_ops_unavailable_reason() -> str | None:
    """None once ``torch.ops.quire`` holds the CPU kernels; otherwise why it does not."""
    if not all((CSRC_DIR / name).is_file() for name in SOURCES + HEADERS):
        return f"kernel sources not found in {CSRC_DIR} (installed without csrc/)"
    try:
        from torch.utils.cpp_extension import load

        build_dir = _build_dir()
        build_dir.mkdir(parents=True, exist_ok=True)
        with _ninja_on_path():
            load(name="quire_cpu_ops", sources=[str(CSRC_DIR / s) for s in SOURCES],
                 extra_cflags=list(CFLAGS), extra_ldflags=["-fopenmp"],
                 build_directory=str(build_dir), is_python_module=False, verbose=False)
    except Exception as exc:  # a compiler error, no ninja, no AVX-512: fall back, say why
        return f"building csrc/cpu failed: {str(exc).strip().splitlines()[-1][:300]}"
    return None


def load_cpu_ops() -> bool:
    """Build (first time) and load the CPU kernels; False, with a warning, if they cannot be."""
    reason = cpu_ops_unavailable_reason()
    if reason is not None:
        logger.warning("CPU kernels unavailable, using the PyTorch reference ops: %s", reason)
    return reason is None
