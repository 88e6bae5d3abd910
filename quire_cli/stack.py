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
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

# The quick start's question. "... Answer in one sentence." because the bare question is a
# near-tie for the embedded model's first token ("The" against "L"'Étoile..., 0.1 nat apart,
# parted one way or the other by the path's rounding); this one leads by 1.4 nats on every
# kernel path and gives "The capital of France is Paris."
EXAMPLE_QUESTION = "What is the capital of France? Answer in one sentence."


@dataclass(frozen=True, slots=True)
class StackConfig:
    num_engines: int = 2
    router_host: str = "127.0.0.1"
    router_port: int = 50050
    http_port: int = 8000  # OpenAI-compatible HTTP front on the router
    policy: str = "prefix_aware"
    startup_timeout_s: float = 600.0
    # exit after the example request (scripts, CI); its engines then map their KV cache
    # lazily (no kv_cache_prefault: faulting GiBs in for one request only delays it)
    once: bool = False
    # the engines' --lora-adapter-dirs: where /v1/load_lora_adapter may load adapters from
    lora_adapter_dirs: str | None = None
    # the router loads an adapter no engine holds from <dir>/<name> on the engine where it
    # costs least (vLLM's filesystem resolver); the engines may load from there
    lora_resolver_dir: str | None = None

    def __post_init__(self) -> None:
        if not 1 <= self.num_engines <= 16:
            raise ValueError(f"num_engines: must be in [1, 16], got {self.num_engines}")


# The router's own server options that ``quire up`` takes (and their QUIRE_* variables): its
# keys and limits. Not its address (the stack's --router-host / --router-port / --http-port)
# nor its tokenizer (the engines'). Before, ``quire up`` built its router from defaults, so
# QUIRE_API_KEYS left a local stack open without a word.
ROUTER_OPTIONS = ("model_name", "api_keys", "api_key_file", "max_body_bytes",
                  "max_message_bytes", "max_n", "max_tokens_limit", "max_prompt_chars",
                  "max_stop_strings", "max_stop_string_len", "tokenizer_threads",
                  "http_header_timeout_s", "http_body_timeout_s", "request_timeout_s",
                  "responses_store_bytes")
# the limits both check: the engines get the router's values, so the two never disagree
SHARED_LIMITS = ("max_message_bytes", "max_n", "max_tokens_limit", "max_prompt_chars",
                 "max_stop_strings", "max_stop_string_len")

# an engine's first line: its gRPC port and metrics URL
LISTENING = re.compile(r"listening on \S+:(\d+).*metrics on (\S+)")


def _engine_argv(engine_flags: list[str], num_threads: int) -> list[str]:
    # any free ports, bound by the engine itself (a port picked here and bound there could be
    # taken in between, by any process's outgoing connection); it prints both, and `quire up`
    # repeats them
    argv = [sys.executable, "-m", "quire_cli", "engine", "--host", "127.0.0.1", "--port", "0",
            "--metrics-port", "0"]
    if "--num-threads" not in engine_flags:
        argv += ["--num-threads", str(num_threads)]
    return argv + engine_flags


def changed_engine_flags(ns) -> list[str]:
    """The engine flags the user changed from ``quire engine``'s defaults, to pass on to it."""
    import dataclasses

    from engine_worker.arg_utils import SERVER_DEFAULTS
    from engine_worker.config import EngineArgs

    flags = []
    for field in dataclasses.fields(EngineArgs):
        value = getattr(ns, field.name)
        if value != SERVER_DEFAULTS.get(field.name, field.default):
            if isinstance(value, (list, tuple)):  # --lora-modules a=/x b=/y: one value
                value = ",".join(map(str, value))
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


@dataclass(frozen=True, slots=True)
class EngineProcess:
    proc: subprocess.Popen
    address: str  # host:port of its gRPC server
    metrics_url: str  # its Prometheus endpoint


def kv_memory_flags(engine_flags: list[str], num_engines: int) -> list[str]:
    """Engines on one host share its memory, and each alone would size its KV cache from all
    of it (a fraction of what is available): on the CPU each gets its share of that fraction
    as ``--kv-cache-memory-bytes``, and budgets given for them are checked together. ValueError
    naming both numbers when they do not fit. On a GPU each engine sizes its cache from the
    device's memory, profiled (nothing is passed)."""
    from engine_worker.host_memory import host_available_bytes
    from engine_worker.kv_cache.sizing import check_engines_fit, share_per_engine

    flags = dict(zip(engine_flags[::2], engine_flags[1::2]))  # "--name value" pairs
    device = flags.get("--device", "auto")
    # No torch in this process: a GPU node has NVIDIA device files, as torch would see them.
    on_gpu = device.startswith("cuda") or (
        device == "auto" and any(Path("/dev").glob("nvidia[0-9]*")))
    if on_gpu:
        return []
    available = host_available_bytes()
    if "--kv-cache-memory-bytes" in flags:
        check_engines_fit(kv_cache_memory_bytes=int(flags["--kv-cache-memory-bytes"]),
                          num_engines=num_engines, available_bytes=available)
        return []
    if num_engines == 1:
        return []  # the engine sizes its cache itself, after loading its weights
    utilization = flags.get("--gpu-memory-utilization")
    share = share_per_engine(available_bytes=available, num_engines=num_engines,
                             memory_utilization=None if utilization is None
                             else float(utilization))
    print(f"{num_engines} engines share this host's memory "
          f"({available / (1 << 30):.1f} GiB available): KV cache "
          f"{share / (1 << 30):.2f} GiB each", flush=True)
    return ["--kv-cache-memory-bytes", str(share)]


def start_engines(cfg: StackConfig, engine_flags: list[str],
                  ranks_per_engine: int = 1) -> list[EngineProcess]:
    """Start the engines, each with a metrics port, and wait until each prints that it
    listens. ValueError (before any starts) when their KV caches would not fit together.
    ``ranks_per_engine``: an engine's tensor-parallel processes, which share its cores."""
    threads = max(1, (os.cpu_count() or 1) // (cfg.num_engines * ranks_per_engine))
    engine_flags = engine_flags + kv_memory_flags(engine_flags, cfg.num_engines)
    dirs = ",".join(d for d in (cfg.lora_adapter_dirs, cfg.lora_resolver_dir) if d)
    if dirs:
        engine_flags += ["--lora-adapter-dirs", dirs]
    if cfg.lora_resolver_dir and "--enable-lora" not in engine_flags:
        engine_flags += ["--enable-lora", "True"]
    started = [subprocess.Popen(_engine_argv(engine_flags, threads), stdout=subprocess.PIPE,
                                text=True) for _ in range(cfg.num_engines)]
    deadline = time.monotonic() + cfg.startup_timeout_s
    engines = []
    for i, proc in enumerate(started):
        line = proc.stdout.readline() if time.monotonic() < deadline else ""
        listening = LISTENING.search(line)
        if listening is None:
            stop_engines([EngineProcess(p, "", "") for p in started])
            raise RuntimeError(f"engine {i} (of {len(started)}) did not start (exit code "
                               f"{proc.poll()})")
        engines.append(EngineProcess(proc, f"127.0.0.1:{listening.group(1)}",
                                     listening.group(2)))
    return engines


def restart_engine(engine: EngineProcess) -> EngineProcess:
    """The same engine command started again (same address and flags: a new incarnation, as
    a restarted pod), once it listens. RuntimeError if it does not start."""
    argv = list(engine.proc.args)
    argv[argv.index("--port") + 1] = engine.address.rsplit(":", 1)[1]  # its port, not any
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
    listening = LISTENING.search(proc.stdout.readline())
    if listening is None:
        proc.kill()
        raise RuntimeError(f"engine {engine.address} did not restart (exit code "
                           f"{proc.wait()})")
    return EngineProcess(proc, engine.address, listening.group(2))


def stop_engines(engines: list[EngineProcess]) -> None:
    for engine in engines:
        if engine.proc.poll() is None:
            engine.proc.send_signal(signal.SIGTERM)  # they drain, then exit 0
    for engine in engines:
        try:
            engine.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            engine.proc.kill()


def _key_metadata(key: str | None) -> tuple:
    return (("authorization", f"Bearer {key}"),) if key else ()


async def _example(port: int, tokenizer, key: str | None = None, max_tokens: int = 64) -> str:
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
            sampling=pb.SamplingOptions(temperature=0, max_tokens=max_tokens)), timeout=300,
            metadata=_key_metadata(key))
        async for message in call:
            text += [d.text for d in message.outputs]
    return "".join(text)


async def _example_embedding(port: int, key: str | None = None) -> str:
    """The example for embedding-only engines (--runner pooling): the question's vector."""
    import grpc

    from quire.v1 import engine_pb2 as pb
    from quire.v1 import engine_pb2_grpc

    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = engine_pb2_grpc.EngineServiceStub(channel)
        answer = await stub.Embed(pb.EmbedRequest(text=EXAMPLE_QUESTION), timeout=300,
                                  metadata=_key_metadata(key))
    head = ", ".join(f"{x:.4f}" for x in answer.embedding[:3])
    return f"embedding [{head}, ...] ({len(answer.embedding)} floats)"


async def run_stack(cfg: StackConfig, engines, flow=None, server=None) -> int:
    """The router (tokenizer fetched from the engines) in this process, until Ctrl-C.
    ``flow``: its flow control (a ``router.flow_config.FlowConfig``; None: the defaults);
    ``server``: its ``ROUTER_OPTIONS`` (a dict; None: the defaults). With API keys, the
    example request carries the first."""
    import dataclasses

    from quire.gc_heap import freeze_startup_heap
    from quire.signals import shutdown_event
    from quire.tracing import TracingConfig, make_tracing
    from router.app import RouterServer

    # The engines inherit this environment, so OTEL_* variables trace the whole stack.
    tracing = make_tracing(TracingConfig.from_env(default_service_name="quire-router"))
    router = RouterServer.static([e.address for e in engines], policy=cfg.policy,
                                 host=cfg.router_host, port=cfg.router_port,
                                 http_port=cfg.http_port, tracing=tracing,
                                 flow=dataclasses.asdict(flow) if flow is not None else None,
                                 placement={"lora_resolver_dir": cfg.lora_resolver_dir or ""},
                                 **(server or {}))
    port = await router.start()
    key = next(iter(router.cfg.keys()), None)
    try:
        if not await router.wait_ready(len(engines), timeout_s=cfg.startup_timeout_s):
            raise RuntimeError(f"engines not serving: {router.engine_states()}")
        print(f"quire up: router on {cfg.router_host}:{port} (quire.v1.EngineService) and "
              f"http://{cfg.router_host}:{router.http_port}/v1 (OpenAI API, model "
              f"{router.model_name!r}), engines on {', '.join(e.address for e in engines)}",
              flush=True)
        print(f"quire up: engine metrics on {', '.join(e.metrics_url for e in engines)}",
              flush=True)
        if all(c.info.runner == "pooling" for c in router.pool.serving()):
            answer = await _example_embedding(port, key)  # engines that only embed
        else:
            limit = router.cfg.max_tokens_limit  # (0: none) the example keeps within it
            answer = await _example(port, router.pool.identity.tokenizer, key,
                                    min(64, limit) if limit > 0 else 64)
        print(f"example: {EXAMPLE_QUESTION!r} -> {answer!r}", flush=True)
        freeze_startup_heap()  # the router's process: its start-up heap is never garbage
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
    from engine_worker.arg_utils import add_server_engine_args
    from quire.config_args import add_dataclass_args

    from router.config import HELP, RouterServerConfig
    from router.flow_config import FLOW_HELP, FlowConfig

    add_dataclass_args(parser, StackConfig, "stack")
    add_dataclass_args(parser, RouterServerConfig, "router (its limits also go to the engines: "
                       + ", ".join(SHARED_LIMITS) + ")", HELP, only=ROUTER_OPTIONS)
    add_dataclass_args(parser, FlowConfig, "router flow control", FLOW_HELP)
    add_server_engine_args(parser)


def main(ns: argparse.Namespace) -> int:
    import asyncio

    from quire.config_args import dataclass_from_namespace

    from quire.ports import check_ports_free

    from router.config import RouterServerConfig
    from router.flow_config import FlowConfig

    cfg = dataclass_from_namespace(StackConfig, ns)
    flow = dataclass_from_namespace(FlowConfig, ns)  # bad values fail before engines start
    checked = dataclass_from_namespace(RouterServerConfig, ns, only=ROUTER_OPTIONS)
    server = {name: getattr(checked, name) for name in ROUTER_OPTIONS}
    check_ports_free([(cfg.router_host, cfg.router_port, "router_port"),
                      (cfg.router_host, cfg.http_port, "http_port")])
    resolve_model_once(ns.model)
    engine_flags = changed_engine_flags(ns) + [
        arg for name in SHARED_LIMITS
        for arg in (f"--{name.replace('_', '-')}", str(getattr(ns, name)))]
    if cfg.once and ns.kv_cache_prefault:
        engine_flags += ["--kv-cache-prefault", "False"]
    engines = start_engines(cfg, engine_flags,
                            ranks_per_engine=ns.tensor_parallel_size
                            * ns.pipeline_parallel_size)
    try:
        return asyncio.run(run_stack(cfg, engines, flow, server))
    finally:
        stop_engines(engines)
