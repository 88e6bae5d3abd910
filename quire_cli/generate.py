"""``quire generate``: one completion offline, streamed to the terminal."""

from __future__ import annotations

import argparse

from quire_cli.offline import add_sampling_args, build_engine, sampling_params, stream


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from engine_worker.arg_utils import add_streaming_engine_args

    parser.add_argument("prompt")
    parser.add_argument("--chat-template", action=argparse.BooleanOptionalAction, default=True,
                        help="wrap the prompt as a user turn in the model's chat template")
    add_streaming_engine_args(parser)
    add_sampling_args(parser)


def main(ns: argparse.Namespace) -> int:
    engine = build_engine(ns)
    params = sampling_params(ns)
    prompt = ns.prompt
    if ns.chat_template:
        prompt = engine.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
        prompt = {"prompt_token_ids": engine.tokenizer.encode(prompt, add_special_tokens=False)}
    stream(engine, "generate-0", prompt, params)
    return 0
