"""The shared-memory all-reduce and all-gather (engine_worker.distributed.shm), two ranks on
two threads over one segment: sums equal on every rank, many calls in a row (both buffers),
and a wait that gives up when told a peer is gone."""

from __future__ import annotations

import threading

import pytest
import torch

from engine_worker.distributed.shm import ShmCollectives, new_shm_path, shm_unavailable_reason

pytestmark = pytest.mark.skipif(shm_unavailable_reason(2) is not None,
                                reason=str(shm_unavailable_reason(2)))


def _pair(slot_bytes=1 << 16):
    path = new_shm_path()
    ranks = [ShmCollectives(path, 0, 2, create=True, failed=lambda: None,
                            slot_bytes=slot_bytes)]
    ranks.append(ShmCollectives(path, 1, 2, create=False, failed=lambda: None,
                                slot_bytes=slot_bytes))
    path.unlink()
    return ranks


def _run_both(fn):
    results, errors = [None, None], []

    def run(rank):
        try:
            results[rank] = fn(rank)
        except BaseException as e:  # surfaced below
            errors.append(e)
    threads = [threading.Thread(target=run, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    return results


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_all_reduce_and_all_gather_agree_on_every_rank(dtype):
    ranks = _pair()
    g = torch.Generator().manual_seed(0)
    inputs = [[torch.randn(3, 17, generator=g).to(dtype) for _ in range(2)] for _ in range(20)]

    def work(rank):
        outs = []
        for pair in inputs:  # 20 calls: both buffers, many times
            outs.append(ranks[rank].all_reduce(pair[rank].clone()))
            outs.append(ranks[rank].all_gather_last(pair[rank]))
        return outs
    got = _run_both(work)
    for i, pair in enumerate(inputs):
        total = (pair[0].float() + pair[1].float()).to(dtype)
        for rank in range(2):
            assert torch.equal(got[rank][2 * i], total)
            assert torch.equal(got[rank][2 * i + 1], torch.cat(pair, dim=-1))


def test_a_tensor_larger_than_a_slot_does_not_fit():
    rank0, _ = _pair(slot_bytes=1024)
    assert rank0.fits(torch.zeros(256)) and not rank0.fits(torch.zeros(257))


def test_a_wait_for_a_dead_peer_raises_instead_of_hanging():
    path = new_shm_path()
    rank0 = ShmCollectives(path, 0, 2, create=True, failed=lambda: "rank 1 exited",
                           slot_bytes=1024)
    path.unlink()
    with pytest.raises(RuntimeError, match="rank 1 exited"):
        rank0.all_reduce(torch.ones(4))
