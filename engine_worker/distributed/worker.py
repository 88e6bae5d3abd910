"""A tensor-parallel worker process (ranks 1 .. tp-1): load this rank's slice of the model,
allocate its slice of the KV cache, then run every step rank 0 broadcasts until told to stop.

The worker runs the same ``ModelRunner`` as rank 0 on the same ``SchedulerOutput``: the
collectives inside the model line up because every rank runs the same code on the same plain
data, and the sampling after the all-gathered logits draws the same tokens on every rank (same
logits, same seeds), so each rank's request state follows rank 0's without another message.
Only rank 0's results leave the engine.

It dies with its engine: a thread waits on a pipe whose only writer is the engine process, so
the pipe's end (the engine exited, or was killed with SIGKILL) ends the worker at once.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

import torch

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class WorkerSpec:
    """What rank 0 decided at start that a worker must build the same way (sent at spawn)."""

    rank: int
    world_size: int  # tensor_parallel_size x pipeline_parallel_size
    tensor_parallel_size: int
    store_port: int
    model_dir: Path
    gguf: Path | None  # the GGUF file whose blocks run natively (None: model_dir's weights)
    strict_quantization: bool
    int4_native: bool  # an AWQ / GPTQ checkpoint's layers run in the backend's int4 layout
    pipeline_micro_batch_tokens: int  # ParallelConfig's
    lora: object  # the engine's LoRAConfig (None: LoRA is off)
    dtype: torch.dtype
    device: str  # "cpu", or "cuda" (the worker takes cuda:<rank>)
    kernels: str  # the backend rank 0 resolved (never "auto", so every rank runs the same)
    attention_backend: str
    max_model_len: int
    num_threads: int
    log_level: int


@dataclass(frozen=True, slots=True)
class WorkerStart:
    """Sent once rank 0 has sized the KV cache: what the runner needs beyond the model."""

    num_blocks: int
    block_size: int
    eos_token_ids: frozenset[int]
    seed: int
    pooler_config: object  # the engine's resolved PoolerConfig
    kv_cache_prefault: bool = False  # fault the cache in as rank 0 does (kv_cache/prefault.py)


def alive_key(rank: int) -> str:
    """The store key a worker sets once it runs (imports done, store reached)."""
    return f"alive/{rank}"


def worker_device(device: str, rank: int) -> torch.device:
    return torch.device(f"cuda:{rank}") if device == "cuda" else torch.device(device)


def run_worker(spec: WorkerSpec, parent: object) -> None:
    """The worker process's entry point (multiprocessing spawn)."""
    threading.Thread(target=_exit_with_parent, args=(parent,), name="parent-watch",
                     daemon=True).start()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the engine; it stops us
    logging.basicConfig(level=spec.log_level, stream=sys.stderr,
                        format=f"%(asctime)s %(levelname)s [tp rank {spec.rank}] %(message)s")
    try:
        _serve(spec)
    except BaseException:
        logger.exception("tensor-parallel worker rank %d failed", spec.rank)
        sys.stderr.flush()
        os._exit(1)
    os._exit(0)


def _exit_with_parent(parent) -> None:
    try:
        parent.recv()  # the engine never sends: this returns only at the pipe's end
    except (EOFError, OSError):
        pass
    os._exit(0)


def _serve(spec: WorkerSpec) -> None:
    # imported here: the spawned interpreter pays for torch and the engine only once it runs
    from engine_worker.backends import select_backend
    from engine_worker.distributed.comm import make_comm, make_store
    from engine_worker.lora.manager import LoRAManager, LoRARegistry
    from engine_worker.model_runner.runner import ModelRunner
    from engine_worker.platform import allocate_zeroed, keep_freed_memory
    from engine_worker.pooler import Pooler
    from engine_worker.weights.loader import load_model

    keep_freed_memory()  # as rank 0 (a warning of its own where it cannot)
    torch.set_num_threads(spec.num_threads)
    device = worker_device(spec.device, spec.rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    parent_pid = os.getppid()
    store = make_store(spec.rank, spec.world_size, spec.store_port)
    store.set(alive_key(spec.rank), b"1")  # rank 0 waits for this before joining the groups
    comm = make_comm(store, spec.rank, spec.world_size, device,
                     failed=lambda: None if os.getppid() == parent_pid else "the engine exited",
                     tensor_parallel_size=spec.tensor_parallel_size)
    backend = select_backend(spec.kernels, device, spec.attention_backend)
    loaded = load_model(spec.model_dir, dtype=spec.dtype, device=device,
                        backend=backend.backend, max_model_len=spec.max_model_len, comm=comm,
                        gguf=spec.gguf, strict_quantization=spec.strict_quantization,
                        int4_native=spec.int4_native,
                        micro_batch_tokens=spec.pipeline_micro_batch_tokens)
    model = loaded.model
    lora = None if spec.lora is None else LoRAManager.for_model(
        model, spec.lora, backend.name, spec.dtype, device)
    start: WorkerStart = comm.broadcast_object()
    kv_caches = [allocate_zeroed(shape, spec.dtype, device)
                 for shape in model.kv_cache_shapes(start.num_blocks, start.block_size)]
    if start.kv_cache_prefault and device.type == "cpu":
        from engine_worker.kv_cache.prefault import prefault_kv_cache
        prefault_kv_cache(kv_caches, spec.num_threads)
    runner = ModelRunner(model, kv_caches, start.block_size, device, model.cfg.vocab_size,
                         start.eos_token_ids, start.seed, pooler=Pooler(start.pooler_config),
                         lora=lora, sampling_kernels=backend.backend.sampling)
    comm.barrier()  # every rank ready: rank 0 may announce and serve
    while True:
        step = comm.broadcast_object()
        if step is None:  # rank 0 is shutting down
            return
        if isinstance(step, LoRARegistry):  # rank 0's adapters changed: before a step
            lora.sync(step)
            continue
        runner.execute(step)
