"""What memory the host can still give: MemAvailable, capped by the cgroup's room (issue 32)."""

from __future__ import annotations

from engine_worker.host_memory import (cgroup_room_bytes, host_available_bytes,
                                       meminfo_available_bytes)

MEMINFO = "MemTotal:       24576000 kB\nMemFree:         1000000 kB\nMemAvailable:   20000000 kB\n"


def test_meminfo_available():
    assert meminfo_available_bytes(MEMINFO) == 20_000_000 * 1024


def test_cgroup_v2_room_is_the_limit_less_use_with_inactive_file_pages_free():
    stat = "anon 100\nfile 5000\ninactive_file 3000\nactive_file 2000\n"
    assert cgroup_room_bytes("8000\n", "6000\n", stat) == 8000 - 6000 + 3000
    assert cgroup_room_bytes("max\n", "6000\n", stat) is None  # no limit
    assert cgroup_room_bytes("8000\n", "9000\n", "") == 0  # over its limit: nothing left


def test_cgroup_v1_room_and_its_unlimited_value():
    stat = "cache 10\ntotal_inactive_file 4096\n"
    assert cgroup_room_bytes("1073741824\n", "1000000000\n", stat) == \
        1073741824 - 1000000000 + 4096
    assert cgroup_room_bytes("9223372036854771712\n", "1000\n", stat) is None


def test_this_host_has_some_memory_available():
    assert 0 < host_available_bytes() <= meminfo_available_bytes(open("/proc/meminfo").read())
