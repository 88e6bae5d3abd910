"""The ``quire`` command line. Subcommands import their heavy dependencies lazily, so
``quire --help`` (and a router-only install) never loads torch."""

from __future__ import annotations

import argparse
import importlib
import logging
import sys


def _add_sampling_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=256)
    g.add_argument("--temperature", type=float, default=0.0,
                   help="0 is greedy (the default here)")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--repetition-penalty", type=float, default=1.0)
    g.add_argument("--sample-seed", type=int, default=None, help="per-request seed")
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")


def _sampling_params(ns: argparse.Namespace):
    from engine_worker import RequestOutputKind, SamplingParams

    return SamplingParams(max_tokens=ns.max_tokens, temperature=ns.temperature, top_p=ns.top_p,
                          top_k=ns.top_k, min_p=ns.min_p,
                          repetition_penalty=ns.repetition_penalty, seed=ns.sample_seed,
                          stop=ns.stop, output_kind=RequestOutputKind.DELTA)


def _build_engine(ns: argparse.Namespace):
    from engine_worker.arg_utils import engine_args_from_namespace
    from engine_worker.engine import LLMEngine

    return LLMEngine.from_engine_args(engine_args_from_namespace(ns))


def _stream(engine, request_id: str, prompt, params) -> str:
    """Run one request, printing text as it is produced; returns the full completion."""
    engine.add_request(request_id, prompt, params)
    pieces = []
    while engine.has_unfinished_requests():
        for output in engine.step().outputs:
            text = output.outputs[0].text
            pieces.append(text)
            sys.stdout.write(text)
            sys.stdout.flush()
    sys.stdout.write("\n")
    return "".join(pieces)


def cmd_generate(ns: argparse.Namespace) -> int:
    engine = _build_engine(ns)
    params = _sampling_params(ns)
    prompt = ns.prompt
    if ns.chat_template:
        prompt = engine.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
        prompt = {"prompt_token_ids": engine.tokenizer.encode(prompt, add_special_tokens=False)}
    _stream(engine, "generate-0", prompt, params)
    return 0


def cmd_chat(ns: argparse.Namespace) -> int:
    engine = _build_engine(ns)
    params = _sampling_params(ns)
    messages: list[dict] = []
    if ns.system:
        messages.append({"role": "system", "content": ns.system})
    print("Chatting with the model; an empty line or Ctrl-D ends.", file=sys.stderr)
    for turn in range(1_000_000):
        try:
            user = input("> ")
        except EOFError:
            break
        if not user.strip():
            break
        messages.append({"role": "user", "content": user})
        text = engine.tokenizer.apply_chat_template(messages)
        ids = engine.tokenizer.encode(text, add_special_tokens=False)
        reply = _stream(engine, f"chat-{turn}", {"prompt_token_ids": ids}, params)
        messages.append({"role": "assistant", "content": reply})
    return 0


def cmd_engine(ns: argparse.Namespace) -> int:
    import asyncio

    from quire.config_args import dataclass_from_namespace
    from engine_worker.server.app import serve
    from engine_worker.server.config import ServerConfig

    cfg = dataclass_from_namespace(ServerConfig, ns)
    engine = _build_engine(ns)
    asyncio.run(serve(engine, cfg))
    return 0


def cmd_router(ns: argparse.Namespace) -> int:
    import asyncio

    from quire.config_args import dataclass_from_namespace
    from router.app import serve
    from router.config import DiscoveryConfig, EngineTLSConfig, PlacementConfig, RouterServerConfig

    configs = [dataclass_from_namespace(cls, ns) for cls in
               (RouterServerConfig, DiscoveryConfig, PlacementConfig, EngineTLSConfig)]
    asyncio.run(serve(*configs))
    return 0


def cmd_up(ns: argparse.Namespace) -> int:
    import asyncio

    from quire.config_args import dataclass_from_namespace
    from quire.up import (StackConfig, changed_engine_flags, resolve_model_once, run_stack,
                          start_engines, stop_engines)

    cfg = dataclass_from_namespace(StackConfig, ns)
    resolve_model_once(ns.model)
    engines = start_engines(cfg, changed_engine_flags(ns))
    try:
        return asyncio.run(run_stack(cfg, engines))
    finally:
        stop_engines(engines)


# ``quire bench NAME``: help, the function adding its flags, the function running it (as
# "module:function", imported only when used, so ``quire --help`` stays cheap and torch-free).
BENCHMARKS = {
    "throughput": ("offline throughput vs transformers generate",
                   "engine_worker.benchmarks.throughput:add_throughput_args",
                   "engine_worker.benchmarks.throughput:run_from_args"),
    "latency": ("one request: decode speed and TTFT vs transformers",
                "engine_worker.benchmarks.latency:add_latency_args",
                "engine_worker.benchmarks.latency:run_from_args"),
    "prefix-cache": ("shared-prefix workload, prefix caching on vs off",
                     "engine_worker.benchmarks.prefix_cache:add_prefix_cache_args",
                     "engine_worker.benchmarks.prefix_cache:run_from_args"),
    "serve": ("routing policies compared on engine processes under Poisson arrivals",
              "router.benchmarks.config:add_serve_args", "router.benchmarks.serve:run_from_args"),
    "router-overhead": ("latency the router adds: direct vs routed requests",
                        "router.benchmarks.config:add_overhead_args",
                        "router.benchmarks.overhead:run_from_args"),
}


def _import(path: str):
    module, name = path.split(":")
    return getattr(importlib.import_module(module), name)


def cmd_bench(ns: argparse.Namespace) -> int:
    return _import(ns.bench_run)(ns)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="quire", description=__doc__)
    parser.add_argument("--log-level", default="WARNING")
    sub = parser.add_subparsers(dest="command", required=True)

    from engine_worker.arg_utils import add_engine_args

    gen = sub.add_parser("generate", help="generate a completion offline")
    gen.add_argument("prompt")
    gen.add_argument("--chat-template", action=argparse.BooleanOptionalAction, default=True,
                     help="wrap the prompt as a user turn in the model's chat template")
    add_engine_args(gen)
    _add_sampling_args(gen)
    gen.set_defaults(func=cmd_generate)

    chat = sub.add_parser("chat", help="interactive chat in the terminal")
    chat.add_argument("--system", default=None, help="system prompt")
    add_engine_args(chat)
    _add_sampling_args(chat)
    chat.set_defaults(func=cmd_chat)

    eng = sub.add_parser("engine", help="serve one engine over gRPC (quire.v1.EngineService)")
    from quire.config_args import add_dataclass_args
    from engine_worker.server.config import ServerConfig

    add_dataclass_args(eng, ServerConfig, "server")
    add_engine_args(eng)
    eng.set_defaults(func=cmd_engine)

    rt = sub.add_parser("router", help="serve the router (gRPC + OpenAI HTTP) in front of engines")
    from router.config import HELP as ROUTER_HELP
    from router.config import DiscoveryConfig, EngineTLSConfig, PlacementConfig, RouterServerConfig

    for cls, title in ((RouterServerConfig, "router"), (DiscoveryConfig, "discovery"),
                       (PlacementConfig, "placement"), (EngineTLSConfig, "engine TLS")):
        add_dataclass_args(rt, cls, title, ROUTER_HELP)
    rt.set_defaults(func=cmd_router)

    up = sub.add_parser("up", help="local stack: a router and N engine processes on loopback")
    from quire.up import StackConfig

    add_dataclass_args(up, StackConfig, "stack")
    add_engine_args(up)
    up.set_defaults(func=cmd_up)

    bench = sub.add_parser("bench", help="benchmarks")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    for name, (help_text, add_args, run) in BENCHMARKS.items():
        sub_parser = bench_sub.add_parser(name, help=help_text)
        _import(add_args)(sub_parser)
        sub_parser.set_defaults(func=cmd_bench, bench_run=run)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    ns = parser.parse_args(argv)
    logging.basicConfig(level=ns.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return ns.func(ns)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
