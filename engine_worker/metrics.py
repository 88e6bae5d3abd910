"""The engine pod's Prometheus metrics, named as vLLM names them, and the ``/metrics`` server.

Dashboards, autoscalers and the Gateway API Inference Extension already read vLLM's metric
names (``vllm:num_requests_waiting``, ``vllm:kv_cache_usage_perc``, ...), so we expose the same
names, types, units and labels rather than our own. prometheus_client keeps the colon and, as
for vLLM, exposes a counter ``vllm:prompt_tokens`` as ``vllm:prompt_tokens_total``.

Each ``EngineMetrics`` owns its own ``CollectorRegistry``: the process-wide default registry
would be hidden global state, and two engines (or two tests) in one process would collide.
"""

from __future__ import annotations

import json
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4

if TYPE_CHECKING:
    from engine_worker.engine_info import EngineInfo
    from engine_worker.lora.manager import LoRAStats
    from engine_worker.spec_decode.stats import SpecDecodingStats

FINISH_REASONS = ("stop", "length", "abort")

# Bucket edges in seconds, close to vLLM's so its dashboards' quantile panels line up.
TTFT_BUCKETS_S = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                  2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
TPOT_BUCKETS_S = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
                  2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
REQUEST_LATENCY_BUCKETS_S = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
                             40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


class _CumulativeCounter:
    """A labelled counter fed with the engine's running totals instead of increments.

    The engine reports totals every step; adding only the growth since the last report makes
    repeated reports of the same total harmless. A total that goes down means the engine's own
    count was reset (e.g. the prefix cache was cleared), so the new total is all new growth.
    """

    def __init__(self, counter: Counter) -> None:
        self._counter = counter
        self._last_total = 0

    def update(self, total: int) -> None:
        delta = total - self._last_total if total >= self._last_total else total
        self._last_total = total
        if delta > 0:
            self._counter.inc(delta)


def _model_counter(registry: CollectorRegistry, model_name: str, name: str,
                   doc: str) -> _CumulativeCounter:
    """A counter labelled by ``model_name`` alone, fed with running totals."""
    return _CumulativeCounter(Counter(name, doc, ["model_name"], registry=registry
                                      ).labels(model_name))


class _SpecDecodeCounters:
    """vLLM's ``vllm:spec_decode_*`` counters, registered only when speculation is on (as
    vLLM does); the per-position counter has a ``position`` label, 0 to k - 1, each created up
    front so a dashboard sees 0 instead of a missing series."""

    def __init__(self, *, registry: CollectorRegistry, model_name: str,
                 speculative_config: str) -> None:
        self.enabled = bool(speculative_config)
        if not self.enabled:
            return
        k = json.loads(speculative_config)["num_speculative_tokens"]
        self._num_drafts = _model_counter(
            registry, model_name, "vllm:spec_decode_num_drafts",
            "Number of spec decoding drafts.")
        self._num_draft_tokens = _model_counter(
            registry, model_name, "vllm:spec_decode_num_draft_tokens", "Number of draft tokens.")
        self._num_accepted_tokens = _model_counter(
            registry, model_name, "vllm:spec_decode_num_accepted_tokens",
            "Number of accepted tokens.")
        per_pos = Counter("vllm:spec_decode_num_accepted_tokens_per_pos",
                          "Accepted tokens per draft position.", ["model_name", "position"],
                          registry=registry)
        self._per_pos = [_CumulativeCounter(per_pos.labels(model_name, str(p)))
                         for p in range(k)]

    def update(self, stats: SpecDecodingStats) -> None:
        if not self.enabled:
            return
        self._num_drafts.update(stats.num_drafts)
        self._num_draft_tokens.update(stats.num_draft_tokens)
        self._num_accepted_tokens.update(stats.num_accepted_tokens)
        for counter, total in zip(self._per_pos, stats.num_accepted_tokens_per_pos):
            counter.update(total)


class _LoRAMetrics:
    """vLLM's ``vllm:lora_requests_info`` (the adapters running and waiting, as labels; the
    value is when they were seen) and Quire's load counters, registered only when LoRA is on.
    A read from the adapter's path (host memory held ``max_cpu_loras`` adapters and this one
    was not among them) and a write into a step slot (``max_loras``) are what thrashing
    costs: a router that places by adapter keeps both low."""

    def __init__(self, *, registry: CollectorRegistry, model_name: str, enabled: bool) -> None:
        self.enabled = enabled
        if not enabled:
            return
        self.model_name = model_name
        self._info = Gauge("vllm:lora_requests_info", "Running stats on lora requests.",
                           ["max_lora", "running_lora_adapters", "waiting_lora_adapters"],
                           registry=registry)
        self._labels: tuple[str, str, str] | None = None
        self._adapter_loads = _model_counter(
            registry, model_name, "quire:lora_adapter_loads",
            "LoRA adapters read from their path into host memory.")
        self._slot_loads = _model_counter(
            registry, model_name, "quire:lora_slot_loads",
            "LoRA adapters written into a step slot (max_loras).")

    def update(self, stats: LoRAStats) -> None:
        if not self.enabled:
            return
        labels = (str(stats.max_loras), ",".join(stats.running_adapters),
                  ",".join(stats.waiting_adapters))
        if labels != self._labels:  # one series: the current sets (vLLM keeps old ones)
            if self._labels is not None:
                self._info.remove(*self._labels)
            self._labels = labels
        self._info.labels(*labels).set_to_current_time()
        self._adapter_loads.update(stats.num_adapter_loads)
        self._slot_loads.update(stats.num_slot_loads)


class EngineMetrics:
    """vLLM-compatible metrics of one engine, in a registry of its own.

    ``observe_step`` is called by the engine loop after each step; ``observe_finished`` once per
    finished request. Both may be called from the engine thread while ``render`` runs on the
    server's threads: prometheus_client's metrics are thread-safe, and ``_lock`` guards the
    last-seen totals of the cumulative counters.
    """

    def __init__(self, model_name: str, info: EngineInfo) -> None:
        """``info``: the engine's facts; which kernel backend runs and why is exported as
        ``quire:backend_info``, whether decode steps replay CUDA graphs (``on (...)`` /
        ``off (cpu)``) as ``quire:cuda_graphs_info``."""
        self.model_name = model_name
        self.registry = CollectorRegistry()
        self._lock = threading.Lock()
        labels = ["model_name"]
        r = self.registry

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, labels, registry=r).labels(model_name)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, labels, registry=r).labels(model_name)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, labels, buckets=buckets, registry=r).labels(model_name)

        # What runs, as an info-style gauge (always 1): a fallback to the reference ops costs
        # 5-10x and an alert can match on backend="torch" where "cpu" was expected.
        # quantization: how the weights are held ("gguf", "awq", "gptq", "dequantize", "none");
        # layers: "fused" or "per-layer" (EngineInfo.layer_execution)
        Gauge("quire:backend_info",
              "Kernel backend the engine runs, why, how its weights are held and how its "
              "layers run (value 1).",
              ["model_name", "backend", "reason", "quantization", "layers"], registry=r
              ).labels(model_name, info.backend, info.backend_reason, info.quantization,
                       info.layer_execution).set(1)
        Gauge("quire:cuda_graphs_info",
              "Whether decode steps replay CUDA graphs, and why (value 1).",
              ["model_name", "cuda_graphs"], registry=r
              ).labels(model_name, info.cuda_graphs).set(1)

        # Scheduler state, sampled after every step.
        self._num_running = gauge("vllm:num_requests_running",
                                  "Number of requests in model execution batches.")
        self._num_waiting = gauge("vllm:num_requests_waiting",
                                  "Number of requests waiting to be processed.")
        self._kv_cache_usage = gauge("vllm:kv_cache_usage_perc",
                                     "KV-cache usage. 1 means 100 percent usage.")

        # Counters whose source is a running total in the engine.
        self._prefix_cache_queries = _CumulativeCounter(counter(
            "vllm:prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens."))
        self._prefix_cache_hits = _CumulativeCounter(counter(
            "vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens."))
        self._num_preemptions = _CumulativeCounter(counter(
            "vllm:num_preemptions", "Cumulative number of preemptions from the engine."))
        self._prompts_passed = _CumulativeCounter(counter(
            "quire:prompts_passed_by_shorter",
            "Prompts that waited one step while shorter prompts behind them ran "
            "(short_prompts_first)."))
        self._spec = _SpecDecodeCounters(registry=r, model_name=model_name,
                                         speculative_config=info.speculative_config)
        self._lora = _LoRAMetrics(registry=r, model_name=model_name, enabled=info.enable_lora)

        # Counters fed per finished request.
        self._prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self._generation_tokens = counter("vllm:generation_tokens",
                                          "Number of generation tokens processed.")
        success = Counter("vllm:request_success", "Count of successfully processed requests.",
                          ["model_name", "finished_reason"], registry=r)
        # Pre-create every reason so a dashboard sees 0 instead of a missing series.
        self._request_success = {reason: success.labels(model_name, reason)
                                 for reason in FINISH_REASONS}

        self._ttft = histogram("vllm:time_to_first_token_seconds",
                               "Histogram of time to first token in seconds.", TTFT_BUCKETS_S)
        self._tpot = histogram("vllm:time_per_output_token_seconds",
                               "Histogram of time per output token in seconds.", TPOT_BUCKETS_S)
        # vLLM observes this once per decode step; we see only finished requests, so it gets
        # each request's mean gap (the same value as TPOT) and its count is per request.
        self._itl = histogram("vllm:inter_token_latency_seconds",
                              "Histogram of inter-token latency in seconds.", TPOT_BUCKETS_S)
        self._e2e = histogram("vllm:e2e_request_latency_seconds",
                              "Histogram of end to end request latency in seconds.",
                              REQUEST_LATENCY_BUCKETS_S)
        self._queue_time = histogram("vllm:request_queue_time_seconds",
                                     "Histogram of time spent in WAITING phase for request.",
                                     REQUEST_LATENCY_BUCKETS_S)

    def observe_step(self, *, num_running: int, num_waiting: int, kv_cache_usage: float,
                     prefix_cache_queries: int, prefix_cache_hits: int,
                     num_preemptions: int, spec_decoding: SpecDecodingStats | None = None,
                     lora: LoRAStats | None = None, num_prompts_passed: int = 0) -> None:
        """Record the engine's state after a step.

        ``kv_cache_usage`` is a fraction in [0, 1]. The other arguments are the engine's
        running totals (tokens queried, tokens hit, preemptions, speculative decoding's
        counts, prompts passed by shorter ones), not this step's increments.
        """
        self._num_running.set(num_running)
        self._num_waiting.set(num_waiting)
        self._kv_cache_usage.set(kv_cache_usage)
        with self._lock:
            self._prefix_cache_queries.update(prefix_cache_queries)
            self._prefix_cache_hits.update(prefix_cache_hits)
            self._num_preemptions.update(num_preemptions)
            self._prompts_passed.update(num_prompts_passed)
            if spec_decoding is not None:
                self._spec.update(spec_decoding)
            if lora is not None:
                self._lora.update(lora)

    def observe_finished(self, *, finish_reason: str, num_prompt_tokens: int,
                         num_generation_tokens: int, arrival_time: float,
                         first_scheduled_time: float | None, first_token_time: float | None,
                         finished_time: float) -> None:
        """Record one finished request; times are from one monotonic clock, in seconds.

        A latency whose start is ``None`` (a request aborted before it was scheduled, or before
        its first token) is skipped rather than guessed.
        """
        if finish_reason not in self._request_success:
            # An open label set would let a bug grow the series without bound.
            raise ValueError(f"finish_reason must be one of {FINISH_REASONS}, "
                             f"got {finish_reason!r}")
        self._request_success[finish_reason].inc()
        self._prompt_tokens.inc(num_prompt_tokens)
        self._generation_tokens.inc(num_generation_tokens)
        self._e2e.observe(finished_time - arrival_time)
        if first_scheduled_time is not None:
            self._queue_time.observe(first_scheduled_time - arrival_time)
        if first_token_time is not None:
            self._ttft.observe(first_token_time - arrival_time)
            # The first token's time is TTFT's; the rest share the decode time.
            if num_generation_tokens > 1:
                tpot_s = (finished_time - first_token_time) / (num_generation_tokens - 1)
                self._tpot.observe(tpot_s)
                self._itl.observe(tpot_s)

    def render(self) -> bytes:
        """The registry in Prometheus' text exposition format (version 0.0.4)."""
        return generate_latest(self.registry)


class MetricsServer:
    """Serves ``GET /metrics`` from one ``EngineMetrics`` on a background thread.

    Kept apart from the gRPC server so a scrape never waits behind model work.
    """

    def __init__(self, metrics: EngineMetrics, host: str, port: int, *,
                 timeout_s: float = 10.0) -> None:
        self._metrics = metrics
        self._timeout_s = timeout_s  # a connection not done within this is dropped
        self._host = host
        self._requested_port = port  # 0: let the OS pick a free port
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        """The port actually bound; only known after ``start``."""
        if self._server is None:
            raise RuntimeError("MetricsServer.port is known only after start()")
        return self._server.server_address[1]

    def start(self) -> None:
        if self._server is not None:
            raise RuntimeError("MetricsServer already started")
        self._server = ThreadingHTTPServer((self._host, self._requested_port),
                                           _make_handler(self._metrics, self._timeout_s))
        self._server.daemon_threads = True  # a stuck scraper must not block shutdown
        self._thread = threading.Thread(target=self._server.serve_forever,
                                        name="metrics-server", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        if self._server is None:
            return
        self._server.shutdown()
        self._server.server_close()
        assert self._thread is not None
        self._thread.join()
        self._server = None
        self._thread = None


def _make_handler(metrics: EngineMetrics, timeout_s: float) -> type[BaseHTTPRequestHandler]:
    # http.server builds a handler per request from a class, so the metrics are bound here
    # rather than stored on the server or in a module global.
    class _MetricsHandler(BaseHTTPRequestHandler):
        timeout = timeout_s  # each socket read

        def setup(self) -> None:
            # A per-read timeout does not stop a client sending a byte a second (slowloris):
            # the whole connection gets ``timeout_s``, then its socket is shut down.
            super().setup()
            self._deadline = threading.Timer(timeout_s, self._drop)
            self._deadline.daemon = True
            self._deadline.start()

        def _drop(self) -> None:
            try:
                self.connection.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass  # already closed

        def finish(self) -> None:
            self._deadline.cancel()
            try:
                super().finish()
            except OSError:
                pass  # the deadline shut the socket down

        def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
            if self.path.split("?", 1)[0] != "/metrics":
                self._reply(404, b"not found\n", "text/plain; charset=utf-8")
                return
            self._reply(200, metrics.render(), CONTENT_TYPE_PLAIN_0_0_4)

        def _reply(self, status: int, body: bytes, content_type: str) -> None:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:  # noqa: A002
            pass  # a scrape every few seconds would flood the pod's log

    return _MetricsHandler
