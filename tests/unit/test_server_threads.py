"""The serving process's thread plan: what libgomp is told, and bad values named."""

from __future__ import annotations

import pytest

from engine_worker.server.config import ServerConfig
from engine_worker.server.threads import ThreadPlan


@pytest.mark.parametrize("policy, env", [("passive", {"OMP_WAIT_POLICY": "PASSIVE"}),
                                         ("active", {"OMP_WAIT_POLICY": "ACTIVE"}),
                                         ("default", {})])
def test_the_wait_policy_becomes_libgomps_variable_or_nothing(policy, env):
    plan = ThreadPlan(policy)
    assert plan.environment() == env
    line = plan.describe(num_threads=2, num_cpus=2)
    assert line.startswith("2 CPUs: the model on 2 OpenMP threads (the engine loop and 1 worker; "
                           "the loop thread built the engine too, so theirs is the process's one "
                           "OpenMP pool)")
    assert f"wait policy {policy}" in line


def test_the_server_leaves_libgomps_default_unless_told_otherwise():
    assert ServerConfig().omp_wait_policy == "default"
    assert ThreadPlan(ServerConfig().omp_wait_policy).environment() == {}
    with pytest.raises(ValueError, match="omp_wait_policy"):
        ServerConfig(omp_wait_policy="spin")
