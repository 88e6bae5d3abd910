"""`quire up`: a router and two engine processes on loopback answer a real request."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request

import pytest

from quire_cli.stack import EXAMPLE_QUESTION

pytestmark = pytest.mark.slow  # starts a router and engine processes


def _up(model_dir, *extra):
    return [sys.executable, "-m", "quire_cli", "up", "--model", str(model_dir), "--dtype",
            "float32", "--kv-cache-memory-bytes", str(1 << 24), "--router-port", "0", "--http-port", "0",
            *extra]


def start_up(model_dir, *extra) -> tuple[subprocess.Popen, str]:
    """``quire up`` started, and its output up to the line that says the stack is ready (or up
    to its end, should it exit first; 300 s at most)."""
    # its log to a file nobody must drain: a pipe left unread would block the stack once full
    proc = subprocess.Popen(_up(model_dir, *extra), stdout=subprocess.PIPE,
                            stderr=tempfile.TemporaryFile(), text=True)
    deadline, lines = time.monotonic() + 300, []
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        lines.append(line)
        if "Ctrl-C stops the stack" in line or not line:
            break
    return proc, "".join(lines)


def test_up_answers_the_example_and_exits(tiny_model_dir):
    result = subprocess.run(_up(tiny_model_dir, "--once", "true"), capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert re.search(r"router on 127\.0\.0\.1:\d+ .*http://127\.0\.0\.1:\d+/v1 .*"
                     r"engines on 127\.0\.0\.1:\d+, 127\.0\.0\.1:\d+", result.stdout)
    assert re.search(rf"example: {re.escape(repr(EXAMPLE_QUESTION))} -> '.+'", result.stdout)
    # a stack that exits after one request does not fault its engines' caches in first
    assert result.stderr.count("KV cache pages: mapped lazily") == 2, result.stderr[-2000:]


def test_up_on_the_embedded_model_answers_as_the_readme_says():
    """The quick start exactly (no --model: the embedded Q4_1 model, natively 4-bit, greedy):
    the README quotes its answer."""
    result = subprocess.run([sys.executable, "-m", "quire_cli", "up", "--router-port", "0",
                             "--http-port", "0", "--kv-cache-memory-bytes", str(1 << 26),
                             "--once", "true"], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    line = f"example: {EXAMPLE_QUESTION!r} -> 'The capital of France is Paris.'"
    assert line in result.stdout, result.stdout


def test_up_stops_cleanly_on_ctrl_c(tiny_model_dir):
    proc, text = start_up(tiny_model_dir)
    assert "example:" in text, text
    engines = re.search(r"engines on (.+)$", text, re.M).group(1)
    # each engine has its metrics port (issue 32), printed at start
    metrics = re.search(r"engine metrics on (.+)$", text, re.M).group(1).split(", ")
    assert len(metrics) == 2 and len(set(metrics)) == 2
    for url in metrics:
        assert re.fullmatch(r"http://127\.0\.0\.1:\d+/metrics", url), url
        with urllib.request.urlopen(url, timeout=30) as response:
            text = response.read().decode()
        assert "vllm:num_requests_running" in text and "vllm:kv_cache_usage_perc" in text
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=120) == 0
    for address in engines.split(", "):  # the engines are gone too
        port = address.rsplit(":", 1)[1]
        check = subprocess.run(["bash", "-c", f"</dev/tcp/127.0.0.1/{port}"],
                               capture_output=True)
        assert check.returncode != 0


def test_up_with_pooling_engines_serves_embeddings_to_the_openai_client(tiny_model_dir):
    """``quire up --runner pooling``: embedding-only engines; the example embeds, and the
    official client's ``embeddings.create`` is answered through the router."""
    import openai

    proc, text = start_up(tiny_model_dir, "--runner", "pooling", "--pooler-config",
                          '{"pooling_type": "MEAN"}')
    try:
        assert re.search(r"example: .* -> 'embedding \[.*\] \(64 floats\)'", text), text
        url = re.search(r"(http://127\.0\.0\.1:\d+/v1)", text).group(1)
        with openai.OpenAI(base_url=url, api_key="x", max_retries=0, timeout=60) as client:
            result = client.embeddings.create(model=client.models.list().data[0].id,
                                              input=["hello", "world"])
            assert [len(d.embedding) for d in result.data] == [64, 64]
            with pytest.raises(openai.BadRequestError, match="runner pooling"):
                client.completions.create(model=result.model, prompt="hi", max_tokens=2)
    finally:
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=120) == 0


def test_up_takes_the_routers_keys_and_limits(tiny_model_dir, monkeypatch):
    """The router's own options on ``quire up`` (flags and QUIRE_* variables): an API key
    set in the environment guards the stack (before, quire up built its router from defaults
    and served everyone), and a limit reaches the engines too, so both refuse alike."""
    import json
    import urllib.error

    import grpc

    from quire.v1 import engine_pb2 as pb
    from quire.v1 import engine_pb2_grpc

    monkeypatch.setenv("QUIRE_API_KEYS", "k1,k2")
    proc, text = start_up(tiny_model_dir, "--num-engines", "1", "--max-tokens-limit", "20")
    try:
        assert "example:" in text, text  # the example itself carried a key
        url = re.search(r"(http://127\.0\.0\.1:\d+/v1)", text).group(1)

        def post(body, key=None):
            request = urllib.request.Request(
                f"{url}/completions", json.dumps({"prompt": "hi", **body}).encode(),
                {"Content-Type": "application/json"} | (
                    {"Authorization": f"Bearer {key}"} if key else {}))
            try:
                with urllib.request.urlopen(request, timeout=60) as response:
                    return response.status, json.loads(response.read())
            except urllib.error.HTTPError as e:
                return e.code, json.loads(e.read())

        assert post({"max_tokens": 2})[0] == 401
        assert post({"max_tokens": 2}, "k2")[0] == 200
        status, answer = post({"max_tokens": 21}, "k1")
        assert status == 400 and answer["error"]["param"] == "max_tokens", answer
        engine = re.search(r"engines on (\S+)", text).group(1)
        with grpc.insecure_channel(engine) as channel:  # the engine's own limit is the same
            stub = engine_pb2_grpc.EngineServiceStub(channel)
            with pytest.raises(grpc.RpcError) as error:
                list(stub.Generate(pb.GenerateRequest(text="hi", sampling=pb.SamplingOptions(
                    max_tokens=21)), timeout=60))
            assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "max_tokens" in error.value.details()
    finally:
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=120) == 0
