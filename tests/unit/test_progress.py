"""Progress lines for the steps a user waits on at start."""

from __future__ import annotations

import logging
import time

import pytest

from engine_worker.progress import progress

LOGGER = logging.getLogger("tests.progress")


def test_a_step_says_when_it_starts_while_it_runs_and_when_it_ends(caplog):
    caplog.set_level(logging.INFO, logger=LOGGER.name)
    with progress(LOGGER, "Converting the model", expect="first start only",
                  heartbeat_s=0.05):
        time.sleep(0.3)
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0] == "Converting the model (first start only)..."
    assert lines[-1].startswith("Converting the model: done in 0.")
    beats = lines[1:-1]
    assert len(beats) >= 2 and all(b.startswith("Converting the model: still running, ")
                                   for b in beats)


def test_a_failing_step_stops_its_heartbeat_and_says_nothing_done(caplog):
    caplog.set_level(logging.INFO, logger=LOGGER.name)
    with pytest.raises(RuntimeError):
        with progress(LOGGER, "Building", heartbeat_s=0.01):
            raise RuntimeError("no compiler")
    count = len(caplog.records)
    time.sleep(0.05)
    assert len(caplog.records) == count  # no ticker left running
    assert not any("done in" in r.getMessage() for r in caplog.records)
