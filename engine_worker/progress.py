"""What an engine says while it starts: a progress line for each step a user waits on (model
conversion, kernel build, weight loading and packing, KV cache allocation), logged at INFO
when the step starts, every ``heartbeat_s`` while it runs and with its time when it ends; and
once, at the end, the summary of the choices made (``start_summary``)."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from engine_worker.backends import BackendChoice

HEARTBEAT_S = 15.0


@contextlib.contextmanager
def progress(logger: logging.Logger, what: str, *, expect: str = "",
             heartbeat_s: float = HEARTBEAT_S) -> Iterator[None]:
    """``with progress(logger, "Converting the model", expect="about 2 min, first start
    only"):`` logs ``Converting the model (about 2 min, first start only)...``, then
    ``Converting the model: still running, 15 s`` while it runs, and ``... done in 31.2 s``."""
    logger.info("%s%s...", what, f" ({expect})" if expect else "")
    start = time.monotonic()
    done = threading.Event()

    def beat() -> None:
        while not done.wait(heartbeat_s):
            logger.info("%s: still running, %.0f s", what, time.monotonic() - start)

    ticker = threading.Thread(target=beat, name="progress", daemon=True)
    ticker.start()
    try:
        yield
    finally:
        done.set()
        ticker.join()
    logger.info("%s: done in %.1f s", what, time.monotonic() - start)


def start_summary(*, model: str, device: torch.device, dtype: torch.dtype, num_threads: int,
                  backend: BackendChoice, cuda_graphs: str, num_blocks: int, block_size: int,
                  block_bytes: int, max_model_len: int, elapsed_s: float,
                  memory: str | None = None) -> str:
    """The choices an engine made, as the short block it logs once at start. ``memory``: how
    the device's memory was shared out, where the KV cache was sized from a profile."""
    capacity = num_blocks * block_size
    threads = f", {num_threads} threads" if device.type == "cpu" else ""
    lines = [
        f"Engine ready in {elapsed_s:.1f} s: {model}",
        f"  Device: {device}{threads}, dtype {str(dtype).removeprefix('torch.')}",
        f"  Backend: {backend.describe()}",
        f"  CUDA graphs: {cuda_graphs}",
        f"  KV cache: {num_blocks} blocks x {block_size} tokens = {capacity} tokens, "
        f"{num_blocks * block_bytes / 2**30:.2f} GiB ({block_bytes // block_size} bytes a token)",
    ]
    if memory is not None:
        lines.append(f"  Memory: {memory}")
    lines.append(f"  Max model len: {max_model_len} tokens ({capacity / max_model_len:.2f} "
                 "full-length sequences fit at once)")
    return "\n".join(lines)
