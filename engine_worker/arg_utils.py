"""Every engine argument as a command-line flag and a ``QUIRE_*`` environment variable.

Flags are derived from ``EngineArgs`` so a new engine option appears on the command line by
itself. A flag beats its environment variable, which beats the default.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import typing

from engine_worker.config import EngineArgs

_HELP = {
    "model": "local HF directory, .gguf file, or the embedded model's Hub id (default: embedded "
             "SmolLM2-135M-Instruct)",
    "tokenizer": "tokenizer directory, if not the model's",
    "dtype": "auto (bf16 where supported), bfloat16, float16 or float32",
    "max_model_len": "longest sequence (prompt + output) in tokens",
    "block_size": "tokens per KV block",
    "kv_cache_memory_bytes": "KV cache budget in bytes (overrides gpu_memory_utilization)",
    "gpu_memory_utilization": "fraction of free memory for the KV cache (host memory on CPU)",
    "enable_prefix_caching": "reuse cached KV blocks across requests (true/false)",
    "max_num_seqs": "most requests in one batch",
    "max_num_batched_tokens": "most tokens in one step (prefill is chunked to fit)",
    "scheduling_policy": "fcfs or priority",
    "long_prefill_token_threshold": "cap on one request's prefill chunk (0: none)",
    "seed": "seed of the engine's default random stream",
    "device": "auto, cpu or cuda[:N]",
    "num_threads": "torch CPU threads",
}


def env_name(field_name: str) -> str:
    return "QUIRE_" + field_name.upper()


def _parse_bool(text: str) -> bool:
    value = text.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected a boolean, got {text!r}")


def _base_type(annotation) -> type:
    hints = [a for a in typing.get_args(annotation) if a is not type(None)] or [annotation]
    return hints[0]


def add_dataclass_args(parser: argparse.ArgumentParser, cls, title: str,
                       helps: dict[str, str] | None = None) -> None:
    """One ``--flag`` (and ``QUIRE_FLAG`` variable) per field of the dataclass ``cls``."""
    group = parser.add_argument_group(title)
    hints = typing.get_type_hints(cls)
    for field in dataclasses.fields(cls):
        kind = _base_type(hints[field.name])
        flag = "--" + field.name.replace("_", "-")
        env = os.environ.get(env_name(field.name))
        parse = _parse_bool if kind is bool else kind
        default = parse(env) if env is not None else field.default
        group.add_argument(flag, dest=field.name, type=parse, default=default,
                           help=f"{(helps or {}).get(field.name, '')} [env {env_name(field.name)}]")


def dataclass_from_namespace(cls, ns: argparse.Namespace):
    return cls(**{f.name: getattr(ns, f.name) for f in dataclasses.fields(cls)})


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    add_dataclass_args(parser, EngineArgs, "engine", _HELP)


def engine_args_from_namespace(ns: argparse.Namespace) -> EngineArgs:
    return dataclass_from_namespace(EngineArgs, ns)
