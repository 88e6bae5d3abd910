"""What ``quire generate`` and ``quire chat`` share: sampling flags, building an engine in this
process, streaming one request to the terminal."""

from __future__ import annotations

import argparse
import sys


def add_sampling_args(parser: argparse.ArgumentParser) -> None:
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


def sampling_params(ns: argparse.Namespace):
    from engine_worker import RequestOutputKind, SamplingParams

    return SamplingParams(max_tokens=ns.max_tokens, temperature=ns.temperature, top_p=ns.top_p,
                          top_k=ns.top_k, min_p=ns.min_p,
                          repetition_penalty=ns.repetition_penalty, seed=ns.sample_seed,
                          stop=ns.stop, output_kind=RequestOutputKind.DELTA)


def build_engine(ns: argparse.Namespace):
    from engine_worker.arg_utils import engine_args_from_namespace
    from engine_worker.engine import LLMEngine

    return LLMEngine.from_engine_args(engine_args_from_namespace(ns))


def stream(engine, request_id: str, prompt, params) -> str:
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
