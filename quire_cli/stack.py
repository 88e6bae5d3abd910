"""``quire up``: a local stack on loopback, N engine processes behind one router.

Engines run as ``quire engine`` subprocesses (each owns its model and KV cache); the router runs
in this process (it never imports torch). After one example request through the router, the
stack serves until Ctrl-C / SIGTERM, then stops the engines (they drain) and exits 0.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

EXAMPLE_QUESTION = "What is the capital of France?"


@dataclass(frozen=True, slots=True)
class StackConfig:
    num_engines: int = 2
    router_host: str = "127.0.0.1"
    router_port: int = 50050
    http_port: int = 8000  # OpenAI-compatible HTTP front on the router
    policy: str = "prefix_aware"
    startup_timeout_s: float = 600.0
    once: bool = False  # exit after the example request (scripts, CI)

    def __post_init__(self) -> None:
        if not 1 <= self.num_engines <= 16:
            raise ValueError(f"num_engines: must be in [1, 16], got {self.num_engines}")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _engine_argv(port: int, engine_flags: list[str], num_threads: int) -> list[str]:
    argv = [sys.executable, "-m", "quire_cli", "engine", "--host", "127.0.0.1", "--port",
            str(port)]
    if "--num-threads" not in engine_flags:
        argv += ["--num-threads", str(num_threads)]
    return argv + engine_flags


def changed_engine_flags(ns) -> list[str]:
    """The engine flags the user changed from their defaults, to pass on to ``quire engine``."""
    import dataclasses

    from engine_worker.config import EngineArgs

    flags = []
    for field in dataclasses.fields(EngineArgs):
        value = getattr(ns, field.name)
        if value != field.default:
            flags += ["--" + field.name.replace("_", "-"), str(value)]
    return flags


def resolve_model_once(model: str | None) -> Path:
    """Resolve (and on first use convert) the model once, in a child so torch stays out of
    this process and the engines do not all convert it at once; returns its directory.
    ValueError if it fails."""
    resolved = subprocess.run(
        [sys.executable, "-c", "import sys; from engine_worker.weights.resolve import "
         "resolve_model_dir; print(resolve_model_dir(sys.argv[1] or None))", model or ""],
        capture_output=True, text=True, check=False)
    if resolved.returncode != 0:
        lines = resolved.stderr.strip().splitlines() or ["model resolution failed"]
        raise ValueError(lines[-1] if lines[-1].startswith("model") else f"model: {lines[-1]}")
    return Path(resolved.stdout.strip().splitlines()[-1])


def start_engines(cfg: StackConfig, engine_flags: list[str]) -> list[tuple[subprocess.Popen, str]]:
    """Start the engines and wait until each prints that it listens."""
    threads = max(1, (os.cpu_count() or 1) // cfg.num_engines)
    engines = []
    for _ in range(cfg.num_engines):
        port = _free_port()
        proc = subprocess.Popen(_engine_argv(port, engine_flags, threads),
                                stdout=subprocess.PIPE, text=True)
        engines.append((proc, f"127.0.0.1:{port}"))
    deadline = time.monotonic() + cfg.startup_timeout_s
    for proc, address in engines:
        line = proc.stdout.readline() if time.monotonic() < deadline else ""
        if not re.search(r"listening on", line):
            stop_engines(engines)
            raise RuntimeError(f"engine {address} did not start (exit code {proc.poll()})")
    return engines


def stop_engines(engines) -> None:
    for proc, _ in engines:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)  # they drain, then exit 0
    for proc, _ in engines:
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()


async def _example(port: int, tokenizer) -> str:
    import grpc

    from quire.v1 import engine_pb2 as pb
    from quire.v1 import engine_pb2_grpc

    prompt = tokenizer.apply_chat_template([{"role": "user", "content": EXAMPLE_QUESTION}])
    ids = tokenizer.encode(prompt, add_special_tokens=False)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = engine_pb2_grpc.EngineServiceStub(channel)
        text = []
        call = stub.Generate(pb.GenerateRequest(
            token_ids=pb.TokenIds(ids=ids),
            sampling=pb.SamplingOptions(temperature=0, max_tokens=64)), timeout=300)
        async for message in call:
            text += [d.text for d in message.outputs]
    return "".join(text)


async def run_stack(cfg: StackConfig, engines) -> int:
    """The router (tokenizer fetched from the engines) in this process, until Ctrl-C."""
    from quire.signals import shutdown_event
    from quire.tracing import TracingConfig, make_tracing
    from router.app import RouterServer

    # The engines inherit this environment, so OTEL_* variables trace the whole stack.
    tracing = make_tracing(TracingConfig.from_env(default_service_name="quire-router"))
    router = RouterServer.static([a for _, a in engines], policy=cfg.policy,
                                 host=cfg.router_host, port=cfg.router_port,
                                 http_port=cfg.http_port, tracing=tracing)
    port = await router.start()
    try:
        if not await router.wait_ready(len(engines), timeout_s=cfg.startup_timeout_s):
            raise RuntimeError(f"engines not serving: {router.engine_states()}")
        print(f"quire up: router on {cfg.router_host}:{port} (quire.v1.EngineService) and "
              f"http://{cfg.router_host}:{router.http_port}/v1 (OpenAI API, model "
              f"{router.model_name!r}), engines on {', '.join(a for _, a in engines)}",
              flush=True)
        answer = await _example(port, router.pool.identity.tokenizer)
        print(f"example: {EXAMPLE_QUESTION!r} -> {answer!r}", flush=True)
        if not cfg.once:
            stop = shutdown_event()
            print("serving; Ctrl-C stops the stack", flush=True)
            await stop.wait()
    finally:
        await router.stop()
        if tracing is not None:
            tracing.shutdown()  # flushes the spans still batched
    return 0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from engine_worker.arg_utils import add_engine_args
    from quire.config_args import add_dataclass_args

    add_dataclass_args(parser, StackConfig, "stack")
    add_engine_args(parser)


def main(ns: argparse.Namespace) -> int:
    import asyncio

    from quire.config_args import dataclass_from_namespace

    from quire.ports import check_ports_free

    cfg = dataclass_from_namespace(StackConfig, ns)
    check_ports_free([(cfg.router_host, cfg.router_port, "router_port"),
                      (cfg.router_host, cfg.http_port, "http_port")])
    resolve_model_once(ns.model)
    engines = start_engines(cfg, changed_engine_flags(ns))
    try:
        return asyncio.run(run_stack(cfg, engines))
    finally:
        stop_engines(engines)
