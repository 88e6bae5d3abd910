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

from engine_worker.distributed.shm import ShmCollectives, new_shm_path, shm_unavailable_reason

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


class WholeModel:
    """One rank holds the whole model: nothing to reduce or gather."""

    name = "none"

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
    """The ranks' process group on the CPU (the control broadcast, and CPU activations)."""

    def __init__(self, store: dist.Store, rank: int, world_size: int) -> None:
        options = dist.ProcessGroupGloo._Options()
        options._timeout = _IDLE_TIMEOUT
        options._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
        self.pg = dist.ProcessGroupGloo(dist.PrefixStore("gloo", store), rank, world_size,
                                        options)
        self.rank = rank
        self.world_size = world_size


class TPComm:
    """One rank's collectives. ``all_reduce`` sums in place over the device group (the
    row-parallel layers' partial outputs, the vocab-parallel embedding); ``all_gather_last``
    concatenates every rank's slice along the last dimension (the logits)."""

    def __init__(self, cpu: GlooGroup, device_pg: Any, name: str,
                 shm: ShmCollectives | None = None) -> None:
        self.cpu = cpu
        self.device_pg = device_pg
        self.rank = cpu.rank
        self.world_size = cpu.world_size
        self.name = name  # the all-reduce that runs, for the start block
        self.shm = shm  # every rank has one or none; each call's size decides alike everywhere

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.shm is not None and self.shm.fits(x):
            return self.shm.all_reduce(x)
        self.device_pg.allreduce([x]).wait()
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
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

    def abort(self) -> None:
        """Fail every pending collective of this rank (a peer died)."""
        for pg in {id(self.cpu.pg): self.cpu.pg, id(self.device_pg): self.device_pg}.values():
            try:
                pg.abort()
            except Exception:  # already broken: nothing left to fail
                pass


def make_comm(store: dist.Store, rank: int, world_size: int, device: torch.device,
              failed: Callable[[], str | None] = lambda: None) -> TPComm:
    """Gloo for control; activations over shared memory on a CPU (gloo where it cannot run),
    NCCL on CUDA. ``failed``: polled by a rank waiting in shared memory (why to give up)."""
    cpu = GlooGroup(store, rank, world_size)
    if device.type != "cuda":
        return _cpu_comm(cpu, failed)
    options = dist.ProcessGroupNCCL.Options()
    nccl = dist.ProcessGroupNCCL(dist.PrefixStore("nccl", store), rank, world_size, options)
    return TPComm(cpu, nccl, "nccl")


def _cpu_comm(cpu: GlooGroup, failed: Callable[[], str | None]) -> TPComm:
    """Rank 0 decides and creates the segment; every other rank maps it; rank 0 unlinks it
    once all have, so nothing is left in /dev/shm however the ranks end."""
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
    return TPComm(cpu, cpu.pg, f"shm (gloo for tensors over {shm.slot_bytes >> 20} MiB)",
                  shm=shm)
