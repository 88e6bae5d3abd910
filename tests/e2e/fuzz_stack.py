"""The stack both fuzz suites run against: one tiny-model engine and a router with its HTTP
front, one of each per test module. A module imports ``engine`` and ``router`` from here, and
pytest finds them as that module's fixtures."""

from __future__ import annotations

import pytest

from tests.e2e.router_harness import RunningRouter, address, start_engine

MODEL = "tiny"  # the name the router serves
# an operator's output cap on both fronts (the default is none): a drawn max_tokens above it
# is refused rather than run to the model's length, which keeps each example quick
CAP = 4096


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    running = start_engine(tiny_model_dir, max_tokens_limit=CAP)
    yield running
    running.close()


@pytest.fixture(scope="module")
def router(engine):
    running = RunningRouter([address(engine)], http_port=0, model_name=MODEL,
                            max_tokens_limit=CAP)
    yield running
    running.close()
