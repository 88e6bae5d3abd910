"""Checks of structured-output specs and logit biases that the router and the engine share, so
both refuse the same requests and name the same fields.

What can be known without a grammar engine is checked here (the shape of a spec, JSON that
parses, bias ranges); whether xgrammar can compile a spec is only known on the engine, which
names the field and xgrammar's reason.
"""

from __future__ import annotations

from collections.abc import Mapping

from quire.errors import FieldError
from quire.limits import UINT32_MAX, load_json, shown

# vLLM's StructuredOutputsParams fields, in the order a spec is described.
STRUCTURED_OUTPUT_KINDS = ("json", "regex", "choice", "grammar", "json_object",
                           "structural_tag")
# ... and its options beside the kind, accepted so that a vLLM application's request runs
# unchanged. vLLM's xgrammar backend reads none of them from a request (its server flags
# decide; whitespace_pattern was outlines'), and none changes the output here either: Quire's
# JSON never has free whitespace (xgrammar's any_whitespace=False: json.dumps' spacing) and
# its schemas are xgrammar's strict ones (no properties a schema does not name).
STRUCTURED_OUTPUT_OPTIONS = {"disable_any_whitespace": bool,
                             "disable_additional_properties": bool,
                             "whitespace_pattern": str,
                             "disable_fallback": bool}  # older vLLM releases'; no fallback here
LOGIT_BIAS_MAX = 100.0  # OpenAI's bound, either sign
MAX_LOGIT_BIAS_ENTRIES = 1024  # tokens one request may bias
MAX_CHOICES = 1024
MAX_SPEC_CHARS = 1 << 20  # a schema, regex or grammar of at most this many characters


def structured_outputs_kind(spec: Mapping[str, object], field: str = "structured_outputs"
                            ) -> tuple[str, object]:
    """(kind, value) of the one kind ``spec`` sets (None, False and absent are unset);
    FieldError naming ``field.<kind>`` (or ``field``) otherwise."""
    set_kinds = [k for k in STRUCTURED_OUTPUT_KINDS if spec.get(k) not in (None, False)]
    unknown = sorted(set(spec) - set(STRUCTURED_OUTPUT_KINDS) - set(STRUCTURED_OUTPUT_OPTIONS))
    if unknown:
        raise FieldError(f"{field}.{unknown[0]}", "unknown structured output kind (one of "
                         f"{', '.join(STRUCTURED_OUTPUT_KINDS)}; options: "
                         f"{', '.join(STRUCTURED_OUTPUT_OPTIONS)})")
    for option, kind_of in STRUCTURED_OUTPUT_OPTIONS.items():
        if spec.get(option) is not None and not isinstance(spec[option], kind_of):
            what = "a boolean" if kind_of is bool else "a string"
            raise FieldError(f"{field}.{option}", f"must be {what}, got {shown(spec[option])}")
    if len(set_kinds) != 1:
        raise FieldError(field, f"exactly one of {', '.join(STRUCTURED_OUTPUT_KINDS)} must "
                         f"be set, got {len(set_kinds)}" +
                         (f" ({', '.join(set_kinds)})" if set_kinds else ""))
    kind = set_kinds[0]
    value = spec[kind]
    name = f"{field}.{kind}"
    if kind == "json":
        if isinstance(value, str):
            _check_size(value, name)
            value = load_json(value, name)
        if not isinstance(value, (dict, bool)):
            raise FieldError(name, "must be a JSON schema (an object)")
    elif kind in ("regex", "grammar"):
        if not isinstance(value, str) or not value:
            raise FieldError(name, "must be a non-empty string")
        _check_size(value, name)
    elif kind == "choice":
        if not isinstance(value, list) or not value or \
                not all(isinstance(c, str) and c for c in value):
            raise FieldError(name, "must be a non-empty list of non-empty strings")
        if len(value) > MAX_CHOICES:
            raise FieldError(name, f"at most {MAX_CHOICES} choices, got {len(value)}")
        _check_size("".join(value), name)
    elif kind == "structural_tag":
        value = _structural_tag(value, name)
    elif value is not True:  # json_object
        raise FieldError(name, "must be true when set")
    return kind, value


def _structural_tag(value, name: str) -> dict:
    """vLLM's structural tag (JSON text, or its object): xgrammar's {"type":
    "structural_tag", "format": {...}}, or the older {"structures": [{"begin", "schema",
    "end"}], "triggers": [...]}. Its shape is checked here; the engine's xgrammar checks the
    rest when it compiles it."""
    if isinstance(value, str):
        _check_size(value, name)
        value = load_json(value, name)
    if not isinstance(value, dict):
        raise FieldError(name, "must be a structural tag (a JSON object)")
    if "structures" in value:
        structures, triggers = value.get("structures"), value.get("triggers")
        if not isinstance(structures, list) or not structures or not all(
                isinstance(t, dict) and isinstance(t.get("begin"), str) and
                isinstance(t.get("end"), str) and
                isinstance(t.get("schema", {}), (dict, bool, type(None)))
                for t in structures):
            raise FieldError(name, "structures: must be a non-empty list of {begin, schema, "
                             "end} (strings and a JSON schema, which may be left out)")
        if not isinstance(triggers, list) or not triggers or not all(
                isinstance(t, str) and t for t in triggers):
            raise FieldError(name, "triggers: must be a non-empty list of non-empty strings")
    elif value.get("type") != "structural_tag" or not isinstance(value.get("format"), dict):
        raise FieldError(name, 'must be {"type": "structural_tag", "format": {...}} or '
                         '{"structures": [...], "triggers": [...]}')
    return value


def no_kind_error(field: str) -> FieldError:
    """A ``quire.v1.StructuredOutputs`` that sets no kind."""
    return FieldError(field, f"set one kind ({', '.join(STRUCTURED_OUTPUT_KINDS)})")


def spec_from_proto(message) -> dict | None:
    """A ``quire.v1.StructuredOutputs`` as ``{kind: value}`` (None when no kind is set); the
    JSON schema stays text (``structured_outputs_kind`` parses it)."""
    kind = message.WhichOneof("kind")
    if kind is None:
        return None
    if kind == "choice":
        return {"choice": list(message.choice.choices)}
    return {kind: getattr(message, kind)}


def _check_size(text: str, field: str) -> None:
    if len(text) > MAX_SPEC_CHARS:
        raise FieldError(field, f"at most {MAX_SPEC_CHARS} characters, got {len(text)}")


def check_logit_bias(bias: Mapping, vocab_size: int | None = None, field: str = "logit_bias"
                     ) -> dict[int, float]:
    """``{token id: bias}`` with integer ids (in [0, vocab_size) when given) and finite biases
    in [-100, 100]: FieldError naming ``field`` otherwise. Keys may be digit strings (JSON)."""
    if not isinstance(bias, Mapping):
        raise FieldError(field, "must be an object mapping token ids to biases")
    if len(bias) > MAX_LOGIT_BIAS_ENTRIES:
        raise FieldError(field, f"at most {MAX_LOGIT_BIAS_ENTRIES} tokens, got {len(bias)}")
    out: dict[int, float] = {}
    for key, value in bias.items():
        token_id = key
        if isinstance(key, str):  # no int() of a long key: past 4,300 digits it raises
            short = key.isascii() and key.isdigit() and len(key) <= len(str(UINT32_MAX))
            token_id = int(key) if short else None
        if isinstance(token_id, bool) or not isinstance(token_id, int) or \
                not 0 <= token_id <= UINT32_MAX or \
                (vocab_size is not None and token_id >= vocab_size):
            where = f" in [0, {vocab_size})" if vocab_size is not None else ""
            raise FieldError(field, f"{shown(key)} is not a token id{where}")
        # abs(x) <= bound, not isfinite: an int too large for a float (10**400) is refused
        # like any other, and NaN compares false
        if isinstance(value, bool) or not isinstance(value, (int, float)) or \
                not abs(value) <= LOGIT_BIAS_MAX:
            raise FieldError(field, f"the bias of token {token_id} must be a number in "
                             f"[-{LOGIT_BIAS_MAX:g}, {LOGIT_BIAS_MAX:g}], got {shown(value)}")
        out[token_id] = float(value)
    return out
