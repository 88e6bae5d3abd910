"""How a serving engine process shares the cores between its OpenMP team and everything else.

The model runs on an OpenMP team (``num_threads``: the engine loop thread plus workers); the
gRPC server's event loop and poller threads, and on a small machine the router and the clients
too, run on the same cores. libgomp's default has a team thread spin after each parallel region
(300,000 spins) before it sleeps. A spinning thread keeps its core, so a server thread that wakes
preempts a team member, and then every other member spins at the next barrier until the
preempted one runs again: a millisecond of server work costs a millisecond of every core. With
the ``passive`` wait policy a waiting member sleeps at once, so its core goes to the server
thread (or to the preempted member, which the kernel moves there) and the serving work costs
only its own CPU time; each parallel region pays a futex wake instead.

Whatever the policy, the team must be the process's only OpenMP pool: with a second one (an
engine built on the main thread and stepped on another leaves the main thread's idle pool),
libgomp counts more threads than CPUs and cuts every spin to a thousand, so the team sleeps at
every barrier (``model_thread.py``: 13 % of a 2-core Zen 4 idle while serving, gone once the
engine is built on its loop thread).

Offline use (``LLM``) has no server threads and keeps libgomp's default; only ``quire engine``
applies a plan, before torch (and libgomp with it) is loaded. Its default is libgomp's own too:
on a shared 2-core Zen 3 ``passive`` made no difference that the noise did not swamp; try it
where the serving process has its cores to itself (``--omp-wait-policy passive``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

# the ``omp_wait_policy`` values -> what libgomp is told (None: libgomp's own default)
WAIT_POLICIES: dict[str, str | None] = {"passive": "PASSIVE", "active": "ACTIVE",
                                        "default": None}


def check_wait_policy(value: str) -> None:
    if value not in WAIT_POLICIES:
        raise ValueError(f"omp_wait_policy: must be one of {', '.join(WAIT_POLICIES)}, "
                         f"got {value!r}")


@dataclass(frozen=True, slots=True)
class ThreadPlan:
    """The serving process's thread settings, applied once at start."""

    omp_wait_policy: str  # a WAIT_POLICIES key

    def __post_init__(self) -> None:
        check_wait_policy(self.omp_wait_policy)

    def environment(self) -> dict[str, str]:
        """The variables libgomp reads when it loads (so: set before torch is imported)."""
        policy = WAIT_POLICIES[self.omp_wait_policy]
        return {} if policy is None else {"OMP_WAIT_POLICY": policy}

    def describe(self, num_threads: int, num_cpus: int | None = None) -> str:
        """One line for the start block: who runs on the cores."""
        num_cpus = num_cpus or len(os.sched_getaffinity(0))
        wait = {"passive": "idle team threads sleep at once (server work takes only its own "
                           "CPU time)",
                "active": "idle team threads spin",
                "default": "libgomp's default wait (spin, then sleep)"}[self.omp_wait_policy]
        workers = num_threads - 1
        return (f"{num_cpus} CPUs: the model on {num_threads} OpenMP "
                f"thread{'s' if num_threads != 1 else ''} (the engine loop "
                f"and {workers} worker{'s' if workers != 1 else ''}; the loop thread built the "
                f"engine too, so theirs is the process's one OpenMP pool), the gRPC server on "
                f"the main thread beside them; OpenMP wait policy {self.omp_wait_policy}: "
                f"{wait}")
