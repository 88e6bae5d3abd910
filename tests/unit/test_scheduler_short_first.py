"""Short prompts first (``Scheduler(short_prompts_first=True)``, the servers' default): a prompt
that would cost more than the rest of its step together waits one step, once, while the
shorter prompts behind it run; prompts of like length still share a step. Exact, on the fake
runner of scheduler_harness.py (which checks every step's KV contents)."""

from __future__ import annotations

import argparse

import pytest

from engine_worker.request import RequestStatus
from tests.unit.scheduler_harness import (assert_all_blocks_free, make_request, setup, step,
                                          waiting_ids)


def _drain(sched, runner) -> None:
    while sched.has_unfinished_requests():
        step(sched, runner)
    step(sched, runner)
    assert_all_blocks_free(sched)


def test_a_short_prompt_behind_a_long_one_runs_first_and_the_long_one_next():
    sched, runner = setup(max_num_batched_tokens=64, short_prompts_first=True)
    sched.add_request(make_request("long", 40, max_tokens=3))
    sched.add_request(make_request("short", 4, max_tokens=3, first_token=300))
    out, core = step(sched, runner)
    assert out.num_scheduled_tokens == {"short": 4}
    assert [c.req_id for c in core] == ["short"]  # its first token, a step early
    assert waiting_ids(sched) == ["long"]
    assert sched.num_prompts_passed == 1
    out, core = step(sched, runner)
    assert out.num_scheduled_tokens == {"short": 1, "long": 40}
    assert [c.req_id for c in core] == ["short", "long"]
    _drain(sched, runner)


def test_a_long_prompt_behind_a_short_one_waits_too():
    """The short prompt came first: joining its step, the long one would still hold its first
    token back by all of its own tokens."""
    sched, runner = setup(max_num_batched_tokens=64, short_prompts_first=True)
    sched.add_request(make_request("short", 4, max_tokens=3, first_token=300))
    sched.add_request(make_request("long", 40, max_tokens=3))
    sched.add_request(make_request("later", 2, max_tokens=3, first_token=400))
    out, core = step(sched, runner)
    assert out.num_scheduled_tokens == {"short": 4, "later": 2}
    assert waiting_ids(sched) == ["long"]
    out, _ = step(sched, runner)
    assert out.num_scheduled_tokens == {"short": 1, "later": 1, "long": 40}
    _drain(sched, runner)


def test_a_long_prompt_with_decodes_only_beside_it_is_not_held():
    """No shorter prompt to gain: holding it would only delay it."""
    sched, runner = setup(max_num_batched_tokens=64, short_prompts_first=True)
    sched.add_request(make_request("d", 2, max_tokens=8))
    step(sched, runner)
    sched.add_request(make_request("long", 40, first_token=300))
    out, _ = step(sched, runner)
    assert out.num_scheduled_tokens == {"d": 1, "long": 40}
    assert sched.num_prompts_passed == 0


def test_without_it_the_short_prompt_waits_for_the_long_ones_step():
    sched, runner = setup(max_num_batched_tokens=64)  # the offline default
    sched.add_request(make_request("long", 40))
    sched.add_request(make_request("short", 4, first_token=300))
    out, _ = step(sched, runner)
    assert out.num_scheduled_tokens == {"long": 40, "short": 4}
    assert sched.num_prompts_passed == 0


def test_a_long_prompt_waits_once_so_a_stream_of_short_ones_cannot_starve_it():
    sched, runner = setup(max_num_batched_tokens=64, short_prompts_first=True)
    sched.add_request(make_request("long", 40, max_tokens=2))
    sched.add_request(make_request("s1", 4, max_tokens=2, first_token=300))
    assert step(sched, runner)[0].num_scheduled_tokens == {"s1": 4}
    sched.add_request(make_request("s2", 4, max_tokens=2, first_token=400))
    out, _ = step(sched, runner)  # held once already: it runs, and s2 joins its step
    assert out.num_scheduled_tokens == {"s1": 1, "long": 40, "s2": 4}
    assert sched.requests["long"].passed_by_shorter
    _drain(sched, runner)


def test_prompts_of_like_length_share_a_step():
    """A burst of near-equal prompts (the serving benchmark's) is never split: the shorter ones
    together outweigh any one of them."""
    sched, runner = setup(max_num_batched_tokens=64, short_prompts_first=True)
    for i, n in enumerate((12, 11, 12, 10, 12)):
        sched.add_request(make_request(f"r{i}", n, first_token=100 * (i + 1)))
    out, _ = step(sched, runner)
    assert out.num_scheduled_tokens == {"r0": 12, "r1": 11, "r2": 12, "r3": 10, "r4": 12}
    assert sched.num_prompts_passed == 0


def test_two_long_prompts_wait_together_and_keep_their_order():
    sched, runner = setup(max_num_batched_tokens=64, num_blocks=128, short_prompts_first=True)
    sched.add_request(make_request("p", 24))
    sched.add_request(make_request("q", 24, first_token=200))
    sched.add_request(make_request("h", 4, first_token=300))
    out, _ = step(sched, runner)
    assert out.num_scheduled_tokens == {"h": 4}
    assert waiting_ids(sched) == ["p", "q"]
    out, _ = step(sched, runner)
    assert out.num_scheduled_tokens == {"h": 1, "p": 24, "q": 24}
    _drain(sched, runner)


def test_a_long_prompt_does_not_wait_where_the_step_is_already_as_long():
    """Running requests' tokens count: a prompt no longer than what the step computes anyway
    at most doubles it, so it joins."""
    sched, runner = setup(max_num_batched_tokens=64, num_blocks=128, max_num_seqs=32,
                          short_prompts_first=True)
    for i in range(6):  # six decodes: 6 tokens a step
        sched.add_request(make_request(f"d{i}", 1, max_tokens=8, first_token=100 * (i + 1)))
    step(sched, runner)
    sched.add_request(make_request("five", 5, first_token=800))
    sched.add_request(make_request("one", 1, first_token=900))
    out, _ = step(sched, runner)  # 5 tokens against 6 decodes + 1: it joins
    assert out.num_scheduled_tokens == {**{f"d{i}": 1 for i in range(6)}, "five": 5, "one": 1}
    sched.add_request(make_request("eight", 8, first_token=1000))
    sched.add_request(make_request("two", 1, first_token=1100))
    out, _ = step(sched, runner)  # 8 tokens against 8 decodes + 1: it joins too
    assert out.num_scheduled_tokens["eight"] == 8 and out.num_scheduled_tokens["two"] == 1
    assert sched.num_prompts_passed == 0
    sched.add_request(make_request("twenty", 20, first_token=1200))
    sched.add_request(make_request("three", 1, first_token=1300))
    out, _ = step(sched, runner)  # 20 against 10 decodes + 1: it waits a step
    assert "twenty" not in out.num_scheduled_tokens and out.num_scheduled_tokens["three"] == 1
    assert sched.num_prompts_passed == 1
    _drain(sched, runner)


def test_a_shorter_prompt_of_a_worse_priority_does_not_pass():
    sched, runner = setup(max_num_batched_tokens=64, policy="priority", short_prompts_first=True)
    sched.add_request(make_request("long", 40, priority=0))
    sched.add_request(make_request("low", 4, priority=5, first_token=300))
    out, _ = step(sched, runner)
    assert out.num_scheduled_tokens == {"long": 40, "low": 4}
    sched, runner = setup(max_num_batched_tokens=64, policy="priority", short_prompts_first=True)
    sched.add_request(make_request("long", 40, priority=1))
    sched.add_request(make_request("urgent", 4, priority=0, first_token=300))
    sched.add_request(make_request("same", 4, priority=1, first_token=400, arrival_time=1.0))
    out, _ = step(sched, runner)  # urgent leads anyway; same passes long (equal priority)
    assert out.num_scheduled_tokens == {"urgent": 4, "same": 4}
    assert waiting_ids(sched) == ["long"]


def test_cached_tokens_do_not_count_only_the_ones_left_to_compute():
    """A prompt whose prefix the cache holds is short whatever its length: the hot request of a
    shared system prompt passes a cold prompt, not the other way round."""
    sched, runner = setup(max_num_batched_tokens=64, num_blocks=128, enable_prefix_caching=True,
                          short_prompts_first=True)
    sched.add_request(make_request("warm", 36, max_tokens=1))
    _drain(sched, runner)
    sched.add_request(make_request("cold", 36, first_token=500))
    sched.add_request(make_request("hot", 36))  # the same 36 tokens: 32 of them cached
    out, _ = step(sched, runner)
    assert list(out.num_scheduled_tokens) == ["hot"]  # its last block's tokens only
    assert out.num_scheduled_tokens["hot"] < 8
    assert sched.requests["cold"].status == RequestStatus.WAITING


def test_servers_put_short_prompts_first_and_llm_does_not(monkeypatch):
    from engine_worker.arg_utils import (add_engine_args, add_server_engine_args,
                                         engine_args_from_namespace)
    from engine_worker.config import EngineArgs

    monkeypatch.delenv("QUIRE_SHORT_PROMPTS_FIRST", raising=False)
    assert EngineArgs().create_engine_config().scheduler.short_prompts_first is False
    server, offline = argparse.ArgumentParser(), argparse.ArgumentParser()
    add_server_engine_args(server)
    add_engine_args(offline)
    assert engine_args_from_namespace(server.parse_args([])).short_prompts_first is True
    assert engine_args_from_namespace(offline.parse_args([])).short_prompts_first is False
    assert server.parse_args(["--short-prompts-first", "false"]).short_prompts_first is False
    with pytest.raises(ValueError, match="short_prompts_first"):
        EngineArgs(short_prompts_first="yes").create_engine_config()
