"""CPU time a server's processes spend while a benchmark client runs against it, read from
``/proc`` (Linux), so that a serving run says where the machine's cores went: for ``quire up``
the router (the stack's own process) and each engine process, split into the engine's main
thread (its gRPC server) and its other threads (the model loop and its OpenMP team); for
vLLM's CPU server the API server, its EngineCore process (the scheduler loop) and its Worker
process (the model). On a machine whose client, front and engine share the same few cores,
every core-second the rest takes is one the model does not get.

``snapshot`` before and after the run, ``cpu_used`` for the difference; a process that
started during the run counts from zero, one that ended is left out (its time is gone with
it). ``summarize`` folds one run into the report's figures.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

PROC = Path("/proc")
CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


@dataclass(frozen=True, slots=True)
class ProcessCpu:
    """One process's CPU seconds (user + system) so far, and its main thread's."""

    pid: int
    command: str  # its command line's first words
    cpu_s: float
    main_thread_cpu_s: float


def _stat_fields(path: Path) -> list[str] | None:
    """The fields of a ``stat`` file after the command name (which may hold spaces and
    parentheses): field 3 of proc(5) is index 0. None when the process is gone."""
    try:
        text = path.read_text()
    except OSError:
        return None
    return text[text.rindex(")") + 2:].split()


def _cpu_s(fields: list[str]) -> float:
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS  # utime + stime (fields 14, 15)


def process_tree(root_pid: int) -> list[int]:
    """``root_pid`` and every process descended from it that is alive now, root first."""
    children: dict[int, list[int]] = {}
    for entry in PROC.iterdir():
        if entry.name.isdigit():
            fields = _stat_fields(entry / "stat")
            if fields is not None:
                children.setdefault(int(fields[1]), []).append(int(entry.name))
    tree, todo = [], [root_pid]
    while todo:
        pid = todo.pop(0)
        tree.append(pid)
        todo.extend(sorted(children.get(pid, [])))
    return tree


def _command(pid: int, words: int = 4) -> str:
    try:
        argv = (PROC / str(pid) / "cmdline").read_bytes().split(b"\0")
    except OSError:
        return ""
    return " ".join(a.decode(errors="replace") for a in argv[:words] if a)


def snapshot(root_pid: int) -> dict[int, ProcessCpu]:
    """CPU time so far of ``root_pid``'s process tree, by pid (empty when it is gone)."""
    found = {}
    for pid in process_tree(root_pid):
        fields = _stat_fields(PROC / str(pid) / "stat")
        main = _stat_fields(PROC / str(pid) / "task" / str(pid) / "stat")
        if fields is None or main is None:
            continue
        found[pid] = ProcessCpu(pid, _command(pid), _cpu_s(fields), _cpu_s(main))
    return found


def cpu_used(before: dict[int, ProcessCpu], after: dict[int, ProcessCpu],
             root_pid: int) -> list[dict]:
    """Each process of ``after`` with the CPU seconds it spent since ``before`` (from zero
    where it started since), the root first: ``{"pid", "command", "role", "cpu_s",
    "main_thread_cpu_s"}`` with role ``front`` for the root and ``engine`` for the rest."""
    used = []
    for pid, now in after.items():
        then = before.get(pid) or ProcessCpu(pid, now.command, 0.0, 0.0)
        used.append({"pid": pid, "command": now.command,
                     "role": "front" if pid == root_pid else "engine",
                     "cpu_s": round(now.cpu_s - then.cpu_s, 2),
                     "main_thread_cpu_s": round(now.main_thread_cpu_s - then.main_thread_cpu_s,
                                                2)})
    return sorted(used, key=lambda p: (p["role"] != "front", p["pid"]))


def summarize(processes: list[dict], num_output_tokens: int) -> dict[str, float | None]:
    """One run's server CPU as the report gives it: seconds in all (``server_cpu_s``), in the
    front (the router, or vLLM's API server), in the engine processes' main threads (Quire:
    the gRPC server; vLLM: its EngineCore's scheduler loop and its Worker's model, each a
    process of its own) and in their other threads (Quire: the model loop and its OpenMP
    team), and the server's milliseconds per output token (None without tokens)."""
    front = sum(p["cpu_s"] for p in processes if p["role"] == "front")
    engine = sum(p["cpu_s"] for p in processes if p["role"] == "engine")
    main = sum(p["main_thread_cpu_s"] for p in processes if p["role"] == "engine")
    total = front + engine
    return {"server_cpu_s": round(total, 2), "front_cpu_s": round(front, 2),
            "engine_main_thread_cpu_s": round(main, 2),
            "engine_other_threads_cpu_s": round(engine - main, 2),
            "server_cpu_ms_per_output_token":
                round(1000 * total / num_output_tokens, 3) if num_output_tokens else None}
