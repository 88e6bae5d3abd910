"""speculative_config parsing (errors name the field), the ngram proposer, the speculator's
adaptive rules and the acceptance rule: pure Python, exact."""

from __future__ import annotations

import numpy as np
import pytest

from engine_worker.config import EngineArgs
from engine_worker.spec_decode.config import SpeculativeConfig
from engine_worker.spec_decode.methods import build_speculator
from engine_worker.spec_decode.ngram import NgramProposer
from engine_worker.spec_decode.rejection_sampler import accepted_tokens, num_accepted
from engine_worker.spec_decode.speculator import MAX_BACKOFF_STEPS


def test_parses_vllm_json_and_dicts_with_defaults_filled_in():
    cfg = SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 3}')
    assert (cfg.method, cfg.num_speculative_tokens) == ("ngram", 3)
    assert (cfg.prompt_lookup_max, cfg.prompt_lookup_min) == (5, 2)
    assert SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 2,
                                    "prompt_lookup_max": 3, "prompt_lookup_min": 3}
                                   ).prompt_lookup_min == 3
    assert SpeculativeConfig.parse({"model": "/d", "num_speculative_tokens": 2}).method == \
        "draft_model"
    for off in (None, "", "null"):
        assert SpeculativeConfig.parse(off) is None
    config = EngineArgs(speculative_config='{"method": "ngram", "num_speculative_tokens": 4}'
                        ).create_engine_config()
    assert config.speculative.num_speculative_tokens == 4
    assert '"num_speculative_tokens": 4' in config.speculative.to_json()


@pytest.mark.parametrize("value, field", [
    ('{"method": "ngram"', "speculative_config: not valid JSON"),
    ("[1]", "speculative_config: must be a JSON object"),
    ({"method": "eagle", "num_speculative_tokens": 2}, "speculative_config.method"),
    ({"num_speculative_tokens": 2}, "speculative_config.method"),
    ({"method": "ngram"}, "speculative_config.num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "speculative_config.num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": "4"},
     "speculative_config.num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 0},
     "speculative_config.prompt_lookup_max"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 2,
      "prompt_lookup_min": 3}, "speculative_config.prompt_lookup_min"),
    ({"method": "ngram", "num_speculative_tokens": 2, "lookahead": 1},
     "speculative_config.lookahead"),
    ({"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 0},
     "speculative_config.disable_by_batch_size"),
    ({"method": "ngram", "num_speculative_tokens": 2, "model": "/d"}, "speculative_config.model"),
    ({"method": "draft_model", "num_speculative_tokens": 2}, "speculative_config.model"),
    ({"method": "suffix", "num_speculative_tokens": 2, "prompt_lookup_max": 3},
     "speculative_config.prompt_lookup_max"),
])
def test_bad_configs_name_the_field(value, field):
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        SpeculativeConfig.parse(value)


def test_ngram_takes_the_longest_then_most_recent_match_with_a_full_draft():
    proposer = NgramProposer(prompt_lookup_max=3, prompt_lookup_min=1)
    # ... 1 2 3 [4 5 6] ... 9 2 3 [7 8] ... 2 3: "1 2 3"? no; "2 3" twice: the later one wins
    tokens = np.array([1, 2, 3, 4, 5, 6, 9, 2, 3, 7, 8, 0, 2, 3])
    assert proposer.propose("r", tokens, 2) == (7, 8)
    # a 3-gram match beats a later 2-gram match
    tokens = np.array([1, 2, 3, 4, 5, 6, 9, 2, 3, 7, 8, 1, 2, 3])
    assert proposer.propose("r", tokens, 3) == (4, 5, 6)
    # the later match has only 1 token after it before the end: the earlier, full one wins
    tokens = np.array([5, 5, 5, 5, 5, 5])
    assert proposer.propose("r", tokens, 3) == (5, 5, 5)
    assert proposer.propose("r", np.array([1, 2, 3, 4]), 3) == ()  # nothing recurs
    assert NgramProposer(3, 2).propose("r", np.array([1, 2, 9, 2]), 3) == ()  # 1-gram only


def test_speculator_shrinks_on_rejection_backs_off_and_counts():
    spec = build_speculator(SpeculativeConfig("ngram", 4, prompt_lookup_max=2,
                                              prompt_lookup_min=1, disable_by_batch_size=2))
    # the batch rule: at most 8 tokens a step on a CPU, none past disable_by_batch_size
    assert [spec.step_draft_budget(n) for n in (1, 2, 3)] == [7, 6, 0]
    assert build_speculator(SpeculativeConfig("ngram", 4), "cuda").step_draft_budget(4) == 252
    prompt = [1, 2, 3, 4, 5, 6, 7, 8, 9, 1]
    assert spec.propose("r", prompt, [], room=10) == (2, 3, 4, 5)
    assert spec.propose("r", prompt, [], room=2) == (2, 3)  # the room caps it
    spec.record("r", 4, 1)  # one of four accepted: next time two
    assert spec.propose("r", prompt, [], room=10) == (2, 3)
    spec.record("r", 2, 2)  # all accepted: one more
    assert len(spec.propose("r", prompt, [], room=10)) == 3
    spec.record("r", 3, 0)
    assert len(spec.propose("r", prompt, [], room=10)) == 1
    waits = []
    for _ in range(8):  # rejected at one draft again and again: 1, 2, 4, ... steps of waiting
        spec.record("r", 1, 0)
        n = 0
        while spec.propose("r", prompt, [], room=10) == ():
            n += 1
        waits.append(n)
    assert waits == [1, 2, 4, 8, 16, 32, MAX_BACKOFF_STEPS, MAX_BACKOFF_STEPS]
    spec.record("r", 1, 1)  # an acceptance ends the back-off
    assert spec.propose("r", prompt, [], room=10) != ()
    stats = spec.stats()
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (12, 18, 4)
    assert stats.num_accepted_tokens_per_pos == (3, 1, 0, 0)


def test_acceptance_is_the_longest_matching_prefix_then_the_targets_token():
    assert num_accepted((5, 6, 7), (5, 6, 9, 4)) == 2
    assert accepted_tokens((5, 6, 7), (5, 6, 9, 4)) == (5, 6, 9)
    assert accepted_tokens((5, 6, 7), (1, 6, 7, 4)) == (1,)
    assert accepted_tokens((5, 6, 7), (5, 6, 7, 4)) == (5, 6, 7, 4)


def test_the_engine_flag_takes_vllms_json():
    import argparse

    from engine_worker.arg_utils import add_engine_args, engine_args_from_namespace

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    ns = parser.parse_args(["--speculative-config",
                            '{"method": "ngram", "num_speculative_tokens": 2}'])
    config = engine_args_from_namespace(ns).create_engine_config()
    assert config.speculative.num_speculative_tokens == 2
    assert engine_args_from_namespace(parser.parse_args([])).create_engine_config(
    ).speculative is None
    ns = parser.parse_args(["--speculative-config", '{"method": "ngram"}'])
    with pytest.raises(ValueError, match=r"speculative_config\.num_speculative_tokens"):
        engine_args_from_namespace(ns).create_engine_config()


def test_start_block_and_metrics_show_the_config():
    from engine_worker.metrics import EngineMetrics
    from engine_worker.progress import start_summary
    from engine_worker.spec_decode.stats import SpecDecodingStats
    from tests.unit.engine_infos import engine_info

    cfg = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 2})
    info = engine_info(speculative_config=cfg.to_json())
    assert f"  Speculative decoding: {cfg.to_json()}" in start_summary(info, elapsed_s=1.0)
    assert "Speculative" not in start_summary(engine_info(), elapsed_s=1.0)
    metrics = EngineMetrics("m", info)
    for stats in (SpecDecodingStats(3, 6, 4, (3, 1)), SpecDecodingStats(5, 10, 7, (5, 2))):
        metrics.observe_step(num_running=0, num_waiting=0, kv_cache_usage=0.0,
                             prefix_cache_queries=0, prefix_cache_hits=0, num_preemptions=0,
                             spec_decoding=stats)
    text = metrics.render().decode()
    assert 'vllm:spec_decode_num_drafts_total{model_name="m"} 5.0' in text
    assert 'vllm:spec_decode_num_draft_tokens_total{model_name="m"} 10.0' in text
    assert 'vllm:spec_decode_num_accepted_tokens_total{model_name="m"} 7.0' in text
    assert ('vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="1"} '
            '2.0') in text
    assert "spec_decode" not in EngineMetrics("m", engine_info()).render().decode()


def test_quire_up_passes_the_json_on_to_its_engines():
    import argparse

    from engine_worker.arg_utils import add_server_engine_args
    from quire_cli.stack import changed_engine_flags

    parser = argparse.ArgumentParser()
    add_server_engine_args(parser)
    spec = '{"method": "suffix", "num_speculative_tokens": 3}'
    flags = changed_engine_flags(parser.parse_args(["--speculative-config", spec]))
    assert flags == ["--speculative-config", spec]
    again = parser.parse_args(flags)  # what `quire engine` parses
    assert SpeculativeConfig.parse(again.speculative_config).method == "suffix"
