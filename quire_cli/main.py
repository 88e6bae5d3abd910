"""The ``quire`` command line: the composition root above the router and the engine.

Every subcommand is named below by "module:function" strings, and its module is imported only
when that subcommand is chosen: ``quire --help`` imports none of them, and ``quire router ...``
imports the router and the shared contract alone, so a router-only install (no torch) runs it."""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass

from quire.config_args import explicit_bool_values


@dataclass(frozen=True, slots=True)
class Command:
    help: str
    add_arguments: str  # "module:function(parser)": adds the subcommand's flags
    run: str  # "module:function(namespace) -> exit code"


@dataclass(frozen=True, slots=True)
class Group:
    help: str
    commands: dict[str, Command | Group]


def _module_command(module: str, help_text: str) -> Command:
    return Command(help_text, f"{module}:add_arguments", f"{module}:main")


BENCHMARKS = Group("benchmarks", {
    "throughput": Command("offline throughput vs transformers generate",
                          "quire_cli.bench.throughput:add_throughput_args",
                          "quire_cli.bench.throughput:run_from_args"),
    "latency": Command("one request: decode speed and TTFT vs transformers",
                       "quire_cli.bench.latency:add_latency_args",
                       "quire_cli.bench.latency:run_from_args"),
    "compare": Command("Quire vs vLLM's CPU build (or --peer llama.cpp) on the same requests, one run",
                       "quire_cli.bench.compare:add_compare_args",
                       "quire_cli.bench.compare:run_from_args"),
    "prefix-cache": Command("shared-prefix workload, prefix caching on vs off",
                            "quire_cli.bench.prefix_cache:add_prefix_cache_args",
                            "quire_cli.bench.prefix_cache:run_from_args"),
    "spec-decode": Command("one request, speculative decoding on vs off (repeat / open)",
                           "quire_cli.bench.spec_decode:add_spec_decode_args",
                           "quire_cli.bench.spec_decode:run_from_args"),
    "lora": Command("long-tailed workload over LoRA adapters + base vs base alone",
                    "quire_cli.bench.lora:add_lora_args",
                    "quire_cli.bench.lora:run_from_args"),
    "lora-router": Command("adapter-aware placement vs round-robin: many LoRA adapters on "
                           "a few engines",
                           "quire_cli.bench.lora_router:add_lora_router_args",
                           "quire_cli.bench.lora_router:run_from_args"),
    "serve": Command("routing policies compared on engine processes under Poisson arrivals",
                     "quire_cli.bench.serve_config:add_serve_args",
                     "quire_cli.bench.serve:run_from_args"),
    "tensor-parallel": Command("one request's decode: the model split across ranks vs one "
                               "process, same cores",
                               "quire_cli.bench.tensor_parallel:add_tensor_parallel_args",
                               "quire_cli.bench.tensor_parallel:run_from_args"),
    "serving": Command("quire up vs vLLM's OpenAI server under vLLM's serving benchmark client",
                       "quire_cli.bench.serving:add_serving_args",
                       "quire_cli.bench.serving:run_from_args"),
    "embed": Command("embedding throughput vs transformers batched like sentence-transformers",
                     "quire_cli.bench.embed:add_embed_args",
                     "quire_cli.bench.embed:run_from_args"),
    "router-overhead": Command("latency the router adds: direct vs routed requests",
                               "quire_cli.bench.serve_config:add_overhead_args",
                               "quire_cli.bench.overhead:run_from_args"),
})

COMMANDS = Group("Quire: a prefix-aware router in front of paged-attention LLM engines", {
    "generate": _module_command("quire_cli.generate", "generate a completion offline"),
    "chat": _module_command("quire_cli.chat", "interactive chat in the terminal"),
    "engine": _module_command("quire_cli.engine",
                              "serve one engine over gRPC (quire.v1.EngineService)"),
    "router": _module_command("quire_cli.router",
                              "serve the router (gRPC + OpenAI HTTP) in front of engines"),
    "up": _module_command("quire_cli.stack",
                          "local stack: a router and N engine processes on loopback"),
    "bench": BENCHMARKS,
})


LOG_LEVEL_HELP = ("INFO (default) shows start-up progress and the choices made; WARNING for "
                  "quiet [env QUIRE_LOG_LEVEL]")


def _load(path: str):
    module, name = path.split(":")
    return getattr(importlib.import_module(module), name)


def _add_commands(parser: argparse.ArgumentParser, group: Group, argv: Sequence[str],
                  dest: str) -> None:
    """One sub-parser per command of ``group``; only the command named in ``argv`` gets its
    flags (its module imported), the others just their line in the help."""
    sub = parser.add_subparsers(dest=dest, required=True)
    chosen = next((i for i, arg in enumerate(argv) if arg in group.commands), None)
    for name, entry in group.commands.items():
        child = sub.add_parser(name, help=entry.help, description=entry.help)
        if chosen is None or argv[chosen] != name:
            continue
        if isinstance(entry, Group):
            _add_commands(child, entry, argv[chosen + 1:], f"{name}_command")
        else:
            _load(entry.add_arguments)(child)
            # also after the command (quire up --log-level WARNING); unset, the one before it
            child.add_argument("--log-level", default=argparse.SUPPRESS, help=LOG_LEVEL_HELP)
            child.set_defaults(_run=entry.run)


def build_parser(argv: Sequence[str] = ()) -> argparse.ArgumentParser:
    """The parser for ``argv``: every command listed, the chosen one with all its flags."""
    parser = argparse.ArgumentParser(prog="quire", description=COMMANDS.help)
    parser.add_argument("--log-level", default=os.environ.get("QUIRE_LOG_LEVEL", "INFO"),
                        help=LOG_LEVEL_HELP)
    _add_commands(parser, COMMANDS, list(argv), "command")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser(argv)
    ns = parser.parse_args(explicit_bool_values(parser, argv))
    logging.basicConfig(level=ns.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return _load(ns._run)(ns)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
