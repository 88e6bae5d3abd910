"""``quire chat``: an interactive chat in the terminal, the history kept across turns."""

from __future__ import annotations

import argparse
import sys

from quire_cli.offline import add_sampling_args, build_engine, sampling_params, stream


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from engine_worker.arg_utils import add_streaming_engine_args

    parser.add_argument("--system", default=None, help="system prompt")
    add_streaming_engine_args(parser)
    add_sampling_args(parser)


def main(ns: argparse.Namespace) -> int:
    engine = build_engine(ns)
    params = sampling_params(ns)
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
        reply = stream(engine, f"chat-{turn}", {"prompt_token_ids": ids}, params)
        messages.append({"role": "assistant", "content": reply})
    return 0
