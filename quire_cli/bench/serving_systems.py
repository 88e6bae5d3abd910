"""What ``quire bench serving`` runs: the two servers, vLLM's benchmark client against either,
and Quire's offline engine on the client's own requests.

The servers: ``quire up`` (router + engines, as users start it) and vLLM's OpenAI server
through the launcher the other vLLM benchmarks use (``vllm_server``), both with prefix caching.
Each is a context manager that yields its base URL and what the report keeps of it; both are up
at once (the idle one waits on its socket) and the client runs against one at a time.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

CLIENT_SCRIPT = Path(__file__).with_name("serving_client.py")
QUIRE_READY_LINE = "serving; Ctrl-C stops the stack"
# what vLLM's CPU server logs about the threads it runs (kept in the report)
VLLM_THREAD_LOG_WORDS = ("Torch threads", "OMP threads", "thread binding", "threads_bind")


@dataclass(frozen=True, slots=True)
class Server:
    """A running server: where the client sends requests, the model it serves (its
    /v1/models id), what the report keeps, and its process (the root of the tree whose CPU
    time each run reports; ``cpu_time``)."""

    base_url: str
    model: str
    info: dict
    pid: int | None = None


def _wait_for_line(proc: subprocess.Popen, log: Path, line: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if line in log.read_text(errors="replace"):
            return
        if proc.poll() is not None:
            break
        time.sleep(1)
    tail = log.read_text(errors="replace")[-3000:]
    raise RuntimeError(f"{proc.args[:4]} did not start (exit code {proc.poll()}): {tail}")


def _stop_group(proc: subprocess.Popen, timeout_s: float = 60.0) -> None:
    """SIGTERM to the server (it stops its children itself), SIGKILL to its group after
    ``timeout_s``."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            pass
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


@contextlib.contextmanager
def quire_server(stack_flags: Sequence[str], engine_flags: Sequence[str], workdir: Path,
                 timeout_s: float) -> Iterator[Server]:
    """``quire up`` on free loopback ports, once it has answered its example request. The
    router binds port 0 itself and the stack prints the ports it got (a port picked here and
    bound there could be taken in between)."""
    from quire_cli.bench.vllm_server import served_model

    argv = [sys.executable, "-m", "quire_cli", "up", "--router-port", "0", "--http-port", "0",
            *stack_flags, *engine_flags]
    log = workdir / "quire-up.log"
    with log.open("w") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, cwd=workdir,
                                start_new_session=True)
    try:
        _wait_for_line(proc, log, QUIRE_READY_LINE, timeout_s)
        http = re.search(r"http://(127\.0\.0\.1:\d+)/v1", log.read_text(errors="replace"))
        if http is None:
            raise RuntimeError(f"quire up printed no HTTP address; see {log}")
        address = http.group(1)
        yield Server(f"http://{address}", served_model(address)["id"],
                     {"command": ["quire", *argv[3:]], "log": str(log)}, proc.pid)
    finally:
        _stop_group(proc)


@contextlib.contextmanager
def vllm_server(spec, workdir: Path, timeout_s: float) -> Iterator[Server]:
    """vLLM's OpenAI server from ``spec`` (a ``VllmServerSpec``), bound to cores by vLLM
    itself (its default), with what it logged about its threads."""
    from quire_cli.bench.vllm_server import VllmServer, get_json, served_model

    server = VllmServer(spec, workdir, "vllm-serving", cpu_ids=None)
    try:
        server.wait(time.monotonic() + timeout_s)
        lines = [line.strip() for line in server.log.read_text(errors="replace").splitlines()
                 if any(word in line for word in VLLM_THREAD_LOG_WORDS)]
        yield Server(f"http://{server.address}", served_model(server.address)["id"],
                     {"command": server.proc.args[1:], "log": str(server.log),
                      "vllm_version": get_json(f"http://{server.address}/version")["version"],
                      "thread_log_lines": lines[:10]}, server.proc.pid)
    finally:
        server.kill()


def run_client(python: str, argv: Sequence[str], log: Path, timeout_s: float) -> None:
    """vLLM's serving benchmark client in its own venv (``-I``: none of Quire on its path);
    RuntimeError with the log's tail if it fails."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    with log.open("w") as out:
        done = subprocess.run([python, "-I", str(CLIENT_SCRIPT), *argv], env=env, stdout=out,
                              stderr=subprocess.STDOUT, timeout=timeout_s, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"vllm bench serve failed (exit {done.returncode}): "
                           f"{log.read_text(errors='replace')[-3000:]}")


def requests_digest(requests: list[dict]) -> str:
    """A short hash of the client's requests: equal digests, same requests."""
    return hashlib.sha256(json.dumps(requests, sort_keys=True).encode()).hexdigest()[:16]


@dataclass(frozen=True, slots=True)
class OfflineScenario:
    name: str
    requests: list[dict]  # as serving_client.py dumps them
    temperature: float | None  # None: the engine's default
    num_warmups: int


class OfflineEngine:
    """Quire's ``LLM`` on the clients' own requests, one ``generate`` a scenario, built while
    the servers are up so that each scenario's offline run sits beside its serving runs in
    time (the machines here run in fast and slow phases of minutes; an offline leg after all
    the serving measured a different phase). A context manager: the engine is built, and
    given the warm-up pass the servers got (``warmup_requests``, greedy), on entry, and freed
    on exit."""

    def __init__(self, engine_args, warmup_requests: list[dict], ignore_eos: bool) -> None:
        self._engine_args = engine_args
        self._warmup_requests = warmup_requests
        self._ignore_eos = ignore_eos
        self._llm = None
        self._load_s = 0.0

    def __enter__(self) -> OfflineEngine:
        import dataclasses

        from engine_worker import LLM, SamplingParams

        start = time.perf_counter()
        self._llm = LLM(**dataclasses.asdict(self._engine_args))
        self._load_s = time.perf_counter() - start
        warm = self._warmup_requests
        self._llm.generate([r["prompt"] for r in warm],
                           [SamplingParams(temperature=0, max_tokens=r["expected_output_len"],
                                           ignore_eos=True) for r in warm], use_tqdm=False)
        return self

    def __exit__(self, *exc) -> None:
        import gc

        self._llm = None
        gc.collect()

    def run(self, scenario: OfflineScenario) -> dict:
        """The scenario's requests in one ``generate``, after the warm-up the client also
        sends (its first request, ``num_warmups`` times)."""
        from engine_worker import SamplingParams

        sampling = {} if scenario.temperature is None else {"temperature": scenario.temperature}
        params = [SamplingParams(max_tokens=r["expected_output_len"], ignore_eos=self._ignore_eos,
                                 **sampling) for r in scenario.requests]
        prompts = [r["prompt"] for r in scenario.requests]
        for _ in range(scenario.num_warmups):
            self._llm.generate(prompts[:1], params[:1], use_tqdm=False)
        load_before = os.getloadavg()
        start = time.perf_counter()
        outputs = self._llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        num_out = sum(len(o.outputs[0].token_ids) for o in outputs)
        return {"output_tokens_per_s": num_out / elapsed, "elapsed_s": elapsed,
                "num_output_tokens": num_out,
                "num_input_tokens": sum(len(o.prompt_token_ids) for o in outputs),
                "num_requests": len(outputs), "load_s": self._load_s,
                "loadavg_before": list(load_before), "loadavg_after": list(os.getloadavg())}
