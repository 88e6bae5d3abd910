"""The collectives a tensor-parallel shard needs, over torch.distributed process groups.

Groups are made from a ``TCPStore`` and held by the engine that made them (``ProcessGroupGloo``
/ ``ProcessGroupNCCL`` objects, never torch's default group), so one process can hold several
engines, and nothing here is module state. The step broadcast is pickled plain data in a uint8
tensor over the CPU group (gloo); activations go over the device group: NCCL on CUDA; on a CPU
shared memory between the ranks (``distributed.shm``) where /dev/shm serves, with gloo for
tensors larger than a slot and as the fallback (the start block says which runs and why).
``WholeModel`` is the single-process stand-in: every collective is the identity.
"""

from __future__ import annotations

import datetime
import os
import pickle
from pathlib import Path
from collections.abc import Callable
from typing import Any, Protocol

import torch
import torch.distributed as dist

from engine_worker.distributed.shm import (ShmCollectives, ShmSegment, new_shm_path,
                                           shm_unavailable_reason)

_HEADER_BYTES = 8
_BROADCAST_BYTES = 16 * 1024  # one broadcast carries a step up to this size, a second the rest
# how long the ranks wait for one another at start (a worker that never comes up fails the
# engine's start after this); collectives themselves wait as long as the engine idles
JOIN_TIMEOUT = datetime.timedelta(seconds=180)
_IDLE_TIMEOUT = datetime.timedelta(days=365)


class Collectives(Protocol):
    """What the model's layers call: identity for one rank, sums and gathers across ranks."""

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor: ...

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor: ...

    # the all-reduce a fused kernel can run itself between layers (None: only the above)
    @property
    def kernel_all_reduce(self) -> ShmSegment | None: ...


class WholeModel:
    """One rank holds the whole model: nothing to reduce or gather."""

    name = "none"
    kernel_all_reduce = None

    @staticmethod
    def all_reduce(x: torch.Tensor) -> torch.Tensor:
        return x

    @staticmethod
    def all_gather_last(x: torch.Tensor) -> torch.Tensor:
        return x


def make_store(rank: int, world_size: int, port: int) -> dist.TCPStore:
    """Rank 0 listens (``port`` 0: any free port, read back from ``store.port``)."""
    return dist.TCPStore("127.0.0.1", port, world_size, rank == 0, timeout=JOIN_TIMEOUT,
                         wait_for_workers=False)


class GlooGroup:
    """A process group on the CPU: every rank (the step broadcast, pipeline stages' hidden
    states) or one stage's tensor-parallel ranks (their CPU activations)."""

    def __init__(self, store: dist.Store, rank: int, world_size: int,
                 prefix: str = "gloo") -> None:
        options = dist.ProcessGroupGloo._Options()
        options._timeout = _IDLE_TIMEOUT
        options._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
        self.pg = dist.ProcessGroupGloo(dist.PrefixStore(prefix, store), rank, world_size,
                                        options)
        self.rank = rank
        self.world_size = world_size


class TPComm:
    """One tensor-parallel group's collectives (``rank`` / ``world_size`` are within it).
    ``all_reduce`` sums in place over the device group (the row-parallel layers' partial
    outputs, the vocab-parallel embedding); ``all_gather_last`` concatenates every rank's
    slice along the last dimension (the logits). With one rank both are the identity."""

    def __init__(self, cpu: GlooGroup, device_pg: Any, name: str,
                 shm: ShmCollectives | None = None) -> None:
        self.cpu = cpu
        self.device_pg = device_pg
        self.rank = cpu.rank
        self.world_size = cpu.world_size
        self.name = name  # the all-reduce that runs, for the start block
        self.shm = shm  # every rank has one or none; each call's size decides alike everywhere

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.world_size == 1:
            return x
        if self.shm is not None and self.shm.fits(x):
            return self.shm.all_reduce(x)
        self.device_pg.allreduce([x]).wait()
        return x

    @property
    def kernel_all_reduce(self) -> ShmSegment | None:
        """The segment a fused kernel sums over itself, where this group has one."""
        return self.shm.kernel_view if self.shm is not None else None  # (none with one rank)

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        if self.world_size == 1:
            return x
        if self.shm is not None and self.shm.fits(x):
            return self.shm.all_gather_last(x)
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        self.device_pg.allgather([parts], [x]).wait()
        return torch.cat(parts, dim=-1)

    def broadcast_object(self, obj: Any = None) -> Any:
        """Rank 0's ``obj`` on every rank (pickled; plain data only)."""
        buf = torch.zeros(_BROADCAST_BYTES, dtype=torch.uint8)
        data = b""
        if self.rank == 0:
            data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
            head = len(data).to_bytes(_HEADER_BYTES, "little") + data[:_BROADCAST_BYTES
                                                                      - _HEADER_BYTES]
            buf[:len(head)] = torch.frombuffer(bytearray(head), dtype=torch.uint8)
        self.cpu.pg.broadcast(buf, 0).wait()
        size = int.from_bytes(bytes(buf[:_HEADER_BYTES].tolist()), "little")
        first = _BROADCAST_BYTES - _HEADER_BYTES
        if size > first:  # a large step: the rest in a second broadcast
            rest = (torch.frombuffer(bytearray(data[first:]), dtype=torch.uint8)
                    if self.rank == 0 else torch.empty(size - first, dtype=torch.uint8))
            self.cpu.pg.broadcast(rest, 0).wait()
            if self.rank != 0:
                data = bytes(buf[_HEADER_BYTES:].numpy()) + bytes(rest.numpy())
        elif self.rank != 0:
            data = bytes(buf[_HEADER_BYTES:_HEADER_BYTES + size].numpy())
        return obj if self.rank == 0 else pickle.loads(data)



class ParallelComm:
    """One rank of ``num_stages`` pipeline stages of ``tp.world_size`` ranks each (rank =
    stage * tp + tp rank): ``tp`` for the layers' collectives, and over every rank the step
    broadcast from rank 0 and the stages' hidden states (each stage's rank sends to the same
    tensor-parallel rank of the next; the last stage's final hidden states go to every rank,
    which then all compute the logits and sample alike)."""

    def __init__(self, world: GlooGroup, tp: TPComm, num_stages: int) -> None:
        self.world = world
        self.tp = tp
        self.num_stages = num_stages
        self.stage = world.rank // tp.world_size

    # the layers' collectives, as the model calls them
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.all_reduce(x)

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.all_gather_last(x)

    @property
    def kernel_all_reduce(self) -> ShmSegment | None:
        return self.tp.kernel_all_reduce

    @property
    def name(self) -> str:
        return self.tp.name if self.tp.world_size > 1 else "none"

    def broadcast_object(self, obj: Any = None) -> Any:
        return TPComm(self.world, self.world.pg, "").broadcast_object(obj)

    def send_to_next_stage(self, x: torch.Tensor, tag: int = 0) -> Any:
        """Starts sending ``x`` (a micro-batch: ``tag``, its index); the caller waits on the
        returned work before it reuses ``x``."""
        return self.world.pg.send([x.contiguous()], self.world.rank + self.tp.world_size, tag)

    def recv_from_previous_stage(self, x: torch.Tensor, tag: int = 0) -> torch.Tensor:
        self.world.pg.recv([x], self.world.rank - self.tp.world_size, tag).wait()
        return x

    def broadcast_from_last_stage(self, x: torch.Tensor) -> torch.Tensor:
        """The last stage's tensor-parallel rank 0 sends ``x`` (its final hidden states)."""
        self.world.pg.broadcast(x, (self.num_stages - 1) * self.tp.world_size).wait()
        return x

    def barrier(self) -> None:
        self.world.pg.barrier().wait()



def make_comm(store: dist.Store, rank: int, world_size: int, device: torch.device,
              failed: Callable[[], str | None] = lambda: None,
              tensor_parallel_size: int | None = None) -> ParallelComm:
    """Gloo for control and between stages; activations within a stage over shared memory
    on a CPU (gloo where it cannot run), NCCL on CUDA. ``failed``: polled by a rank waiting
    in shared memory (why to give up)."""
    tp = tensor_parallel_size or world_size
    world = GlooGroup(store, rank, world_size, "world")
    stage, tp_rank = divmod(rank, tp)
    cpu = world if tp == world_size else GlooGroup(store, tp_rank, tp, f"tp{stage}")
    if device.type != "cuda":
        return ParallelComm(world, _cpu_comm(cpu, failed), world_size // tp)
    options = dist.ProcessGroupNCCL.Options()
    nccl = dist.ProcessGroupNCCL(dist.PrefixStore(f"nccl{stage}", store), tp_rank, tp, options)
    return ParallelComm(world, TPComm(cpu, nccl, "nccl"), world_size // tp)


def _cpu_comm(cpu: GlooGroup, failed: Callable[[], str | None]) -> TPComm:
    """Rank 0 decides and creates the segment; every other rank maps it; rank 0 unlinks it
    once all have, so nothing is left in /dev/shm however the ranks end."""
    if cpu.world_size == 1:
        return TPComm(cpu, cpu.pg, "none")
    decision, shm = None, None
    if cpu.rank == 0:
        reason = shm_unavailable_reason(cpu.world_size)
        if reason is None:
            path = new_shm_path()
            shm = ShmCollectives(path, 0, cpu.world_size, create=True, failed=failed)
            decision = ("shm", str(path))
        else:
            decision = ("gloo", f"shared memory unavailable: {reason}")
    kind, detail = TPComm(cpu, cpu.pg, "gloo").broadcast_object(decision)
    if kind == "gloo":
        return TPComm(cpu, cpu.pg, f"gloo ({detail})")
    if shm is None:
        shm = ShmCollectives(Path(detail), cpu.rank, cpu.world_size, create=False,
                             failed=failed)
    cpu.pg.barrier().wait()
    if cpu.rank == 0:
        os.unlink(detail)
    return TPComm(cpu, cpu.pg, f"shm (gloo for Python's tensors over {shm.slot_bytes >> 20} MiB)",
                  shm=shm)
