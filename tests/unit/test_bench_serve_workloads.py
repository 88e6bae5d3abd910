"""`quire bench serve`'s workloads: exact prompt shapes from the seed, no engines."""

from __future__ import annotations

import pytest

from quire_cli.bench.serve import make_workload, policy_order
from quire_cli.bench.serve_config import ServeBenchConfig
from quire_cli.bench.serve_report import compare, medians


def test_hot_prefix_puts_one_system_prompt_on_its_share_of_requests():
    cfg = ServeBenchConfig(num_groups=4, prompts_per_group=10, system_prompt_len=64,
                           question_len=8, hot_share=0.8)
    workload = make_workload("hot_prefix", cfg, vocab_size=49152, seed=3)
    assert len(workload.prompts) == 40 and {len(p) for p in workload.prompts} == {72}
    heads = [p[:64] for p in workload.prompts]
    hot = max(set(heads), key=heads.count)
    assert heads.count(hot) == 32 and len(set(heads)) == 1 + 8  # the rest are unique
    assert make_workload("hot_prefix", cfg, vocab_size=49152, seed=3) == workload


def test_hot_prefix_other_requests_share_other_system_prompts_when_asked():
    cfg = ServeBenchConfig(num_groups=4, prompts_per_group=10, system_prompt_len=64,
                           question_len=8, hot_share=0.8, other_prompts=3)
    workload = make_workload("hot_prefix", cfg, vocab_size=49152, seed=3)
    assert len(workload.prompts) == 40 and {len(p) for p in workload.prompts} == {72}
    heads = [p[:64] for p in workload.prompts]
    hot = max(set(heads), key=heads.count)
    others = sorted(heads.count(h) for h in set(heads) if h != hot)
    assert heads.count(hot) == 32 and others == [2, 3, 3]  # 8 others over 3 system prompts
    assert len({p[64:] for p in workload.prompts}) == 40  # every question its own
    # the unique-prompt workload is what it was without the setting
    plain = make_workload("hot_prefix", ServeBenchConfig(
        num_groups=4, prompts_per_group=10, system_prompt_len=64, question_len=8),
        vocab_size=49152, seed=3)
    assert len({p[:64] for p in plain.prompts}) == 1 + 8


@pytest.mark.parametrize("fields, message", [
    ({"hot_share": 1.5}, "hot_share"), ({"num_routers": 0}, "num_routers"),
    ({"other_prompts": -1}, "other_prompts"),
    ({"workloads": "hot"}, "workloads"), ({"repeats": 0}, "repeats")])
def test_bad_settings_name_the_field(fields, message):
    with pytest.raises(ValueError, match=message):
        ServeBenchConfig(**fields)


def test_repeats_rotate_the_policy_order_so_each_takes_every_place():
    names = ("prefix_aware", "prefix_affinity", "least_loaded")
    orders = [policy_order(names, r) for r in range(4)]
    assert orders[0] == names and orders[3] == names
    assert orders[1] == ("prefix_affinity", "least_loaded", "prefix_aware")
    for place in range(3):  # over three repeats each policy runs once in each place
        assert {order[place] for order in orders[:3]} == set(names)


def _run(policy: str, repeat: int, p50: float, p90: float, throughput: float) -> dict:
    return {"workload": "hot_prefix", "policy": policy, "repeat": repeat,
            "ttft_ms": {"p50": p50, "p90": p90}, "output_token_throughput": throughput,
            "cache_hit_rate": 0.7}


def test_repeated_runs_are_compared_by_their_medians_with_each_pair_kept():
    runs = [_run("prefix_aware", 0, 100, 1000, 50), _run("least_loaded", 0, 200, 900, 40),
            _run("least_loaded", 1, 300, 1500, 60), _run("prefix_aware", 1, 120, 1300, 55),
            _run("prefix_aware", 2, 500, 5000, 10), _run("least_loaded", 2, 150, 1200, 50)]
    mid = medians(runs)["hot_prefix"]
    assert mid["prefix_aware"] == {"num_runs": 3, "ttft_p50_ms": 120, "ttft_p90_ms": 1300,
                                   "output_token_throughput": 50, "cache_hit_rate": 0.7}
    assert mid["least_loaded"]["ttft_p90_ms"] == 1200
    c = compare(runs)["hot_prefix"]["least_loaded"]
    assert c["num_runs"] == 3
    assert c["ttft_p50_speedup"] == pytest.approx(200 / 120)
    assert c["ttft_p90_speedup"] == pytest.approx(1200 / 1300)
    assert c["ttft_p90_speedup_per_repeat"] == pytest.approx([0.9, 1500 / 1300, 1200 / 5000])
    assert c["throughput_ratio"] == pytest.approx(1.0)
    # one run each: the medians are that run's figures, as before repeats existed
    single = compare(runs[:2])["hot_prefix"]["least_loaded"]
    assert single["num_runs"] == 1 and single["ttft_p90_speedup"] == pytest.approx(0.9)
