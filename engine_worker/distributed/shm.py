"""A shared-memory all-reduce and all-gather between the ranks of one host (vLLM's CPU build
does the same), beside which gloo's loopback TCP costs a millisecond or more a call on a busy
machine.

One file in /dev/shm, mapped by every rank and unlinked once all have mapped it, holds two
buffers of one slot per rank, and a sequence flag per rank on its own cache line (beside it
the rank's pid, which a waiting rank checks to see a peer gone). A collective
writes the rank's tensor into its slot of buffer ``seq % 2``, publishes ``seq`` in its flag and
waits until every flag has reached ``seq``; then every rank reads all slots, summing them in
rank order, so every rank gets the same bits. Alternating buffers makes one wait per call
enough: a rank can write buffer ``seq % 2`` again (at ``seq + 2``) only after every rank has
published ``seq + 1``, which each does only after it finished reading ``seq``'s slots.

The flags are plain stores and loads: on x86 (total store order) a rank that sees a flag sees
the slot written before it. Tensors larger than a slot, and other architectures, go to gloo.

The CPU kernels run the same all-reduce in C++ (``csrc/cpu/shm_all_reduce.cpp``) inside the
fused layer stack, on this segment and this rank's sequence number (``state``, shared with
it): Python's calls and theirs interleave in one sequence.
"""

from __future__ import annotations

import os
import platform
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

SHM_DIR = Path("/dev/shm")
SLOT_BYTES = 4 << 20  # a decode step's activations and logits fit many times over
_FLAG_STRIDE = 8  # int64s: one 64-byte cache line per rank's flag
_SPINS_BEFORE_YIELD = 64


def shm_unavailable_reason(world_size: int, slot_bytes: int = SLOT_BYTES) -> str | None:
    """Why the shared-memory collectives cannot run here, or None."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return f"the flags rely on x86's store order ({platform.machine()} is not x86)"
    if not SHM_DIR.is_dir() or not os.access(SHM_DIR, os.W_OK):
        return f"{SHM_DIR} is not a writable directory"
    stat = os.statvfs(SHM_DIR)
    needed = _total_bytes(world_size, slot_bytes)
    if stat.f_bavail * stat.f_frsize < needed:
        return (f"{SHM_DIR} has {stat.f_bavail * stat.f_frsize} bytes free, {needed} are "
                f"needed (mount a larger memory-backed volume there)")
    return None


def _total_bytes(world_size: int, slot_bytes: int) -> int:
    return world_size * _FLAG_STRIDE * 8 + 2 * world_size * slot_bytes


def new_shm_path() -> Path:
    return SHM_DIR / f"quire-tp-{os.getpid()}-{uuid.uuid4().hex[:12]}"


@dataclass(frozen=True, slots=True)
class ShmSegment:
    """What a kernel needs to run this rank's all-reduce itself (csrc/cpu/shm_all_reduce.cpp):
    the mapped segment and the rank's ``[seq, rank, world_size, slot_bytes]``, which it
    advances as Python's calls do."""

    segment: torch.Tensor  # uint8, the whole mapped file
    state: torch.Tensor  # int64 [4]


class ShmCollectives:
    """Rank ``rank``'s view of the segment at ``path`` (created by rank 0 with ``create``).
    ``failed``: polled while waiting; a string (why a peer is gone) aborts the wait."""

    def __init__(self, path: Path, rank: int, world_size: int, *, create: bool,
                 failed: Callable[[], str | None], slot_bytes: int = SLOT_BYTES) -> None:
        size = _total_bytes(world_size, slot_bytes)
        if create:
            with open(path, "wb") as f:
                f.truncate(size)
        self.segment = torch.from_file(str(path), shared=True, size=size, dtype=torch.uint8)
        flag_bytes = world_size * _FLAG_STRIDE * 8
        lines = self.segment[:flag_bytes].numpy().view(np.int64)
        self._flags = lines[::_FLAG_STRIDE]
        lines[rank * _FLAG_STRIDE + 1] = os.getpid()
        self._slots = self.segment[flag_bytes:].view(2, world_size, slot_bytes)
        self.rank, self.world_size, self.slot_bytes = rank, world_size, slot_bytes
        self._failed = failed
        # [seq, rank, world_size, slot_bytes]: what the C++ all-reduce reads and advances
        self.state = torch.tensor([0, rank, world_size, slot_bytes], dtype=torch.int64)
        self._state = self.state.numpy()

    @property
    def kernel_view(self) -> ShmSegment:
        return ShmSegment(self.segment, self.state)

    def fits(self, x: torch.Tensor) -> bool:
        return x.numel() * x.element_size() <= self.slot_bytes

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum over ranks, in place in ``x`` (same bits on every rank)."""
        parts = self._exchange(x)
        if x.dtype == torch.float32 or len(parts) == 2:  # (two: one rounding either way)
            torch.add(parts[0], parts[1], out=x)
            for part in parts[2:]:
                x += part
            return x
        acc = parts[0].float()  # more narrow parts: summed in fp32, rounded once
        for part in parts[1:]:
            acc += part
        return x.copy_(acc)

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat(self._exchange(x), dim=-1)

    def _exchange(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's ``x``, as views of the slots (valid until the next call but one)."""
        x = x.contiguous()
        num_bytes = x.numel() * x.element_size()
        self._state[0] += 1
        seq = int(self._state[0])
        buffer = self._slots[seq & 1]
        buffer[self.rank, :num_bytes].copy_(x.view(-1).view(torch.uint8))
        self._flags[self.rank] = seq  # after the slot's bytes (x86 store order)
        self._wait(seq)
        return [buffer[r, :num_bytes].view(x.dtype).view(x.shape)
                for r in range(self.world_size)]

    def _wait(self, seq: int) -> None:
        flags, spins = self._flags, 0
        while flags.min() < seq:
            spins += 1
            if spins < _SPINS_BEFORE_YIELD:
                continue
            os.sched_yield()  # ranks may share cores: let the one we wait for run
            if spins % 1024 == 0:
                reason = self._failed()
                if reason is not None:
                    raise RuntimeError(f"shared-memory all-reduce aborted: {reason}")
                if spins > 1 << 16:
                    time.sleep(0.0005)  # a long wait (a peer in a long step): stop spinning
