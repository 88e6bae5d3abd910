"""How much memory this host can still give: MemAvailable, capped by what the process's cgroup
allows (in a pod, the container's limit is often far below the node's MemAvailable, which is
all /proc/meminfo shows). An engine checks its KV cache budget against it; ``quire up`` divides
it among its engines.

Torch-free: ``quire up`` reads it in the router's process.
"""

from __future__ import annotations

from pathlib import Path

_UNLIMITED_V1 = 1 << 60  # cgroup v1 writes "no limit" as a huge page-rounded number


def meminfo_available_bytes(meminfo: str) -> int:
    for line in meminfo.splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("cannot read MemAvailable from /proc/meminfo")


def cgroup_room_bytes(limit: str, usage: str, stat: str) -> int | None:
    """What a cgroup still allows (its limit less its use, reclaimable file pages counted as
    free), from its files' contents (v2: memory.max, memory.current, memory.stat; v1:
    memory.limit_in_bytes, memory.usage_in_bytes, memory.stat). None: no limit."""
    limit = limit.strip()
    if limit == "max" or int(limit) >= _UNLIMITED_V1:
        return None
    inactive_file = 0
    for line in stat.splitlines():
        key, _, value = line.partition(" ")
        if key in ("inactive_file", "total_inactive_file"):
            inactive_file = int(value)
            break
    return max(0, int(limit) - int(usage) + inactive_file)


def _cgroup_dirs() -> list[tuple[Path, str, str]]:
    """(directory, limit file, usage file) of this process's memory cgroup, v2 then v1."""
    root = Path("/sys/fs/cgroup")
    dirs = []
    try:
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            hierarchy, controllers, path = line.split(":", 2)
            if hierarchy == "0":  # v2: "0::/path"
                dirs.append((root / path.lstrip("/"), "memory.max", "memory.current"))
            elif "memory" in controllers.split(","):  # v1: "4:memory:/path"
                dirs.append((root / "memory" / path.lstrip("/"), "memory.limit_in_bytes",
                             "memory.usage_in_bytes"))
    except OSError:
        pass
    dirs += [(root, "memory.max", "memory.current"),
             (root / "memory", "memory.limit_in_bytes", "memory.usage_in_bytes")]
    return dirs


def read_cgroup_room_bytes() -> int | None:
    for directory, limit, usage in _cgroup_dirs():
        try:
            return cgroup_room_bytes((directory / limit).read_text(),
                                     (directory / usage).read_text(),
                                     (directory / "memory.stat").read_text())
        except (OSError, ValueError):
            continue
    return None


def host_available_bytes() -> int:
    """MemAvailable, or the cgroup's room where that is smaller."""
    available = meminfo_available_bytes(Path("/proc/meminfo").read_text())
    room = read_cgroup_room_bytes()
    return available if room is None else min(available, room)
