"""Rank 0's side of tensor parallelism (``distributed_executor_backend="mp"``): start one
worker process per other rank, join them in a process group, send each step, watch them.

The engine core (scheduler, sampling, detokenizing) stays in the engine's process, which is
rank 0 and runs shard 0 itself. Each step's ``SchedulerOutput`` (plain data: the step types are
the contract) is broadcast before rank 0 runs it. A worker that exits makes the engine fail
loudly: ``on_failure`` is called with the reason at once, even while the engine idles, and a
step in flight fails on the broken collective instead of hanging.
"""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.connection
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import replace

from engine_worker.distributed.comm import JOIN_TIMEOUT, ParallelComm, make_comm, make_store
from engine_worker.distributed.worker import WorkerSpec, WorkerStart, alive_key, run_worker, \
    worker_device
from engine_worker.model_runner.runner import ModelRunner
from engine_worker.step_types import ModelRunnerOutput, SchedulerOutput

logger = logging.getLogger(__name__)

_STOP_TIMEOUT_S = 10.0


class MultiprocExecutor:
    """Starts ranks 1 .. world_size - 1 (tensor x pipeline) from ``spec`` (its rank and port
    are filled in) and joins them as rank 0; ``comm`` is rank 0's collectives, for its own
    shard."""

    def __init__(self, spec: WorkerSpec, on_failure: Callable[[str], None]) -> None:
        self._on_failure = on_failure
        self._stopping = threading.Event()
        self._failed = threading.Event()
        self.failure: str | None = None
        store = make_store(0, spec.world_size, 0)
        ctx = multiprocessing.get_context("spawn")
        self._procs: list[multiprocessing.process.BaseProcess] = []
        self._pipes = []  # the write ends: closing them (or our death) ends the workers
        for rank in range(1, spec.world_size):
            reader, writer = ctx.Pipe(duplex=False)
            proc = ctx.Process(target=run_worker, name=f"quire-tp-rank{rank}", daemon=True,
                               args=(replace(spec, rank=rank, store_port=store.port), reader))
            proc.start()
            reader.close()
            self._procs.append(proc)
            self._pipes.append(writer)
        self._finalizer = weakref.finalize(self, _stop_processes, self._procs, self._pipes)
        logger.info("Started %d tensor-parallel worker process%s (pids %s); joining them",
                    len(self._procs), "es" if len(self._procs) != 1 else "",
                    ", ".join(str(p.pid) for p in self._procs))
        self._watcher = threading.Thread(target=self._watch, name="tp-watch", daemon=True)
        self._watcher.start()
        self._await_workers(store, spec.world_size)
        self.comm: ParallelComm = make_comm(store, 0, spec.world_size,
                                            worker_device(spec.device, 0),
                                            failed=lambda: self.failure,
                                            tensor_parallel_size=spec.tensor_parallel_size)
        self._store = store
        self._lora_version = 0  # the version of rank 0's adapters the workers have

    def _await_workers(self, store, world_size: int) -> None:
        """Until every worker runs: joining a gloo group waits for its peers without limit
        (the groups' timeout is the engine's idle time), so a worker that dies before it
        joins must stop the start here, named, instead of hanging it."""
        keys = [alive_key(rank) for rank in range(1, world_size)]
        deadline = time.monotonic() + JOIN_TIMEOUT.total_seconds()
        while not store.check(keys):
            if self.failure is not None:
                self.abandon()
                raise RuntimeError(f"{self.failure} before joining the engine (if a script "
                                   f"started it: a script that starts an engine with more "
                                   f"than one process must do so under `if __name__ == "
                                   f"'__main__':`, as the spawned workers import it again)")
            if time.monotonic() > deadline:
                self.abandon()
                raise RuntimeError(f"tensor-parallel workers did not start within "
                                   f"{JOIN_TIMEOUT.total_seconds():.0f} s")
            time.sleep(0.02)

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._procs]

    def start_workers(self, start: WorkerStart) -> None:
        """After rank 0 sized the KV cache: every worker allocates its slice and builds its
        runner; returns once all are ready."""
        self.comm.broadcast_object(start)
        self.comm.barrier()

    def execute(self, runner: ModelRunner, out: SchedulerOutput) -> ModelRunnerOutput:
        """One step on every rank; rank 0's output is the engine's."""
        if self.failure is not None:
            raise RuntimeError(self.failure)
        lora = runner.lora
        if lora is not None and lora.cache.version != self._lora_version:
            self.comm.broadcast_object(lora.registry())  # the workers' adapters follow ours
            self._lora_version = lora.cache.version
        self.comm.broadcast_object(out)
        return runner.execute(out)

    def _watch(self) -> None:
        """Wait for any worker to exit; unless we are stopping, that kills the engine."""
        sentinels = {p.sentinel: (rank, p) for rank, p in enumerate(self._procs, 1)}
        ready = multiprocessing.connection.wait(list(sentinels))
        if self._stopping.is_set():
            return
        rank, proc = sentinels[ready[0]]
        proc.join(timeout=1.0)
        self.failure = (f"tensor-parallel worker rank {rank} (pid {proc.pid}) exited with code "
                        f"{proc.exitcode}")
        self._failed.set()
        logger.error("%s; the engine stops serving", self.failure)
        self._on_failure(self.failure)

    def wait_for_failure(self, timeout_s: float) -> str | None:
        """After a step failed: which worker died, if one did within ``timeout_s``."""
        self._failed.wait(timeout_s)
        return self.failure

    def shutdown(self) -> None:
        """Tell the idle workers to stop, wait for them (kill any that do not)."""
        if self._stopping.is_set():
            return
        self._stopping.set()
        if self.failure is None:
            try:
                self.comm.broadcast_object(None)
            except Exception:  # a worker died meanwhile: the processes are stopped below
                pass
        self._finalizer()

    def abandon(self) -> None:
        """After a failed step: the workers may wait in a collective that will never
        complete, so no message can reach them; their pipes' end stops them."""
        self._stopping.set()
        self._finalizer()


def _stop_processes(procs, pipes) -> None:
    """Also run when the executor is collected or the interpreter exits: a worker exits at
    its pipe's end, wherever it waits."""
    for pipe in pipes:
        pipe.close()
    for proc in procs:
        proc.join(timeout=_STOP_TIMEOUT_S)
        if proc.is_alive():
            proc.kill()
            proc.join()
