"""``quire bench serve`` against vLLM, the parts that need no vLLM: the engine-kind settings,
the cores each started server is bound to, vLLM's counters read from Prometheus text, and the
per-run counter deltas."""

from __future__ import annotations

from pathlib import Path

import pytest

from quire_cli.bench.serve_config import ServeBenchConfig
from quire_cli.bench.serve_engines import VllmEngines, counter_deltas
from quire_cli.bench.vllm_server import VllmServerSpec, cpu_binding, metric_value

URL = "vllm://127.0.0.1:{}?kv_events=ipc:///tmp/e{}.sock&kv_replay=ipc:///tmp/r{}.sock"


def test_running_vllm_engines_set_the_count():
    urls = ",".join(URL.format(8000 + i, i, i) for i in range(3))
    cfg = ServeBenchConfig(engine_kind="vllm", engines=urls, num_engines=3)
    assert len(cfg.engine_urls) == 3 and cfg.engine_urls[2].startswith("vllm://127.0.0.1:8002")


@pytest.mark.parametrize("fields, message", [
    ({"engine_kind": "sglang"}, "engine_kind: choose from"),
    ({"engine_kind": "vllm"}, "vllm_python: engine_kind vllm needs"),
    ({"engines": URL.format(8000, 0, 0) + "," + URL.format(8001, 1, 1)},
     "engines: running engines are taken for engine_kind vllm only"),
    ({"engine_kind": "vllm", "engines": "127.0.0.1:8000,127.0.0.1:8001"},
     "engines: vllm://host:port"),
    ({"engine_kind": "vllm", "engines": URL.format(8000, 0, 0), "num_engines": 2},
     "num_engines: 2, but engines names 1"),
    ({"engine_kind": "vllm", "vllm_python": "/v/bin/python", "vllm_kv_blocks": -1},
     "vllm_kv_blocks: must be >= 0"),
    ({"engine_kind": "vllm", "vllm_python": "/v/bin/python", "vllm_block_size": 0},
     "vllm_block_size: must be at least 1"),
])
def test_bad_vllm_settings_name_the_field(fields, message):
    with pytest.raises(ValueError, match=message):
        ServeBenchConfig(**fields)


def test_quire_engine_flags_that_vllm_has_no_use_for_are_refused():
    cfg = ServeBenchConfig(engine_kind="vllm", vllm_python="/v/bin/python")
    with pytest.raises(ValueError, match=r"engine_kind: vllm takes only .*\['block_size'\]"):
        VllmEngines(cfg, ["--dtype", "float32", "--block-size", "32"], Path("/m"))
    engines = VllmEngines(cfg, ["--dtype", "bfloat16", "--max-model-len", "1024"], Path("/m"))
    assert (engines.dtype, engines.max_model_len, engines.tokenizer) == ("bfloat16", 1024, "/m")


def test_a_cache_too_small_for_one_request_is_refused():
    with pytest.raises(ValueError, match="num_kv_blocks: 8 blocks of 128 tokens"):
        VllmServerSpec(python="p", model_dir=Path("/m"), served_model_name="m",
                       max_model_len=1024, num_kv_blocks=8)


@pytest.mark.parametrize("num_servers, num_cpus, expected", [
    (2, 2, ["0", "1"]),
    (2, 16, ["0-7", "8-15"]),
    (3, 2, ["0", "1", "0"]),  # more servers than cores: they share, round the machine
    (1, 4, ["0-3"]),
])
def test_servers_split_the_cores(num_servers, num_cpus, expected):
    assert [cpu_binding(i, num_servers, num_cpus) for i in range(num_servers)] == expected


METRICS = """\
# HELP vllm:prefix_cache_hits Prefix cache hits, in terms of number of cached tokens.
# TYPE vllm:prefix_cache_hits counter
vllm:prefix_cache_hits_total{engine="0",model_name="m"} 512.0
vllm:prefix_cache_hits_created{engine="0",model_name="m"} 1.79e+09
vllm:prefix_cache_queries_total{engine="0",model_name="m"} 1118.0
vllm:request_success_total{engine="0",finished_reason="stop",model_name="m"} 2.0
vllm:request_success_total{engine="0",finished_reason="length",model_name="m"} 3.0
vllm:num_requests_running{engine="0",model_name="m"} 1.0
"""


def test_metric_values_by_name_and_labels():
    assert metric_value(METRICS, "vllm:prefix_cache_hits_total") == 512.0
    assert metric_value(METRICS, "vllm:prefix_cache_queries_total") == 1118.0
    assert metric_value(METRICS, "vllm:request_success_total") == 5.0
    assert metric_value(METRICS, "vllm:request_success_total", finished_reason="length") == 3.0
    assert metric_value(METRICS, "vllm:num_requests_running") == 1.0
    assert metric_value(METRICS, "vllm:prefix_cache_hits") == 0.0  # the _total name only
    assert metric_value(METRICS, "vllm:num_requests_waiting") == 0.0


def test_counter_deltas_over_a_run():
    before = {"a:1": {"queries": 100.0, "hits": 0.0}, "a:2": {"queries": 50.0, "hits": 10.0}}
    after = {"a:1": {"queries": 1100.0, "hits": 512.0}, "a:2": {"queries": 50.0, "hits": 10.0}}
    deltas = counter_deltas(before, after, ["a:1", "a:2"])
    assert deltas == {"queries": 1000.0, "hits": 512.0, "hit_rate": 0.512,
                      "per_engine": {"engine-0": {"queries": 1000.0, "hits": 512.0},
                                     "engine-1": {"queries": 0.0, "hits": 0.0}}}
    assert counter_deltas(None, None, ["a:1"]) is None


FAKE_SERVER = '''
import http.server, socket, sys
port = int(sys.argv[sys.argv.index("--port") + 1])
try:
    server = http.server.HTTPServer(("127.0.0.1", port), http.server.BaseHTTPRequestHandler)
except OSError as e:
    print(f"ERROR: [Errno 98] error while attempting to bind: Address already in use ({e})")
    sys.exit(1)
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.end_headers()
server.RequestHandlerClass = Health
server.handle_request()
'''


def test_a_vllm_server_whose_port_was_taken_starts_again_on_another(tmp_path, monkeypatch):
    """The port picked for a server can be taken before it binds it: the server exits saying
    so, and wait() starts it again on another port (a stand-in for vLLM that binds --port,
    as `vllm serve` does, and answers one /health)."""
    import socket
    import sys
    import time

    from quire_cli.bench import vllm_server

    script = tmp_path / "fake_vllm.py"
    script.write_text(FAKE_SERVER)
    python = tmp_path / "python"
    python.write_text(f"#!/bin/sh\nexec {sys.executable} {script} \"$@\"\n")
    python.chmod(0o755)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        ports = iter([taken.getsockname()[1]])
        real_free_port = vllm_server.free_port
        monkeypatch.setattr(vllm_server, "free_port", lambda: next(ports, None) or real_free_port())
        server = vllm_server.VllmServer(VllmServerSpec(str(python), tmp_path, "m"), tmp_path, "v")
        server.wait(time.monotonic() + 60)
        assert server.port != taken.getsockname()[1] and server._port_attempts == 2
        server.kill()
