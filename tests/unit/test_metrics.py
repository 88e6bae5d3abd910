"""Exact tests of the engine's vLLM-compatible metrics, scraped over a real HTTP server.

Values are chosen to be exact in binary floating point (halves and quarters), so sums compare
with ``==``.
"""

from __future__ import annotations

import urllib.error
import urllib.request
from collections.abc import Iterator

import pytest
from prometheus_client.parser import text_string_to_metric_families

from engine_worker.metrics import EngineMetrics, MetricsServer
from tests.unit.engine_infos import engine_info

MODEL = "test-model"
FALLBACK = "compiled CPU kernels unavailable: building csrc/cpu failed"


def engine_metrics(model_name: str = MODEL) -> EngineMetrics:
    return EngineMetrics(model_name, engine_info(backend="torch", backend_reason=FALLBACK,
                                                 backend_fallback=True))


@pytest.fixture
def metrics() -> EngineMetrics:
    return engine_metrics()


@pytest.fixture
def server(metrics: EngineMetrics) -> Iterator[MetricsServer]:
    srv = MetricsServer(metrics, "127.0.0.1", 0)
    srv.start()
    yield srv
    srv.stop()


def scrape(server: MetricsServer, path: str = "/metrics") -> tuple[str, str]:
    with urllib.request.urlopen(f"http://127.0.0.1:{server.port}{path}", timeout=5) as resp:
        return resp.headers["Content-Type"], resp.read().decode()


def samples(text: str) -> dict[tuple[str, frozenset], float]:
    """Every sample, keyed by its exposed name and label set."""
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(text: str, name: str, **labels: str) -> float:
    return samples(text)[(name, frozenset({"model_name": MODEL, **labels}.items()))]


def step(metrics: EngineMetrics, **overrides: float) -> None:
    args = dict(num_running=0, num_waiting=0, kv_cache_usage=0.0, prefix_cache_queries=0,
                prefix_cache_hits=0, num_preemptions=0)
    args.update(overrides)
    metrics.observe_step(**args)


def test_exposed_names_match_vllm(metrics: EngineMetrics, server: MetricsServer) -> None:
    content_type, text = scrape(server)
    assert content_type.startswith("text/plain; version=0.0.4")
    names = {name for name, _ in samples(text)}
    for expected in [
        "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
        "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
        "vllm:prompt_tokens_total", "vllm:generation_tokens_total",
        "vllm:request_success_total", "vllm:num_preemptions_total",
        "vllm:time_to_first_token_seconds_bucket", "vllm:time_to_first_token_seconds_count",
        "vllm:time_to_first_token_seconds_sum",
        "vllm:time_per_output_token_seconds_bucket", "vllm:inter_token_latency_seconds_bucket",
        "vllm:e2e_request_latency_seconds_count", "vllm:request_queue_time_seconds_sum",
    ]:
        assert expected in names, expected
    # The literal line dashboards match on: colon kept, _total appended, model_name label.
    assert f'vllm:prompt_tokens_total{{model_name="{MODEL}"}} 0.0' in text
    # Every finish reason is present (at 0) before any request finishes.
    for reason in ("stop", "length", "abort"):
        assert value(text, "vllm:request_success_total", finished_reason=reason) == 0


def test_scripted_sequence_exact_values(metrics: EngineMetrics, server: MetricsServer) -> None:
    step(metrics, num_running=3, num_waiting=2, kv_cache_usage=0.25, prefix_cache_queries=100,
         prefix_cache_hits=40, num_preemptions=1)
    # The same totals again add nothing; growth adds only the difference.
    step(metrics, num_running=3, num_waiting=2, kv_cache_usage=0.25, prefix_cache_queries=100,
         prefix_cache_hits=40, num_preemptions=1)
    step(metrics, num_running=2, num_waiting=1, kv_cache_usage=0.5, prefix_cache_queries=164,
         prefix_cache_hits=72, num_preemptions=1, num_prompts_passed=3)

    # TTFT 0.5, queue 0.25, e2e 2.5, TPOT (12.5 - 10.5) / (5 - 1) = 0.5
    metrics.observe_finished(finish_reason="stop", num_prompt_tokens=10,
                             num_generation_tokens=5, arrival_time=10.0,
                             first_scheduled_time=10.25, first_token_time=10.5,
                             finished_time=12.5)
    # One generated token: TTFT 1.0, queue 0.5, e2e 1.0, no TPOT.
    metrics.observe_finished(finish_reason="length", num_prompt_tokens=7,
                             num_generation_tokens=1, arrival_time=20.0,
                             first_scheduled_time=20.5, first_token_time=21.0,
                             finished_time=21.0)
    # Aborted while waiting: only e2e (0.75) is known.
    metrics.observe_finished(finish_reason="abort", num_prompt_tokens=3,
                             num_generation_tokens=0, arrival_time=30.0,
                             first_scheduled_time=None, first_token_time=None,
                             finished_time=30.75)

    _, text = scrape(server)
    assert value(text, "vllm:num_requests_running") == 2
    assert value(text, "vllm:num_requests_waiting") == 1
    assert value(text, "vllm:kv_cache_usage_perc") == 0.5
    assert value(text, "vllm:prefix_cache_queries_total") == 164
    assert value(text, "vllm:prefix_cache_hits_total") == 72
    assert value(text, "vllm:num_preemptions_total") == 1
    assert value(text, "quire:prompts_passed_by_shorter_total") == 3
    assert value(text, "vllm:prompt_tokens_total") == 20
    assert value(text, "vllm:generation_tokens_total") == 6
    for reason in ("stop", "length", "abort"):
        assert value(text, "vllm:request_success_total", finished_reason=reason) == 1

    def hist(name: str) -> tuple[float, float]:
        return value(text, f"{name}_count"), value(text, f"{name}_sum")

    assert hist("vllm:time_to_first_token_seconds") == (2, 1.5)
    assert hist("vllm:request_queue_time_seconds") == (2, 0.75)
    assert hist("vllm:e2e_request_latency_seconds") == (3, 4.25)
    assert hist("vllm:time_per_output_token_seconds") == (1, 0.5)
    assert hist("vllm:inter_token_latency_seconds") == (1, 0.5)
    # Buckets are cumulative: TTFTs 0.5 and 1.0 fall at or under le=1.0, only 0.5 under 0.5.
    ttft = "vllm:time_to_first_token_seconds_bucket"
    assert value(text, ttft, le="0.25") == 0
    assert value(text, ttft, le="0.5") == 1
    assert value(text, ttft, le="1.0") == 2
    assert value(text, ttft, le="+Inf") == 2


def test_counter_reset_in_engine_counts_new_total(metrics: EngineMetrics) -> None:
    step(metrics, prefix_cache_queries=50, prefix_cache_hits=20, num_preemptions=2)
    # The engine's totals dropped (e.g. its prefix cache was reset): counted from zero again.
    step(metrics, prefix_cache_queries=8, prefix_cache_hits=4, num_preemptions=2)
    step(metrics, prefix_cache_queries=8, prefix_cache_hits=4, num_preemptions=3)
    text = metrics.render().decode()
    assert value(text, "vllm:prefix_cache_queries_total") == 58
    assert value(text, "vllm:prefix_cache_hits_total") == 24
    assert value(text, "vllm:num_preemptions_total") == 3


def test_unknown_finish_reason_rejected(metrics: EngineMetrics) -> None:
    with pytest.raises(ValueError, match="finish_reason"):
        metrics.observe_finished(finish_reason="timeout", num_prompt_tokens=1,
                                 num_generation_tokens=1, arrival_time=0.0,
                                 first_scheduled_time=None, first_token_time=None,
                                 finished_time=1.0)


def test_other_path_is_404(server: MetricsServer) -> None:
    with pytest.raises(urllib.error.HTTPError) as info:
        scrape(server, "/")
    assert info.value.code == 404
    with pytest.raises(urllib.error.HTTPError) as info:
        scrape(server, "/metrics/extra")
    assert info.value.code == 404


def test_instances_do_not_share_state() -> None:
    first, second = engine_metrics(), engine_metrics()
    assert first.registry is not second.registry
    step(first, num_running=4, prefix_cache_queries=10)
    first.observe_finished(finish_reason="stop", num_prompt_tokens=5, num_generation_tokens=2,
                           arrival_time=0.0, first_scheduled_time=0.0, first_token_time=0.5,
                           finished_time=1.0)
    text = second.render().decode()
    assert value(text, "vllm:num_requests_running") == 0
    assert value(text, "vllm:prefix_cache_queries_total") == 0
    assert value(text, "vllm:prompt_tokens_total") == 0
    assert value(text, "vllm:e2e_request_latency_seconds_count") == 0


def test_model_name_label_and_two_servers() -> None:
    a, b = engine_metrics("model-a"), engine_metrics("model-b")
    servers = [MetricsServer(m, "127.0.0.1", 0) for m in (a, b)]
    for s in servers:
        s.start()
    try:
        assert servers[0].port != servers[1].port
        step(a, num_waiting=7)
        _, text_a = scrape(servers[0])
        _, text_b = scrape(servers[1])
        assert samples(text_a)[("vllm:num_requests_waiting",
                                frozenset({("model_name", "model-a")}))] == 7
        assert samples(text_b)[("vllm:num_requests_waiting",
                                frozenset({("model_name", "model-b")}))] == 0
        assert "model-b" not in text_a
    finally:
        for s in servers:
            s.stop()


def test_port_before_start_raises_and_stop_is_idempotent(metrics: EngineMetrics) -> None:
    srv = MetricsServer(metrics, "127.0.0.1", 0)
    with pytest.raises(RuntimeError):
        _ = srv.port
    srv.start()
    assert srv.port > 0
    srv.stop()
    srv.stop()


def test_backend_info_says_which_backend_runs_and_why(server: MetricsServer) -> None:
    _, text = scrape(server)
    assert value(text, "quire:backend_info", backend="torch", reason=FALLBACK,
                 quantization="none", layers="per-layer") == 1
    assert (f'quire:backend_info{{backend="torch",layers="per-layer",model_name="{MODEL}",'
            f'quantization="none",reason="{FALLBACK}"}} 1.0') in text.splitlines()
    # one series: the engine runs one backend
    assert [name for name, _ in samples(text)].count("quire:backend_info") == 1
    assert value(text, "quire:cuda_graphs_info", cuda_graphs="off (cpu)") == 1
