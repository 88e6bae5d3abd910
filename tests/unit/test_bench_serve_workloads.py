"""`quire bench serve`'s workloads: exact prompt shapes from the seed, no engines."""

from __future__ import annotations

import pytest

from quire_cli.bench.serve import make_workload
from quire_cli.bench.serve_config import ServeBenchConfig


def test_hot_prefix_puts_one_system_prompt_on_its_share_of_requests():
    cfg = ServeBenchConfig(num_groups=4, prompts_per_group=10, system_prompt_len=64,
                           question_len=8, hot_share=0.8)
    workload = make_workload("hot_prefix", cfg, vocab_size=49152, seed=3)
    assert len(workload.prompts) == 40 and {len(p) for p in workload.prompts} == {72}
    heads = [p[:64] for p in workload.prompts]
    hot = max(set(heads), key=heads.count)
    assert heads.count(hot) == 32 and len(set(heads)) == 1 + 8  # the rest are unique
    assert make_workload("hot_prefix", cfg, vocab_size=49152, seed=3) == workload


@pytest.mark.parametrize("fields, message", [
    ({"hot_share": 1.5}, "hot_share"), ({"num_routers": 0}, "num_routers"),
    ({"workloads": "hot"}, "workloads")])
def test_bad_settings_name_the_field(fields, message):
    with pytest.raises(ValueError, match=message):
        ServeBenchConfig(**fields)
