"""The KV cache faulted in at start (engine_worker/kv_cache/prefault.py): every block of every
layer in windows, first blocks first; pages resident and still zero afterwards; a stop where the
host would run short; servers on by default, ``LLM`` off."""

from __future__ import annotations

import argparse
import ctypes
import mmap
import sys

import pytest
import torch

from engine_worker.kv_cache.prefault import block_windows, prefault_kv_cache
from engine_worker.platform import allocate_zeroed

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="asks Linux which pages are resident (mincore)")

# 3 layers of [2 (K, V), blocks, 16 tokens, 2 heads, 64 dims] in bf16: 4 KiB a block a half,
# 8 MiB a half (four 2 MiB huge pages: populating one block brings its whole huge page in)
LAYERS, BLOCKS, SHAPE = 3, 2048, (16, 2, 64)
BLOCK_BYTES = LAYERS * 2 * 16 * 2 * 64 * 2


def _caches() -> list[torch.Tensor]:
    return [allocate_zeroed((2, BLOCKS, *SHAPE), torch.bfloat16, torch.device("cpu"))
            for _ in range(LAYERS)]


_LIBC = ctypes.CDLL(None, use_errno=True)
_LIBC.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte))
PAGE = mmap.PAGESIZE


def _resident_bytes(t: torch.Tensor) -> int:
    """Bytes of ``t``'s own pages that are present (mincore over exactly its address range).

    Not the Rss of its mapping in /proc/self/smaps: Linux merges neighbouring anonymous mappings
    with the same flags into one, so that Rss can include another tensor's pages (the three
    caches here, or a huge-page weight copy an earlier test left alive next to them)."""
    address, nbytes = t.data_ptr(), t.numel() * t.element_size()
    assert address % PAGE == 0
    pages = -(-nbytes // PAGE)
    vec = (ctypes.c_ubyte * pages)()
    if _LIBC.mincore(ctypes.c_void_p(address), ctypes.c_size_t(nbytes), vec) != 0:
        raise OSError(ctypes.get_errno(), "mincore")
    return sum(b & 1 for b in vec) * PAGE


def test_windows_cover_every_block_of_every_layer_once_first_blocks_first():
    caches = _caches()
    windows = block_windows(caches, window_bytes=10 * BLOCK_BYTES)
    assert len(windows) == -(-BLOCKS // 10)
    starts = []
    for window in windows:
        assert len(window) == 2 * LAYERS  # the same blocks of every layer's K and V
        assert all(v.is_contiguous() for v in window)
        assert len({v.shape[0] for v in window}) == 1
        starts.append(window[0].data_ptr())
    assert starts == sorted(starts)
    for layer, t in enumerate(caches):
        for half in range(2):
            views = [w[2 * layer + half] for w in windows]
            assert sum(v.shape[0] for v in views) == BLOCKS
            assert views[0].data_ptr() == t[half].data_ptr()
            for a, b in zip(views, views[1:]):  # back to back, no gap, no overlap
                assert a.data_ptr() + a.numel() * a.element_size() == b.data_ptr()


def test_prefault_makes_every_page_resident_and_leaves_the_cache_zero():
    caches = _caches()
    before = sum(_resident_bytes(t) for t in caches)
    total = sum(t.numel() * t.element_size() for t in caches)
    assert before < total // 4  # mapped lazily: nothing faulted in yet
    line = prefault_kv_cache(caches, 2, available=lambda: 1 << 50, keep_available=0,
                             window_bytes=64 * BLOCK_BYTES)
    assert line.startswith(f"faulted in at start, {total / 2**30:.2f} of {total / 2**30:.2f} GiB")
    assert "2 threads" in line and "stopped" not in line
    assert sum(_resident_bytes(t) for t in caches) >= total
    assert all(int(torch.count_nonzero(t)) == 0 for t in caches)


def test_prefault_stops_where_the_host_would_keep_too_little():
    caches = _caches()
    window = 64 * BLOCK_BYTES
    room = [2 * window + window // 2]  # room for two windows, then the floor

    def available() -> int:
        left = room[0]
        room[0] -= window
        return left

    line = prefault_kv_cache(caches, 1, available=available, keep_available=0,
                             window_bytes=window)
    assert f"faulted in at start, {2 * window / 2**30:.2f} of" in line
    assert "then stopped where the host would keep less than 0 GiB available" in line
    # the first two windows (blocks 0-127 of every layer's K and V, within each half's first
    # huge page) are in, the rest still lazy
    assert all(_resident_bytes(t) <= t.numel() * t.element_size() // 2 for t in caches)


def test_servers_fault_the_cache_in_by_default_and_llm_does_not(monkeypatch):
    from engine_worker.arg_utils import (add_engine_args, add_server_engine_args,
                                         engine_args_from_namespace)
    from engine_worker.config import EngineArgs

    assert EngineArgs().create_engine_config().cache.kv_cache_prefault is False
    monkeypatch.delenv("QUIRE_KV_CACHE_PREFAULT", raising=False)
    server, offline = argparse.ArgumentParser(), argparse.ArgumentParser()
    add_server_engine_args(server)
    add_engine_args(offline)
    assert engine_args_from_namespace(server.parse_args([])).kv_cache_prefault is True
    assert engine_args_from_namespace(offline.parse_args([])).kv_cache_prefault is False
    assert server.parse_args(["--kv-cache-prefault", "false"]).kv_cache_prefault is False
    monkeypatch.setenv("QUIRE_KV_CACHE_PREFAULT", "false")  # the chart's way to say no
    env_server = argparse.ArgumentParser()
    add_server_engine_args(env_server)
    assert env_server.parse_args([]).kv_cache_prefault is False
    with pytest.raises(ValueError, match="kv_cache_prefault"):
        EngineArgs(kv_cache_prefault="yes").create_engine_config()


def test_quire_up_passes_a_changed_prefault_on_to_its_engines(monkeypatch):
    """``quire up`` forwards what differs from ``quire engine``'s defaults: nothing for the
    default, ``--kv-cache-prefault False`` when the user turns it off."""
    from engine_worker.arg_utils import add_server_engine_args
    from quire_cli.stack import changed_engine_flags

    monkeypatch.delenv("QUIRE_KV_CACHE_PREFAULT", raising=False)
    up, engine = argparse.ArgumentParser(), argparse.ArgumentParser()
    add_server_engine_args(up)
    add_server_engine_args(engine)
    assert changed_engine_flags(up.parse_args([])) == []
    flags = changed_engine_flags(up.parse_args(["--kv-cache-prefault", "false"]))
    assert flags == ["--kv-cache-prefault", "False"]
    assert engine.parse_args(flags).kv_cache_prefault is False
