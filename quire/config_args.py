"""Flags from frozen config dataclasses: one ``--flag`` and one ``QUIRE_*`` variable per field.

Shared by the engine, the router and ``quire up`` so a new option appears on the command line by
itself. A flag beats its environment variable, which beats the default. Torch-free.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import typing


def env_name(field_name: str) -> str:
    return "QUIRE_" + field_name.upper()


def _parse_bool(text: str) -> bool:
    value = text.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected a boolean, got {text!r}")


def _is_bool_word(text: str) -> bool:
    return text.strip().lower() in ("1", "true", "yes", "on", "0", "false", "no", "off")


def explicit_bool_values(parser: argparse.ArgumentParser, argv: list[str]) -> list[str]:
    """``argv`` with each bare boolean flag written ``--flag=true`` unless a boolean word
    follows it, so ``--enforce-eager "a prompt"`` leaves the prompt to the positional that
    follows (a boolean flag takes an optional value, which argparse would otherwise take)."""
    flags: set[str] = set()
    pending = [parser]
    while pending:
        current = pending.pop()
        for action in current._actions:
            if action.type is _parse_bool:
                flags.update(action.option_strings)
            if isinstance(action, argparse._SubParsersAction):
                pending.extend(action.choices.values())
    out = list(argv)
    for i, arg in enumerate(out):
        if arg == "--":
            break
        if arg in flags and (i + 1 == len(out) or not _is_bool_word(out[i + 1])):
            out[i] = f"{arg}=true"
    return out


def _base_type(annotation) -> type:
    hints = [a for a in typing.get_args(annotation) if a is not type(None)] or [annotation]
    return hints[0]


def add_dataclass_args(parser: argparse.ArgumentParser, cls, title: str,
                       helps: dict[str, str] | None = None,
                       only: tuple[str, ...] | None = None) -> None:
    """One ``--flag`` (and ``QUIRE_FLAG`` variable) per field of the dataclass ``cls`` (of the
    fields named in ``only``, where given); its help ends with the default in force (the
    variable's value where it is set), unless it already says its default in words."""
    group = parser.add_argument_group(title)
    hints = typing.get_type_hints(cls)
    for field in dataclasses.fields(cls):
        if only is not None and field.name not in only:
            continue
        kind = _base_type(hints[field.name])
        flag = "--" + field.name.replace("_", "-")
        env = os.environ.get(env_name(field.name))
        parse = _parse_bool if kind is bool else kind
        default = parse(env) if env is not None else field.default
        # a boolean flag alone means true (``--enforce-eager``), or takes a value
        # (``--enable-prefix-caching false``); see explicit_bool_values
        extra = {"nargs": "?", "const": True} if kind is bool else {}
        text = (helps or {}).get(field.name, "").replace("%", "%%")
        # a help that says its default in words keeps it; a secret's value is never shown
        if "default" not in text.lower() and "api_key" not in field.name:
            text += " (default: %(default)s)"
        group.add_argument(flag, dest=field.name, type=parse, default=default, **extra,
                           help=f"{text} [env {env_name(field.name)}]".lstrip())


def dataclass_from_namespace(cls, ns: argparse.Namespace, only: tuple[str, ...] | None = None):
    """``cls`` from the flags ``add_dataclass_args`` added (``only``: those fields; the others
    keep their defaults)."""
    return cls(**{f.name: getattr(ns, f.name) for f in dataclasses.fields(cls)
                  if only is None or f.name in only})


def require_at_least(cfg, names: tuple[str, ...], minimum: int = 1) -> None:
    """For a config's ``__post_init__``: each named field must be >= ``minimum``, or a
    ValueError naming the first that is not."""
    for name in names:
        value = getattr(cfg, name)
        if value < minimum:
            raise ValueError(f"{name}: must be at least {minimum}, got {value}")
