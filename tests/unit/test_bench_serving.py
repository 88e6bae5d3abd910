"""``quire bench serving``, the parts that need neither server nor vLLM: the client's
arguments per scenario, the settings it refuses, the dtype choice per CPU, and the report read
from the client's result JSON (figures, ratios, table, plot)."""

from __future__ import annotations

import contextlib
import time
from pathlib import Path

import pytest

from quire_cli.bench.serving import (ServingBenchConfig, choose_dtypes, client_argv, cpu_slug,
                                     scenarios, warmup)
from quire_cli.bench.serving_report import (ServingFigures, figures_from_client, format_table,
                                            repeated_report, scenario_ratios, scenario_report,
                                            write_plot)
from quire_cli.bench.serving_systems import requests_digest

# The keys `vllm bench serve --save-result` wrote against `quire up` (vLLM 0.32.0), trimmed.
CLIENT_RESULT = {
    "backend": "openai", "label": "quire", "num_prompts": 4, "request_rate": "inf",
    "duration": 1.1099645499998587, "completed": 4, "failed": 0, "total_input_tokens": 128,
    "total_output_tokens": 32, "request_throughput": 3.603718695340774,
    "output_throughput": 28.829749562726192, "median_ttft_ms": 859.2129929999146,
    "p50_ttft_ms": 859.2129929999146, "p90_ttft_ms": 873.3891815000561,
    "p99_ttft_ms": 873.6420945501391, "median_tpot_ms": 34.68189678570915,
    "p90_tpot_ms": 70.33665921428566, "median_itl_ms": 32.47923300011735,
    "p90_itl_ms": 62.28351999998267,
}


def _argv(cfg: ServingBenchConfig, index: int) -> list[str]:
    return client_argv(cfg, scenarios(cfg)[index], base_url="http://127.0.0.1:9", model="m",
                       tokenizer="/tok", label="quire", result_path=Path("/r.json"),
                       requests_path=Path("/q.json"))


def _flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_scenarios_cover_datasets_by_samplings_each_with_its_own_seed():
    plan = scenarios(ServingBenchConfig(dataset_seed=7))
    assert [(s.name, s.seed, s.temperature) for s in plan] == [
        ("random/default", 7, None), ("random/greedy", 8, 0.0),
        ("prefix_repetition/default", 9, None), ("prefix_repetition/greedy", 10, 0.0)]


def test_each_repeat_draws_seeds_no_other_run_uses():
    cfg = ServingBenchConfig(dataset_seed=7, repeats=3)
    seeds = [s.seed for r in range(cfg.repeats) for s in scenarios(cfg, r)]
    seeds.append(warmup(cfg)[1].seed)
    assert len(set(seeds)) == len(seeds) == 13
    assert [s.name for s in scenarios(cfg, 2)] == [s.name for s in scenarios(cfg)]
    assert scenarios(cfg, 0) == scenarios(ServingBenchConfig(dataset_seed=7))


def test_the_warm_up_pass_is_short_and_shares_no_scenario_seed():
    cfg = ServingBenchConfig(datasets="prefix_repetition", output_len=4)
    warm_cfg, warm = warmup(cfg)
    assert (warm.name, warm_cfg.output_len, warm_cfg.num_prompts) == ("random/greedy", 4, 64)
    assert warm.seed not in {s.seed for s in scenarios(cfg)}
    assert warmup(ServingBenchConfig())[0].output_len == 8


def test_client_arguments_for_the_default_sampling_send_no_temperature():
    argv = _argv(ServingBenchConfig(), 0)
    assert "--temperature" not in argv
    assert (_flag(argv, "--dataset-name"), _flag(argv, "--num-prompts"),
            _flag(argv, "--random-input-len"), _flag(argv, "--random-output-len"),
            _flag(argv, "--request-rate"), _flag(argv, "--seed")) == (
        "random", "64", "256", "128", "inf", "0")
    assert (_flag(argv, "--backend"), _flag(argv, "--base-url"), _flag(argv, "--endpoint"),
            _flag(argv, "--model"), _flag(argv, "--tokenizer")) == (
        "openai", "http://127.0.0.1:9", "/v1/completions", "m", "/tok")
    assert _flag(argv, "--metric-percentiles") == "50,90,99"
    assert {"--ignore-eos", "--save-result"} <= set(argv)
    assert (_flag(argv, "--result-filename"), _flag(argv, "--dump-requests")) == (
        "/r.json", "/q.json")


def test_client_arguments_for_greedy_shared_prefixes():
    cfg = ServingBenchConfig(input_len=300, prefix_len=200, num_prefixes=4, request_rate=2.5,
                             ignore_eos=False)
    argv = _argv(cfg, 3)
    assert _flag(argv, "--temperature") == "0"
    assert (_flag(argv, "--dataset-name"), _flag(argv, "--prefix-repetition-prefix-len"),
            _flag(argv, "--prefix-repetition-suffix-len"),
            _flag(argv, "--prefix-repetition-num-prefixes"),
            _flag(argv, "--prefix-repetition-output-len"), _flag(argv, "--request-rate")) == (
        "prefix_repetition", "200", "100", "4", "128", "2.5")
    assert "--ignore-eos" not in argv and "--random-input-len" not in argv


@pytest.mark.parametrize("fields, message", [
    ({"datasets": "random,sharegpt"}, "datasets: choose from"),
    ({"samplings": ""}, "samplings: choose from"),
    ({"num_prompts": 64, "num_prefixes": 10}, "num_prefixes: 10 must divide num_prompts"),
    ({"prefix_len": 256}, r"prefix_len: must be in \[1, input_len=256\)"),
    ({"request_rate": 0.0}, "request_rate: must be > 0"),
    ({"num_warmups": -1}, "num_warmups: must be >= 0"),
    ({"quiet_timeout_s": -1.0}, "quiet_timeout_s: must be >= 0"),
    ({"repeats": 0}, "repeats: must be at least 1"),
    ({"dtypes": "quire=int8"}, "dtypes: unknown dtype"),
    ({"dtypes": "float32,bfloat16"}, "dtypes: one dtype per system"),
])
def test_bad_settings_name_the_field(fields, message):
    with pytest.raises(ValueError, match=message):
        ServingBenchConfig(**fields)


def test_prefix_settings_are_free_without_the_shared_prefix_dataset():
    assert ServingBenchConfig(datasets="random", num_prefixes=10, prefix_len=999).num_prompts == 64


@pytest.mark.parametrize("isa, expected", [
    ("avx512", {"quire": "bfloat16", "vllm": "bfloat16"}),
    ("avx2", {"quire": "bfloat16", "vllm": "float32"}),
    (None, {"quire": "float32", "vllm": "float32"}),
])
def test_dtypes_follow_the_cpu_unless_given(isa, expected):
    dtypes, why = choose_dtypes("", isa)
    assert dtypes == expected and why
    assert choose_dtypes("quire=float32,vllm=bfloat16", isa) == (
        {"quire": "float32", "vllm": "bfloat16"}, "--dtypes")


def test_cpu_slug():
    assert cpu_slug("AMD EPYC 7B13 64-Core Processor") == "amd-epyc-7b13-64-core"
    assert cpu_slug("???") == "cpu"


def test_figures_are_the_clients_own():
    f = figures_from_client(CLIENT_RESULT)
    assert f == ServingFigures(output_tokens_per_s=28.829749562726192,
                               ttft_p50_ms=859.2129929999146, ttft_p90_ms=873.3891815000561,
                               tpot_p50_ms=34.68189678570915, itl_p50_ms=32.47923300011735,
                               num_completed=4, num_failed=0, num_output_tokens=32,
                               duration_s=1.1099645499998587)


def test_a_result_without_percentiles_is_refused():
    result = {k: v for k, v in CLIENT_RESULT.items() if k != "p90_ttft_ms"}
    with pytest.raises(ValueError, match="client result: no p90_ttft_ms"):
        figures_from_client(result)


def _figures(tps: float, ttft: float, tpot: float) -> ServingFigures:
    return ServingFigures(tps, ttft, 2 * ttft, tpot, tpot / 2, 4, 0, 32, 1.0)


def test_ratios_are_quire_over_vllm_and_serving_over_offline():
    ratios = scenario_ratios(_figures(150.0, 200.0, 30.0), _figures(100.0, 400.0, 20.0), 200.0)
    assert ratios == pytest.approx({
        "output_throughput_quire_over_vllm": 1.5, "ttft_p50_quire_over_vllm": 0.5,
        "ttft_p90_quire_over_vllm": 0.5, "tpot_p50_quire_over_vllm": 1.5,
        "itl_p50_quire_over_vllm": 1.5, "quire_serving_over_offline": 0.75}, rel=1e-12)


def test_ratios_without_vllm_or_offline_are_none():
    ratios = scenario_ratios(_figures(150.0, 200.0, 30.0), None, None)
    assert set(ratios.values()) == {None}


def test_scenario_report_keeps_the_client_json_and_prints(tmp_path):
    vllm_result = {**CLIENT_RESULT, "label": "vllm", "output_throughput": 14.414874781363096}
    runs = {"quire": {"client_result": CLIENT_RESULT, "loadavg_before": [1.0, 1.0, 1.0]},
            "vllm": {"client_result": vllm_result, "loadavg_before": [2.0, 2.0, 2.0]}}
    entry = scenario_report("random/greedy", runs, {"output_tokens_per_s": 57.659499125452384})
    assert entry["serving"]["vllm"]["client_result"] is vllm_result
    assert entry["serving"]["quire"]["output_tokens_per_s"] == CLIENT_RESULT["output_throughput"]
    assert entry["ratios"]["output_throughput_quire_over_vllm"] == pytest.approx(2.0, rel=1e-12)
    assert entry["ratios"]["quire_serving_over_offline"] == pytest.approx(0.5, rel=1e-12)
    table = format_table([entry])
    assert "quire serving" in table and "vllm serving" in table and "quire offline" in table
    assert "throughput 2.00x" in table and "serving/offline 0.50" in table
    pytest.importorskip("matplotlib")
    assert write_plot(tmp_path / "p.png", [entry], "t")
    assert (tmp_path / "p.png").read_bytes()[:4] == b"\x89PNG"


def _run(label: str, tps: float, ttft: float) -> dict:
    return {"client_result": {**CLIENT_RESULT, "label": label, "output_throughput": tps,
                              "median_ttft_ms": ttft}}


def test_repeated_scenarios_report_medians_and_the_median_of_paired_ratios(tmp_path):
    # run 2 is a slow phase for both systems: its ratio is as good as the others', but the
    # ratio of the medians (300 / 150 = 2.0) would not be the median of the ratios (2.5)
    runs = [{"quire": _run("quire", 500.0, 100.0), "vllm": _run("vllm", 200.0, 400.0)},
            {"quire": _run("quire", 250.0, 300.0), "vllm": _run("vllm", 100.0, 600.0)},
            {"quire": _run("quire", 300.0, 200.0), "vllm": _run("vllm", 150.0, 200.0)}]
    offlines = [{"output_tokens_per_s": v} for v in (500.0, 500.0, 400.0)]
    entry = repeated_report("prefix_repetition/greedy", runs, offlines)
    assert entry["repeats"] == 3 and len(entry["runs"]) == 3
    assert entry["runs"][1]["serving"]["vllm"]["output_tokens_per_s"] == 100.0
    assert entry["serving"]["quire"]["output_tokens_per_s"] == 300.0
    assert entry["serving"]["vllm"]["output_tokens_per_s"] == 150.0
    assert entry["serving"]["quire"]["ttft_p50_ms"] == 200.0
    assert entry["offline_quire"] == {"output_tokens_per_s": 500.0}
    ratios, ranges = entry["ratios"], entry["ratio_ranges"]
    assert ratios["output_throughput_quire_over_vllm"] == pytest.approx(2.5, rel=1e-12)
    assert ranges["output_throughput_quire_over_vllm"] == pytest.approx([2.0, 2.5], rel=1e-12)
    assert ratios["ttft_p50_quire_over_vllm"] == pytest.approx(0.5, rel=1e-12)
    assert ratios["quire_serving_over_offline"] == pytest.approx(0.75, rel=1e-12)
    assert ranges["quire_serving_over_offline"] == pytest.approx([0.5, 1.0], rel=1e-12)
    table = format_table([entry])
    assert "throughput 2.50x" in table
    assert "medians of 3 runs; the runs' throughput ratios 2.00-2.50x" in table
    pytest.importorskip("matplotlib")
    assert write_plot(tmp_path / "p.png", [entry], "t")


def test_one_repeat_is_the_plain_scenario_entry_and_missing_offline_runs_are_left_out():
    runs = [{"quire": _run("quire", 500.0, 100.0), "vllm": _run("vllm", 200.0, 400.0)}]
    assert repeated_report("random/default", runs, [None]) == scenario_report(
        "random/default", runs[0], None)
    entry = repeated_report("random/default", runs * 2, [None, {"output_tokens_per_s": 1e3}])
    assert entry["offline_quire"] == {"output_tokens_per_s": 1e3}
    assert entry["ratios"]["quire_serving_over_offline"] == pytest.approx(0.5, rel=1e-12)
    assert repeated_report("random/default", runs * 2, [None, None])["offline_quire"] is None
    assert "medians of 2 runs" in format_table([entry])


def test_counts_over_repeats_are_the_worst_runs():
    runs = [{"quire": {"client_result": {**CLIENT_RESULT, "failed": f, "completed": 4 - f,
                                         "total_output_tokens": 32 - 8 * f}}}
            for f in (0, 0, 1, 0)]
    entry = repeated_report("random/greedy", runs, [None] * 4)
    quire = entry["serving"]["quire"]
    assert (quire["num_failed"], quire["num_completed"], quire["num_output_tokens"]) == (1, 3, 24)
    assert entry["ratios"]["output_throughput_quire_over_vllm"] is None
    assert "throughput ratios -, serving/offline -" in format_table([entry])


def _cpu(front: float, engine: float, engine_main: float) -> list[dict]:
    return [{"pid": 1, "command": "quire up", "role": "front", "cpu_s": front,
             "main_thread_cpu_s": front},
            {"pid": 2, "command": "quire engine", "role": "engine", "cpu_s": engine,
             "main_thread_cpu_s": engine_main}]


def test_server_cpu_per_run_and_its_medians_over_repeats():
    """Each run's server CPU (by process, from /proc around the client) is summed into front,
    engine main thread and the engine's other threads; repeats give each figure's median; a
    server without a process (no record) gives None, and the table leaves it out."""
    runs = [{"quire": {**_run("quire", 500.0, 100.0), "server_cpu": _cpu(f, e, m)},
             "vllm": _run("vllm", 200.0, 400.0)}
            for f, e, m in ((0.8, 20.5, 0.5), (1.0, 20.0, 0.75), (0.6, 21.0, 0.25))]
    one = scenario_report("random/greedy", runs[0], None)["serving"]
    assert (one["quire"]["server_cpu_s"], one["quire"]["front_cpu_s"],
            one["quire"]["engine_main_thread_cpu_s"],
            one["quire"]["engine_other_threads_cpu_s"]) == (21.3, 0.8, 0.5, 20.0)
    assert one["quire"]["server_cpu_ms_per_output_token"] == pytest.approx(21.3e3 / 32)
    assert one["vllm"]["server_cpu_s"] is None
    entry = repeated_report("random/greedy", runs, [None] * 3)
    quire = entry["serving"]["quire"]
    assert (quire["server_cpu_s"], quire["front_cpu_s"], quire["engine_main_thread_cpu_s"]) \
        == (21.3, 0.8, 0.5)
    assert entry["serving"]["vllm"]["server_cpu_s"] is None
    table = format_table([entry])
    assert "quire CPU s: 21.3 in all: front 0.8, engine processes' main threads 0.5, their " \
           "other threads 20.0 (665.62 ms a token)" in table
    assert "vllm CPU s" not in table


def _fake_stack(monkeypatch, tmp_path, cfg):
    """serving_run's orchestration with servers, client and offline engine replaced: every
    client run is recorded (system, run tag, seed), its 'requests' are the scenario's seed,
    and every offline run is recorded as ("offline", run key, the requests' seed)."""
    from quire_cli.bench import serving_run
    from quire_cli.bench.serving_systems import Server

    calls = []

    def server(system):
        @contextlib.contextmanager
        def start(*args):
            yield Server(f"http://{system}", "m", {"system": system})
        return start

    def run_scenario(cfg, scenario, system, server, tokenizer, workdir, tag=""):
        calls.append((system, tag, scenario.seed))
        sent = [{"prompt": str(scenario.seed)}]
        result = {**CLIENT_RESULT, "label": system,
                  "output_throughput": 100.0 + scenario.seed + (system == "quire") * 100}
        return ({"client_result": result, "requests_sha256": requests_digest(sent)}, sent)

    class Offline:
        def __init__(self, engine_args, warmup_requests, ignore_eos):
            calls.append(("offline", "start", int(warmup_requests[0]["prompt"])))

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            calls.append(("offline", "stop", None))

        def run(self, scenario):
            seed = int(scenario.requests[0]["prompt"])
            calls.append(("offline", scenario.name, seed))
            return {"output_tokens_per_s": 1000.0 + seed}

    monkeypatch.setattr(serving_run, "SERVERS", {s: server(s) for s in ("quire", "vllm")})
    monkeypatch.setattr(serving_run, "OFFLINE", Offline)
    monkeypatch.setattr(serving_run, "_run_scenario", run_scenario)
    # the record a wait leaves, here the bound it was given
    monkeypatch.setattr(serving_run, "wait_until_quiet", lambda timeout_s: {"bound": timeout_s})
    runs, requests, servers, offline = serving_run._serve_all(cfg, None, {}, Path("/m"),
                                                              tmp_path)
    return serving_run, calls, runs, requests, servers, offline


def test_repeats_alternate_who_runs_first_and_key_every_run(monkeypatch, tmp_path):
    cfg = ServingBenchConfig(datasets="random", repeats=2, skip_offline=True)
    serving_run, calls, runs, requests, servers, offline = _fake_stack(monkeypatch, tmp_path,
                                                                       cfg)
    assert set(servers) == {"quire", "vllm"} and offline == {}
    assert [(system, tag) for system, tag, _ in calls] == [
        ("quire", "warm-up"), ("vllm", "warm-up"),
        ("quire", "random-default-run1"), ("vllm", "random-default-run1"),
        ("vllm", "random-greedy-run1"), ("quire", "random-greedy-run1"),
        ("vllm", "random-default-run2"), ("quire", "random-default-run2"),
        ("quire", "random-greedy-run2"), ("vllm", "random-greedy-run2")]
    # the two systems of a run got the same seed; no two runs (nor the warm-up) share one
    seeds = [seed for _, _, seed in calls]
    assert seeds[::2] == seeds[1::2] and len(set(seeds[::2])) == 5
    assert set(requests) == {"warm-up", "random/default#1", "random/greedy#1",
                             "random/default#2", "random/greedy#2"}
    assert [run["quire"]["ran_first"] for run in runs["random/greedy"]] == [False, True]
    offline = {"random/default#1": {"output_tokens_per_s": 400.0},
               "random/default#2": {"output_tokens_per_s": 400.0}}
    entries, same = serving_run.report_entries(cfg, runs, offline)
    assert same == dict.fromkeys(["random/default#1", "random/greedy#1", "random/default#2",
                                  "random/greedy#2"], True)
    default, greedy = entries
    assert default["repeats"] == greedy["repeats"] == 2
    # each run's Quire against its own vLLM pair: (200 + s) / (100 + s) for the run's seed
    s1, s2 = (run["quire"]["client_result"]["output_throughput"] - 200
              for run in runs["random/default"])
    assert default["ratio_ranges"]["output_throughput_quire_over_vllm"] == pytest.approx(
        sorted([(200 + s1) / (100 + s1), (200 + s2) / (100 + s2)]), rel=1e-12)
    assert default["offline_quire"] == {"output_tokens_per_s": 400.0}
    assert greedy["offline_quire"] is None


def test_one_repeat_keeps_the_plain_names_and_quire_alone_runs_alone(monkeypatch, tmp_path):
    cfg = ServingBenchConfig(datasets="random", samplings="greedy", skip_vllm=True,
                             skip_offline=True)
    serving_run, calls, runs, requests, _, _ = _fake_stack(monkeypatch, tmp_path, cfg)
    assert [(system, tag) for system, tag, _ in calls] == [
        ("quire", "warm-up"), ("quire", "random-greedy")]
    entries, same = serving_run.report_entries(cfg, runs, {})
    assert same == {"random/greedy": True} and set(requests) == {"warm-up", "random/greedy"}
    (entry,) = entries
    assert "repeats" not in entry and set(entry["serving"]) == {"quire"}
    assert entry["ratios"]["output_throughput_quire_over_vllm"] is None


def test_each_offline_run_follows_its_quire_serving_run_on_the_same_requests(monkeypatch,
                                                                          tmp_path):
    cfg = ServingBenchConfig(datasets="random", repeats=2, quiet_timeout_s=0.0)
    serving_run, calls, runs, requests, _, offline = _fake_stack(monkeypatch, tmp_path, cfg)
    warm_seed = calls[0][2]
    assert [(who, tag) for who, tag, _ in calls] == [
        ("quire", "warm-up"), ("vllm", "warm-up"), ("offline", "start"),
        ("quire", "random-default-run1"), ("offline", "random/default#1"),
        ("vllm", "random-default-run1"),
        ("vllm", "random-greedy-run1"), ("quire", "random-greedy-run1"),
        ("offline", "random/greedy#1"),
        ("vllm", "random-default-run2"), ("quire", "random-default-run2"),
        ("offline", "random/default#2"),
        ("quire", "random-greedy-run2"), ("offline", "random/greedy#2"),
        ("vllm", "random-greedy-run2"), ("offline", "stop")]
    # the engine warmed up on the servers' warm-up requests; each offline run replayed what
    # the client had just sent Quire's server
    assert calls[2][2] == warm_seed
    for i, (who, tag, seed) in enumerate(calls):
        if who == "offline" and "/" in tag:
            assert calls[i - 1][0] == "quire" and calls[i - 1][2] == seed
    assert set(offline) == {"random/default#1", "random/greedy#1", "random/default#2",
                            "random/greedy#2"}
    assert all(run["quiet_before"] == {"bound": 0.0} for run in offline.values())
    entries, _ = serving_run.report_entries(cfg, runs, offline)
    for entry in entries:  # each repeat's serving over its own offline run, then the median
        pairs = [(run["quire"]["client_result"]["output_throughput"],
                  offline[f"{entry['scenario']}#{k + 1}"]["output_tokens_per_s"])
                 for k, run in enumerate(runs[entry["scenario"]])]
        assert entry["ratio_ranges"]["quire_serving_over_offline"] == pytest.approx(
            sorted(s / o for s, o in pairs), rel=1e-12)


def test_requests_digest_tells_request_sets_apart():
    a = [{"prompt": "x y", "prompt_len": 2, "expected_output_len": 8}]
    b = [{"prompt": "x z", "prompt_len": 2, "expected_output_len": 8}]
    assert requests_digest(a) == requests_digest([dict(a[0])]) != requests_digest(b)


def test_wait_until_quiet_returns_once_quiet_or_at_its_timeout():
    """A machine counts as quiet at once when any load is allowed; when none is (a busy
    fraction below 0 never comes), the wait ends at its timeout, a window at a time."""
    from quire_cli.bench.harness import wait_until_quiet

    start = time.monotonic()
    quiet = wait_until_quiet(max_busy=1.0, window_s=0.1, timeout_s=5.0)
    assert time.monotonic() - start < 2.0 and 0.0 <= quiet["cpu_busy"] <= 1.0
    start = time.monotonic()
    never = wait_until_quiet(max_busy=-1.0, window_s=0.1, timeout_s=0.3)
    assert time.monotonic() - start >= 0.3 and never["waited_s"] >= 0.3
