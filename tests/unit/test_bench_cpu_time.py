"""``quire_cli.bench.cpu_time``: the CPU time of a server's process tree during a run, read from
/proc, on a real process tree (a child that burns a fixed amount of CPU time in a worker thread
and starts a grandchild during the run). CPU time, not wall time, so a loaded machine changes
nothing."""

from __future__ import annotations

import subprocess
import sys

import pytest

from quire_cli.bench import cpu_time

CHILD = r"""
import subprocess, sys, threading, time

def burn():
    while time.thread_time() < 0.3:
        pass

sys.stdin.readline()
grandchild = subprocess.Popen(["sleep", "60"])
worker = threading.Thread(target=burn)
worker.start()
worker.join()
print(grandchild.pid, flush=True)
sys.stdin.readline()
grandchild.kill()
"""


@pytest.mark.skipif(not cpu_time.PROC.joinpath("self", "stat").exists(), reason="needs /proc")
def test_a_run_counts_each_process_of_the_tree_and_splits_off_the_main_thread():
    child = subprocess.Popen([sys.executable, "-c", CHILD], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    try:
        before = cpu_time.snapshot(child.pid)
        assert list(before) == [child.pid]
        child.stdin.write("go\n")
        child.stdin.flush()
        grandchild = int(child.stdout.readline())
        after = cpu_time.snapshot(child.pid)
        assert cpu_time.process_tree(child.pid) == [child.pid, grandchild]
        used = cpu_time.cpu_used(before, after, child.pid)
        assert [(p["pid"], p["role"]) for p in used] == [(child.pid, "front"),
                                                        (grandchild, "engine")]
        front, sleeper = used
        assert front["command"].startswith(sys.executable)
        assert sleeper["command"] == "sleep 60"
        # the worker thread burned 0.3 s of its own CPU time; /proc counts in clock ticks
        assert front["cpu_s"] >= 0.3 - 2 / cpu_time.CLOCK_TICKS
        assert front["cpu_s"] - front["main_thread_cpu_s"] >= 0.3 - 2 / cpu_time.CLOCK_TICKS
        assert sleeper["cpu_s"] < 0.1  # started during the run: counted from zero
    finally:
        child.stdin.close()
        child.wait(timeout=30)
    assert cpu_time.snapshot(child.pid) == {}  # gone: nothing to read


def test_summary_splits_front_engine_main_thread_and_the_rest():
    processes = [
        {"pid": 1, "command": "quire up", "role": "front", "cpu_s": 0.8,
         "main_thread_cpu_s": 0.6},
        {"pid": 2, "command": "engine", "role": "engine", "cpu_s": 10.5,
         "main_thread_cpu_s": 0.5},
        {"pid": 3, "command": "engine", "role": "engine", "cpu_s": 9.5,
         "main_thread_cpu_s": 0.25},
    ]
    assert cpu_time.summarize(processes, 8000) == {
        "server_cpu_s": 20.8, "front_cpu_s": 0.8, "engine_main_thread_cpu_s": 0.75,
        "engine_other_threads_cpu_s": 19.25, "server_cpu_ms_per_output_token": 2.6}
    assert cpu_time.summarize(processes, 0)["server_cpu_ms_per_output_token"] is None


def test_stat_fields_survive_a_command_name_with_spaces_and_parentheses(tmp_path):
    stat = tmp_path / "stat"
    fields = ["S", "7"] + ["0"] * 9 + ["250", "50"] + ["0"] * 5
    stat.write_text("42 (a (b) c) " + " ".join(fields) + "\n")
    parsed = cpu_time._stat_fields(stat)
    assert parsed[1] == "7"  # the parent's pid
    assert cpu_time._cpu_s(parsed) == pytest.approx(300 / cpu_time.CLOCK_TICKS)
    assert cpu_time._stat_fields(tmp_path / "gone") is None
