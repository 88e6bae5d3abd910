"""The C++ shared-memory all-reduce (csrc/cpu/shm_all_reduce.cpp) that the fused layer stack
runs between layers under tensor parallelism, on the segment Python's collectives map
(engine_worker/distributed/shm.py): ranks on threads (the op releases the GIL), its sums
equal to Python's bit for bit in the summation order both promise, calls interleaved with
Python's in one sequence, tensors larger than a slot in several rounds, and a wait that fails
naming a peer whose process is gone instead of spinning forever."""

from __future__ import annotations

import subprocess
import sys
import threading

import pytest
import torch

from engine_worker.distributed.shm import ShmCollectives, new_shm_path, shm_unavailable_reason

pytestmark = [pytest.mark.skipif(shm_unavailable_reason(3) is not None,
                                 reason=str(shm_unavailable_reason(3))),
              pytest.mark.cpu_ops("shm_all_reduce")]


def _group(world_size: int, slot_bytes: int) -> list[ShmCollectives]:
    path = new_shm_path()
    ranks = [ShmCollectives(path, r, world_size, create=r == 0, failed=lambda: None,
                            slot_bytes=slot_bytes) for r in range(world_size)]
    path.unlink()
    return ranks


def _on_threads(world_size: int, fn) -> list:
    results, errors = [None] * world_size, []

    def run(rank):
        try:
            results[rank] = fn(rank)
        except BaseException as e:  # surfaced below
            errors.append(e)
    threads = [threading.Thread(target=run, args=(r,)) for r in range(world_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads), "a rank is still waiting"
    assert not errors, errors
    return results


def _expected(parts: list[torch.Tensor]) -> torch.Tensor:
    """What both implementations promise: fp32 summed left to right; a narrow dtype's two
    parts rounded once from their fp32 sum, more parts summed in fp32 and rounded once."""
    acc = parts[0].float()
    for p in parts[1:]:
        acc = acc + p.float()
    return acc.to(parts[0].dtype)


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_sums_equal_pythons_on_every_rank_across_slots_and_interleaved_calls(
        cpu_kernels, world_size, dtype):
    ops = cpu_kernels.ops
    ranks = _group(world_size, slot_bytes=1024)  # 256 fp32 values a round
    g = torch.Generator().manual_seed(world_size)
    # a decode row, a tensor of several slots' worth, one that ends mid-slot
    shapes = [(1, 96), (7, 160), (3, 100)]
    inputs = [[torch.randn(*s, generator=g).to(dtype) for _ in range(world_size)]
              for s in shapes]

    def work(rank):
        outs = []
        for parts in inputs:
            y = parts[rank].clone()
            ops.shm_all_reduce(y, ranks[rank].segment, ranks[rank].state)
            outs.append(y)
            small = parts[rank][:1, :64].clone()  # Python's call, in the same sequence
            outs.append(ranks[rank].all_reduce(small))
        return outs

    got = _on_threads(world_size, work)
    for i, parts in enumerate(inputs):
        total = _expected(parts)
        for rank in range(world_size):
            assert torch.equal(got[rank][2 * i], total), (rank, parts[0].shape)
            assert torch.equal(got[rank][2 * i + 1], _expected([p[:1, :64] for p in parts]))
    # every rank advanced the one sequence alike, a round per slot's worth and Python's three
    element = inputs[0][0].element_size()
    rounds = sum(-(-p[0].numel() * element // 1024) for p in inputs) + len(inputs)
    assert {int(r.state[0]) for r in ranks} == {rounds}


def test_a_wait_on_a_peer_whose_process_is_gone_fails_naming_it(cpu_kernels):
    rank0, rank1 = _group(2, slot_bytes=1024)
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    pid = int(gone.stdout)
    # rank 1's line as a process that exited would have left it: its pid, its flag never set
    rank1_line = rank0.segment[64:128].view(torch.int64)
    rank1_line[1] = pid
    with pytest.raises(RuntimeError, match=rf"tensor-parallel rank 1 \(pid {pid}\) exited"):
        cpu_kernels.ops.shm_all_reduce(torch.ones(8), rank0.segment, rank0.state)
    del rank1


def test_a_segment_that_does_not_match_its_state_is_refused(cpu_kernels):
    rank0, _ = _group(2, slot_bytes=1024)
    state = rank0.state.clone()
    state[3] = 2048  # a slot size the segment was not made with
    with pytest.raises(RuntimeError, match="not the size its state says"):
        cpu_kernels.ops.shm_all_reduce(torch.ones(8), rank0.segment, state)
