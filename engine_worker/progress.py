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

if TYPE_CHECKING:
    from engine_worker.engine_info import EngineInfo

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


LAYER_EXECUTION = {
    "fused": "fused (every decoder layer in one backend call a step)",
    "per-layer": "per-layer (one Python call per op: the backend fuses none of this model's "
                 "stack here, slower on a CPU)",
}


def start_summary(info: EngineInfo, *, elapsed_s: float) -> str:
    """The choices an engine made, as the short block it logs once at start; a ``Memory``
    line where the KV cache was sized from a profile of the device's memory."""
    capacity = info.kv_capacity_tokens
    threads = f", {info.num_threads} threads" if info.device.type == "cpu" else ""
    lines = [
        f"Engine ready in {elapsed_s:.1f} s: {info.model_dir.name} ({info.architecture})",
        f"  Device: {info.device}{threads}, dtype {str(info.dtype).removeprefix('torch.')}",
        f"  Backend: {info.backend_summary}",
        f"  Layers: {LAYER_EXECUTION.get(info.layer_execution, info.layer_execution)}",
        f"  CUDA graphs: {info.cuda_graphs}",
        f"  KV cache: {info.num_kv_blocks} blocks x {info.block_size} tokens = {capacity} "
        f"tokens, {info.kv_cache_bytes / 2**30:.2f} GiB "
        f"({info.kv_block_bytes // info.block_size} bytes a token)",
    ]
    if info.quantization != "none":  # a quantized checkpoint: how its weights run
        lines.insert(3, f"  Quantization: {info.quantization_summary}")
    if info.memory is not None:
        lines.append(f"  Memory: {info.memory}")
    if info.host_malloc:
        lines.append(f"  Host malloc: {info.host_malloc}")
    if info.kv_cache_pages:
        lines.append(f"  KV cache pages: {info.kv_cache_pages}")
    if info.tensor_parallel_size * info.pipeline_parallel_size > 1:
        lines.append(f"  Parallel: tensor_parallel_size={info.tensor_parallel_size} x "
                     f"pipeline_parallel_size={info.pipeline_parallel_size} "
                     f"({info.distributed_executor_backend}: this process is rank 0, workers "
                     f"pids {', '.join(map(str, info.worker_pids))}), all-reduce "
                     f"{info.all_reduce_backend}; KV cache and attention split by KV head")
    if info.speculative_config:
        lines.append(f"  Speculative decoding: {info.speculative_config}")
    lines.append(f"  Max model len: {info.max_model_len} tokens "
                 f"({capacity / info.max_model_len:.2f} full-length sequences fit at once)")
    return "\n".join(lines)
