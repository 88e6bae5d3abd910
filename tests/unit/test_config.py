"""Config and sampling-parameter validation: every bad value raises ValueError naming its field."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest

from engine_worker.config import (CacheConfig, DeviceConfig, EngineArgs, EngineConfig,
                                  ModelConfig, SchedulerConfig, normalize_dtype, quire_cache_dir)
from engine_worker.sampling_params import RequestOutputKind, SamplingParams


def raises_for(field: str):
    """ValueError whose message starts with ``field`` followed by a colon."""
    return pytest.raises(ValueError, match=rf"^{field}: ")


# ----------------------------------------------------------------------------- ModelConfig
def test_model_config_defaults():
    config = ModelConfig()
    assert (config.model, config.tokenizer, config.dtype, config.max_model_len, config.seed) == \
        (None, None, "auto", None, 0)


@pytest.mark.parametrize("spelling, canonical", [
    ("auto", "auto"), ("bf16", "bfloat16"), ("BF16", "bfloat16"), ("bfloat16", "bfloat16"),
    ("fp16", "float16"), ("half", "float16"), ("torch.float16", "float16"),
    ("float", "float32"), ("fp32", "float32"), ("torch.float32", "float32"),
])
def test_dtype_spellings_are_normalised(spelling, canonical):
    assert normalize_dtype(spelling) == canonical
    assert ModelConfig(dtype=spelling).dtype == canonical


@pytest.mark.parametrize("dtype", ["int8", "float64", "", "torch.bf16x", None])
def test_model_config_rejects_unknown_dtype(dtype):
    with raises_for("dtype"):
        ModelConfig(dtype=dtype)


@pytest.mark.parametrize("value", [0, -1, 1.5, "2048"])
def test_model_config_rejects_bad_max_model_len(value):
    with raises_for("max_model_len"):
        ModelConfig(max_model_len=value)


@pytest.mark.parametrize("value", [1.0, "0", None])
def test_model_config_rejects_bad_seed(value):
    with raises_for("seed"):
        ModelConfig(seed=value)


def test_configs_are_frozen():
    for config in (ModelConfig(), CacheConfig(), SchedulerConfig(), DeviceConfig(),
                   EngineConfig()):
        field = dataclasses.fields(config)[0].name
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(config, field, getattr(config, field))


# ----------------------------------------------------------------------------- CacheConfig
@pytest.mark.parametrize("block_size", [1, 2, 4, 8, 16, 32, 64, 128, 256])
def test_cache_config_accepts_powers_of_two(block_size):
    assert CacheConfig(block_size=block_size).block_size == block_size


@pytest.mark.parametrize("block_size", [0, -16, 3, 12, 512, 16.0, "16", None])
def test_cache_config_rejects_bad_block_size(block_size):
    with raises_for("block_size"):
        CacheConfig(block_size=block_size)


@pytest.mark.parametrize("value", [0, -1, 1.5, "1GiB"])
def test_cache_config_rejects_bad_kv_cache_memory_bytes(value):
    with raises_for("kv_cache_memory_bytes"):
        CacheConfig(kv_cache_memory_bytes=value)


@pytest.mark.parametrize("value", [0.0, -0.1, 1.01, 2, math.nan])
def test_cache_config_rejects_bad_memory_utilization(value):
    with raises_for("gpu_memory_utilization"):
        CacheConfig(gpu_memory_utilization=value)


def test_cache_config_accepts_edge_values():
    config = CacheConfig(kv_cache_memory_bytes=1, gpu_memory_utilization=1.0)
    assert (config.kv_cache_memory_bytes, config.gpu_memory_utilization) == (1, 1.0)


# ------------------------------------------------------------------------- SchedulerConfig
@pytest.mark.parametrize("value", [0, -1, 1.5, "2048"])
def test_scheduler_config_rejects_bad_max_num_batched_tokens(value):
    with raises_for("max_num_batched_tokens"):
        SchedulerConfig(max_num_batched_tokens=value)


@pytest.mark.parametrize("value", [0, -1, 2.0])
def test_scheduler_config_rejects_bad_max_num_seqs(value):
    with raises_for("max_num_seqs"):
        SchedulerConfig(max_num_seqs=value)


@pytest.mark.parametrize("value", [-1, 0.5, "0"])
def test_scheduler_config_rejects_bad_long_prefill_token_threshold(value):
    with raises_for("long_prefill_token_threshold"):
        SchedulerConfig(long_prefill_token_threshold=value)


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_scheduler_config_accepts_known_policies(policy):
    assert SchedulerConfig(scheduling_policy=policy).scheduling_policy == policy


@pytest.mark.parametrize("policy", ["lifo", "FCFS", ""])
def test_scheduler_config_rejects_unknown_policy(policy):
    with pytest.raises(ValueError, match="must be one of"):
        SchedulerConfig(scheduling_policy=policy)


def test_scheduler_config_policy_error_names_the_field():
    with raises_for("scheduling_policy"):
        SchedulerConfig(scheduling_policy="lifo")


# ---------------------------------------------------------------------------- DeviceConfig
@pytest.mark.parametrize("device", ["auto", "cpu", "cuda", "cuda:0", "cuda:3"])
def test_device_config_accepts_devices(device):
    assert DeviceConfig(device=device).device == device


@pytest.mark.parametrize("device", ["tpu", "gpu", "", "mps", "CUDA"])
def test_device_config_rejects_unknown_device(device):
    with raises_for("device"):
        DeviceConfig(device=device)


@pytest.mark.parametrize("value", [0, -2, 1.5, "4"])
def test_device_config_rejects_bad_num_threads(value):
    with raises_for("num_threads"):
        DeviceConfig(num_threads=value)


@pytest.mark.parametrize("device", ["cuda:x", "cuda:", "cuda:-1", "cpu:0:1", None, 0])
def test_device_config_rejects_malformed_device_strings(device):
    with raises_for("device"):
        DeviceConfig(device=device)


# ---------------------------------------------------------------------- EngineArgs mapping
def test_engine_args_build_every_config_group():
    config = EngineArgs(model="m", tokenizer="t", dtype="bf16", max_model_len=512,
                        block_size=32, kv_cache_memory_bytes=1 << 20,
                        gpu_memory_utilization=0.5, max_num_seqs=3,
                        max_num_batched_tokens=100, scheduling_policy="priority",
                        long_prefill_token_threshold=7, seed=11, device="cpu",
                        num_threads=2, num_scheduler_steps=3).create_engine_config()
    assert config == EngineConfig(
        model=ModelConfig(model="m", tokenizer="t", dtype="bfloat16", max_model_len=512, seed=11),
        cache=CacheConfig(block_size=32, kv_cache_memory_bytes=1 << 20, gpu_memory_utilization=0.5),
        scheduler=SchedulerConfig(max_num_batched_tokens=100, max_num_seqs=3, scheduling_policy="priority",
                                  long_prefill_token_threshold=7, num_scheduler_steps=3),
        device=DeviceConfig(device="cpu", num_threads=2))


@pytest.mark.parametrize("value", [0, -1, 65, 2.0, "8", True])
def test_scheduler_config_rejects_bad_num_scheduler_steps(value):
    with raises_for("num_scheduler_steps"):
        SchedulerConfig(num_scheduler_steps=value)


def test_num_scheduler_steps_is_one_on_servers_and_eight_offline():
    import argparse

    from engine_worker.arg_utils import (add_engine_args, add_server_engine_args,
                                         add_streaming_engine_args, engine_args_from_namespace)
    server, offline, terminal = (argparse.ArgumentParser() for _ in range(3))
    add_server_engine_args(server)
    add_engine_args(offline)
    add_streaming_engine_args(terminal)
    assert engine_args_from_namespace(server.parse_args([])).num_scheduler_steps == 1
    assert engine_args_from_namespace(terminal.parse_args([])).num_scheduler_steps == 1
    assert engine_args_from_namespace(offline.parse_args([])).num_scheduler_steps == 8
    assert engine_args_from_namespace(
        server.parse_args(["--num-scheduler-steps", "4"])).num_scheduler_steps == 4


def test_engine_args_defaults_match_config_defaults():
    assert EngineArgs().create_engine_config() == EngineConfig()


def test_enforce_eager_is_a_validated_flag():
    import argparse

    from engine_worker.arg_utils import add_engine_args, engine_args_from_namespace

    assert EngineArgs(enforce_eager=True).create_engine_config().device.enforce_eager is True
    with raises_for("enforce_eager"):
        DeviceConfig(enforce_eager=1)
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    parse = lambda *argv: engine_args_from_namespace(parser.parse_args(argv))  # noqa: E731
    assert parse().enforce_eager is False
    assert parse("--enforce-eager").enforce_eager is True  # vLLM's spelling: the flag alone
    assert parse("--enforce-eager", "false").enforce_eager is False
    args = parse("--enable-prefix-caching", "false", "--enforce-eager", "--device", "cpu")
    assert (args.enable_prefix_caching, args.enforce_eager, args.device) == (False, True, "cpu")


def test_engine_args_errors_name_the_field():
    with raises_for("block_size"):
        EngineArgs(block_size=3).create_engine_config()
    with raises_for("max_num_seqs"):
        EngineArgs(max_num_seqs=0).create_engine_config()


# --------------------------------------------------------------------------- cache dir env
def test_quire_cache_dir_prefers_quire_variable(monkeypatch, tmp_path):
    monkeypatch.setenv("QUIRE_CACHE_DIR", str(tmp_path / "q"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert quire_cache_dir() == tmp_path / "q"


def test_quire_cache_dir_falls_back_to_xdg_then_home(monkeypatch, tmp_path):
    monkeypatch.delenv("QUIRE_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert quire_cache_dir() == tmp_path / "xdg" / "quire"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert quire_cache_dir() == Path(tmp_path / "home" / ".cache" / "quire")


# -------------------------------------------------------------------------- SamplingParams
def test_sampling_params_defaults_and_normalisation():
    params = SamplingParams()
    assert (params.n, params.temperature, params.top_p, params.top_k, params.max_tokens) == \
        (1, 1.0, 1.0, -1, 16)
    assert params.stop == [] and params.stop_token_ids == []
    assert params.output_kind is RequestOutputKind.CUMULATIVE
    assert not params.is_greedy and not params.uses_penalties
    assert SamplingParams(stop="###").stop == ["###"]
    assert SamplingParams(stop=None, stop_token_ids=None).stop == []
    assert SamplingParams(top_k=None).top_k == -1
    assert SamplingParams(top_k=5).top_k == 5
    assert SamplingParams(temperature=0.0).is_greedy
    assert SamplingParams(presence_penalty=0.5).uses_penalties
    assert SamplingParams(max_tokens=None).max_tokens is None


def test_sampling_params_clone_copies_lists():
    params = SamplingParams(stop=["a"], stop_token_ids=[3], seed=1)
    child = params.clone(n=1, seed=2)
    child.stop.append("b")
    child.stop_token_ids.append(4)
    assert (params.stop, params.stop_token_ids, params.seed) == (["a"], [3], 1)
    assert child.seed == 2


def test_sampling_params_clone_revalidates():
    with raises_for("top_p"):
        SamplingParams().clone(top_p=0.0)


@pytest.mark.parametrize("field, value", [
    ("n", 0), ("n", -1), ("n", 1.5),
    ("temperature", -0.01), ("temperature", None),
    ("top_p", 0.0), ("top_p", 1.01), ("top_p", -0.5),
    ("top_k", -2), ("top_k", 1.5),
    ("min_p", -0.1), ("min_p", 1.1),
    ("repetition_penalty", 0.0), ("repetition_penalty", -1.0),
    ("presence_penalty", -2.01), ("presence_penalty", 2.01),
    ("frequency_penalty", -2.01), ("frequency_penalty", 2.01),
    ("max_tokens", 0), ("max_tokens", -5), ("max_tokens", 2.0),
    ("min_tokens", -1), ("min_tokens", 1.0),
    ("seed", 1.5), ("seed", "7"),
    ("logprobs", -1), ("logprobs", 1.0),
    ("prompt_logprobs", -1), ("prompt_logprobs", "2"),
    ("stop", [""]), ("stop", ["ok", 5]),
    ("stop_token_ids", [-1]), ("stop_token_ids", ["2"]), ("stop_token_ids", [1.0]),
])
def test_sampling_params_reject_bad_values(field, value):
    with raises_for(field):
        SamplingParams(**{field: value})


def test_min_tokens_may_not_exceed_max_tokens():
    with raises_for("min_tokens"):
        SamplingParams(max_tokens=4, min_tokens=5)
    assert SamplingParams(max_tokens=4, min_tokens=4).min_tokens == 4
    assert SamplingParams(max_tokens=None, min_tokens=1000).min_tokens == 1000


@pytest.mark.parametrize("field, value", [
    ("top_k", -1), ("top_k", 0), ("top_k", 1), ("temperature", 0.0), ("top_p", 1.0),
    ("min_p", 0.0), ("min_p", 1.0), ("presence_penalty", -2.0), ("frequency_penalty", 2.0),
    ("logprobs", 0), ("prompt_logprobs", 0), ("seed", 0), ("seed", 2**63 - 1),
])
def test_sampling_params_accept_edge_values(field, value):
    SamplingParams(**{field: value})


@pytest.mark.parametrize("field", ["temperature", "repetition_penalty", "top_p", "min_p",
                                   "presence_penalty", "frequency_penalty"])
@pytest.mark.parametrize("value", [math.nan, math.inf, True])
def test_sampling_params_reject_non_finite_and_bools(field, value):
    with raises_for(field):
        SamplingParams(**{field: value})


@pytest.mark.parametrize("field", ["max_tokens", "n", "seed", "logprobs"])
def test_sampling_params_reject_bools_as_ints(field):
    with raises_for(field):
        SamplingParams(**{field: True})


def test_configs_reject_bools_as_ints():
    with raises_for("block_size"):
        CacheConfig(block_size=True)
    with raises_for("max_model_len"):
        ModelConfig(max_model_len=True)


@pytest.mark.parametrize("seed", [-3, 2**63, 2**64])
def test_sampling_params_reject_seeds_a_generator_cannot_take(seed):
    with raises_for("seed"):
        SamplingParams(seed=seed)


def test_stop_strings_need_detokenization():
    with raises_for("stop"):
        SamplingParams(stop=["x"], detokenize=False)


def test_a_bare_boolean_flag_leaves_the_next_positional_alone():
    from quire.config_args import explicit_bool_values
    from quire_cli.main import build_parser

    argv = ["generate", "--enforce-eager", "Tell me a story", "--enable-prefix-caching", "no"]
    parser = build_parser(argv)
    ns = parser.parse_args(explicit_bool_values(parser, argv))
    assert ns.enforce_eager is True and ns.enable_prefix_caching is False
    assert "Tell me a story" in vars(ns).values()
    with pytest.raises(SystemExit):  # without the rewrite argparse takes the prompt as the value
        parser.parse_args(argv)
