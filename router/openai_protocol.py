"""The OpenAI wire format for the router's HTTP front: request validation (errors name the
field), ``quire.v1`` request building, and the one mapping of errors to HTTP statuses with an
OpenAI-style JSON body. Answers (choices, chunks, usage) are ``router.openai_answer``'s.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable

import grpc
from aiohttp import web

from quire.errors import FieldError, NotFoundError, field_of, http_status
from quire.limits import (DEFAULT_MAX_N, UINT32_MAX, check_cache_salt, check_min_tokens,
                          check_n, check_sampling, shown)
from quire.list_limits import (MAX_CHAT_MESSAGES, MAX_CONTENT_PARTS, MAX_STOP_TOKEN_IDS,
                               check_allowed_token_ids, check_bad_words)
from quire.structured_outputs import check_logit_bias, structured_outputs_kind
from quire.v1 import engine_pb2 as pb
from router.admission import RETRY_AFTER_METADATA

logger = logging.getLogger(__name__)

_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 413: "invalid_request_error", 429: "rate_limit_error",
                503: "service_unavailable", 504: "timeout_error"}
FINISH = {pb.FINISH_REASON_STOP: "stop", pb.FINISH_REASON_LENGTH: "length",
           pb.FINISH_REASON_ABORT: "abort"}
_ROLES = {"system", "developer", "user", "assistant", "tool"}


class RequestError(ValueError):
    """A bad request body; ``param`` names the offending field."""

    def __init__(self, message: str, param: str | None = None, status: int = 400) -> None:
        super().__init__(message)
        self.param = param
        self.status = status


def error_response(error: BaseException, aliases: dict[str, str] | None = None
                   ) -> web.Response:
    """The one place request errors and gRPC statuses become HTTP errors. ``aliases``: the
    request's own name of a field the engine names otherwise (``response_format`` for the
    ``structured_outputs.json`` it became). A refusal that says when to retry (the router's flow
    control) carries it as the ``Retry-After`` header."""
    param = retry_after = None
    if isinstance(error, RequestError):
        status, message, param = error.status, str(error), error.param
    elif isinstance(error, FieldError):  # the router's own checks (LoRA adapters' names)
        status = 404 if isinstance(error, NotFoundError) else 400
        message, param = str(error), error.field
    elif isinstance(error, grpc.aio.AioRpcError):
        status, message = http_status(error.code()), error.details() or ""
        message = message or error.code().name
        field = field_of(error)  # named by the router or the engine, never parsed from text
        param = field.removeprefix("sampling.") if field else None
        if field and field != param and message.startswith(f"{field}: "):
            message = message.removeprefix("sampling.")  # the body's own name for it
        if aliases and param in aliases:
            message = aliases[param] + message.removeprefix(param)
            param = aliases[param]
        retry_after = dict(error.trailing_metadata() or ()).get(RETRY_AFTER_METADATA)
    else:
        logger.exception("internal error in the OpenAI front", exc_info=error)
        status, message = 500, f"internal error: {type(error).__name__}"
    body = {"error": {"message": message, "type": _ERROR_TYPES.get(
                          status, "invalid_request_error" if status < 500 else "internal_error"),
                      "param": param, "code": status}}
    response = web.json_response(body, status=status)
    if retry_after is not None:
        response.headers["Retry-After"] = retry_after
    return response


def request_priority(body: dict) -> int:
    """vLLM's ``priority``: an int32, lower runs first; 0 (also when absent) takes the
    tenant's default."""
    value = body.get("priority")
    if value is None:
        return 0
    if not isinstance(value, int) or isinstance(value, bool) or \
            not -2 ** 31 <= value < 2 ** 31:
        raise RequestError(f"priority: must be an integer in [-2**31, 2**31), got "
                           f"{shown(value)}", "priority")
    return value


def cache_salt(body: dict) -> str:
    """vLLM's ``cache_salt``: requests share cached prefixes only with an equal salt ("":
    none sent); ``check_cache_salt``'s bounds."""
    value = body.get("cache_salt")
    if value is None:
        return ""
    try:
        return check_cache_salt(value)
    except FieldError as e:
        raise RequestError(str(e), e.field) from None


def truncation(body: dict, default_side: str = "left") -> tuple[int, str] | None:
    """vLLM's ``truncate_prompt_tokens`` (k: keep k of the prompt's tokens; -1:
    ``max_model_len``) and ``truncation_side`` ("left" keeps the last k, "right" the first k;
    unset: ``default_side``, vLLM's for generation; its pooling models cut on the right);
    None when not asked."""
    keep, side = body.get("truncate_prompt_tokens"), body.get("truncation_side")
    if side is not None and side not in ("left", "right"):
        raise RequestError(f"truncation_side: must be left or right, got {shown(side)}",
                           "truncation_side")
    if keep is None:
        return None
    if isinstance(keep, bool) or not isinstance(keep, int) or keep == 0 or \
            not -1 <= keep < 2 ** 31:
        raise RequestError(f"truncate_prompt_tokens: must be -1 (max_model_len) or a positive "
                           f"integer, got {shown(keep)}", "truncate_prompt_tokens")
    return keep, side or default_side


def truncate_ids(ids: list[int], truncate: tuple[int, str], max_model_len: int,
                 reserve: int = 0) -> tuple[list[int], bool]:
    """(ids cut to ``truncation``'s k, whether they were cut); ``reserve``: tokens the caller
    puts before them (a BOS). -1 leaves one token of the context to generate, as vLLM."""
    keep, side = truncate
    if keep > max_model_len:  # as vLLM refuses it
        raise RequestError(f"truncate_prompt_tokens: must be at most max_model_len "
                           f"({max_model_len}), got {keep}", "truncate_prompt_tokens")
    keep = max_model_len - 1 - reserve if keep == -1 else keep
    if len(ids) <= keep:
        return ids, False
    return (ids[-keep:] if side == "left" else ids[:keep]), True


# ---- validation -------------------------------------------------------------------------------

# Fields every generation request may carry (each validated below).
_SAMPLING_FIELDS = frozenset({
    "model", "max_tokens", "temperature", "top_p", "n", "stream", "stream_options", "stop",
    "presence_penalty", "frequency_penalty", "seed", "top_k", "min_p", "repetition_penalty",
    "min_tokens", "stop_token_ids", "ignore_eos", "logit_bias", "response_format",
    "structured_outputs", "priority", "include_stop_str_in_output", "skip_special_tokens",
    "spaces_between_special_tokens", "cache_salt", "return_token_ids",
    "prompt_logprobs", "return_tokens_as_token_ids", "allowed_token_ids",
    "bad_words", "truncate_prompt_tokens", "truncation_side"}) | frozenset({
        "guided_json", "guided_regex", "guided_choice", "guided_grammar"})
# vLLM's older extra-body names of structured outputs (vLLM 0.32 no longer reads them):
# each is one structured_outputs kind, refused under its own name
GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                 "guided_grammar": "grammar"}
# Accepted and ignored: they change nothing about what is generated (OpenAI's own fields that
# the official client sends: identifiers, caching and storage hints, a predicted output, which
# only speeds up OpenAI's own decoding, and GPT-5's verbosity hint, as vLLM ignores it).
IGNORED_FIELDS = frozenset({"user", "metadata", "store", "service_tier", "parallel_tool_calls",
                            "prompt_cache_key", "prompt_cache_retention", "safety_identifier",
                            "prediction", "verbosity"})
# Accepted only in the form that means "off" (the feature is not implemented): any other value is
# a 400 naming the field, as vLLM answers for what it does not support.
_OFF_FORMS: dict[str, Callable[[object, dict], bool]] = {
    "best_of": lambda v, body: v is None or v == 1 or v == body.get("n", 1),
    "suffix": lambda v, body: v is None or v == "",
    "functions": lambda v, body: v is None or v == [],
    "function_call": lambda v, body: v is None or v == "none",
    # vLLM's default; the detokenizer joins special tokens as the tokenizer writes them
    "spaces_between_special_tokens": lambda v, body: v is None or v is True,
    # a template sent in the request is code the router would run: vLLM refuses it too
    # unless started with --trust-request-chat-template
    "chat_template": lambda v, body: v is None,
    # outputs and tools this server does not have: only their "off" values
    "modalities": lambda v, body: v is None or v == ["text"],
    "audio": lambda v, body: v is None,
    "web_search_options": lambda v, body: v is None,
    "use_beam_search": lambda v, body: v is None or v is False,
    "kv_transfer_params": lambda v, body: v is None,
    "prompt_embeds": lambda v, body: v is None,
}
_OFF_EVERYWHERE = frozenset({"use_beam_search", "kv_transfer_params"})
COMPLETION_FIELDS = _SAMPLING_FIELDS | _OFF_EVERYWHERE | {
    "prompt", "logprobs", "best_of", "suffix", "echo", "add_special_tokens", "prompt_embeds"}
# with vLLM's chat-template fields (router.chat_template reads them)
CHAT_FIELDS = _SAMPLING_FIELDS | _OFF_EVERYWHERE | {
    "messages", "max_completion_tokens", "logprobs", "top_logprobs", "tools", "tool_choice",
    "functions", "function_call", "add_generation_prompt", "continue_final_message",
    "chat_template_kwargs", "add_special_tokens", "chat_template", "reasoning_effort",
    "modalities", "audio", "web_search_options", "echo"}
# OpenAI's legacy completions default (vLLM's too): a request that does not send max_tokens
# gets 16 tokens; one that sends null gets what the server allows.
COMPLETIONS_DEFAULT_MAX_TOKENS = 16


_IDENTIFIER = re.compile(r"[A-Za-z_]\w{0,63}", re.ASCII)


def body_key(name: str, position: int) -> str:
    """How errors name a top-level field: by its key, or, where the key cannot name it (empty,
    or not valid Unicode), by its place among the body's keys: ``"body key #2"`` (1-based, in the
    order sent)."""
    return name if name and _valid_unicode(name) else f"body key #{position}"


def check_body(body: dict, *, chat: bool, known: frozenset[str] | None = None) -> None:
    """Before anything reads the body: every string is valid Unicode, and every field is one
    this server implements (or accepts and ignores). RequestError naming the field (as
    ``body_key`` names it) in its message and ``param``. ``known``: the route's fields, when
    it is neither completions nor chat."""
    for position, (name, value) in enumerate(body.items(), 1):
        try:
            name.encode("utf-8")
            json.dumps(value, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            field = body_key(name, position)
            raise RequestError(f"{field}: contains a lone surrogate (\\ud800-\\udfff escape "
                               f"without its pair); strings must be valid Unicode",
                               field) from None
    if known is None:
        known = CHAT_FIELDS if chat else COMPLETION_FIELDS
    for position, (name, value) in enumerate(body.items(), 1):
        if name in IGNORED_FIELDS:
            continue
        if name not in known:
            if _IDENTIFIER.fullmatch(name):
                raise RequestError(f"{name}: unknown or unsupported field", name)
            field = body_key(name, position)  # the key itself, quoted under "body" if it can
            where = "body" if field == name else field
            raise RequestError(f"{where}: unknown or unsupported field {shown(name)}", field)
        off = _OFF_FORMS.get(name)
        if off is not None and not off(value, body):
            raise RequestError(f"{name}: is not supported by this server, got {shown(value)}",
                               name)


def _valid_unicode(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _number(body: dict, name: str, *, rule: str | None = None, hi: int | None = None,
            why: str = ""):
    """``body[name]`` (None when absent) checked by the sampling range ``rule`` (default: the
    field's own) of ``quire.limits``, the engine's own check: RequestError naming ``name``."""
    value = body.get(name)
    if value is None:
        return None
    try:
        return check_sampling(rule or name, value, field=name, hi=hi, why=why)
    except FieldError as e:
        raise RequestError(str(e), e.field) from None


def bool_field(body: dict, name: str, where: str = "") -> bool | None:
    """``body[name]``, a boolean or absent; ``where``: the path of ``body`` in the request
    (``stream_options.``), for the error's field."""
    value = body.get(name)
    if value is not None and not isinstance(value, bool):
        raise RequestError(f"{where}{name}: must be a boolean, got {shown(value)}",
                           where + name)
    return value


def _stop(body: dict, max_stop_strings: int, max_stop_string_len: int) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise RequestError("stop: must be a non-empty string or a list of them", "stop")
    if len(stops) > max_stop_strings:
        raise RequestError(f"stop: at most {max_stop_strings} stop strings, got {len(stops)}",
                           "stop")
    if any(len(s) > max_stop_string_len for s in stops):
        raise RequestError(f"stop: each stop string at most {max_stop_string_len} characters",
                           "stop")
    return stops


def _check_length(value, limit: int, field: str, what: str, *, param: str | None = None) -> None:
    """The shared list limits (``quire.list_limits``), checked before the list is walked."""
    if isinstance(value, list) and len(value) > limit:
        raise RequestError(f"{field}: at most {limit} {what}, got {len(value)}", param or field)


# Prompts in one completions request (a batch): each is a request of its own in the router's
# flow control, so at most a tenant's default queue (256).
MAX_BATCH_PROMPTS = 256


def check_batch(prompts: list) -> None:
    _check_length(prompts, MAX_BATCH_PROMPTS, "prompt", "prompts")


def token_list(value) -> list[int] | None:
    if isinstance(value, list) and value and all(
            isinstance(t, int) and not isinstance(t, bool) and 0 <= t <= UINT32_MAX
            for t in value):
        return value
    return None


def sampling_options(body: dict, *, chat: bool, max_n: int = DEFAULT_MAX_N,
                     max_tokens_limit: int = 0, max_stop_strings: int = 16,
                     max_stop_string_len: int = 256) -> pb.SamplingOptions:
    """``SamplingOptions`` for an OpenAI request body (RequestError naming the bad field).
    ``max_tokens_limit`` 0: no cap here (the engine still bounds it by its own limit and its
    max_model_len). Every number must fit its wire field: no value is wrapped or clipped."""
    s = pb.SamplingOptions()
    if body.get("n") is not None:
        try:
            s.n = check_n(body["n"], max_n)
        except ValueError as e:
            raise RequestError(str(e), "n") from None
    for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                 "repetition_penalty", "min_tokens"):
        value = _number(body, name)
        if value is not None:
            setattr(s, name, value)
    top_k = _number(body, "top_k")
    if top_k is not None:
        s.top_k = max(top_k, 0)  # -1 (vLLM's "off") is 0 here
    seed = _number(body, "seed")
    if seed is not None:
        s.seed = seed
    cap, why = (max_tokens_limit, " (the server's --max-tokens-limit)") if max_tokens_limit \
        else (None, "")
    echo = not chat and bool(bool_field(body, "echo"))
    names = ("max_tokens", "max_completion_tokens") if chat else ("max_tokens",)
    if echo and body.get("max_tokens") == 0 and not isinstance(body["max_tokens"], bool):
        names = ()  # the prompt alone (scoring): one token is generated and left out
        s.max_tokens = 1
    for name in names:  # chat: max_completion_tokens wins when both are set
        max_tokens = _number(body, name, rule="max_tokens", hi=cap, why=why)
        if max_tokens is not None:
            s.max_tokens = max_tokens
    if not chat and "max_tokens" not in body:  # cut to the room the prompt leaves, as any
        s.max_tokens = COMPLETIONS_DEFAULT_MAX_TOKENS if cap is None else \
            min(COMPLETIONS_DEFAULT_MAX_TOKENS, cap)
    if s.HasField("min_tokens") and s.HasField("max_tokens"):
        try:
            check_min_tokens(s.min_tokens, s.max_tokens)
        except FieldError as e:
            raise RequestError(str(e), e.field) from None
    s.stop[:] = _stop(body, max_stop_strings, max_stop_string_len)
    if body.get("stop_token_ids") is not None:
        _check_length(body["stop_token_ids"], MAX_STOP_TOKEN_IDS, "stop_token_ids",
                      "stop token ids")
        ids = [] if body["stop_token_ids"] == [] else token_list(body["stop_token_ids"])
        if ids is None:
            raise RequestError("stop_token_ids: must be a list of token ids", "stop_token_ids")
        s.stop_token_ids[:] = ids
    s.ignore_eos = bool(bool_field(body, "ignore_eos"))
    s.include_stop_str_in_output = bool(bool_field(body, "include_stop_str_in_output"))
    skip_special = bool_field(body, "skip_special_tokens")
    if skip_special is not None:
        s.skip_special_tokens = skip_special
    if body.get("logit_bias") is not None:
        try:
            s.logit_bias.update(check_logit_bias(body["logit_bias"]))
        except FieldError as e:
            raise RequestError(str(e), e.field) from None
    try:  # vLLM's; the engine checks the ids against its vocabulary and tokenizes the words
        if body.get("allowed_token_ids") is not None:
            ids = check_allowed_token_ids(body["allowed_token_ids"])
            if max(ids) > UINT32_MAX:
                raise FieldError("allowed_token_ids", f"{max(ids)} is not a token id")
            s.allowed_token_ids[:] = ids
        if body.get("bad_words") is not None:
            s.bad_words[:] = check_bad_words(body["bad_words"])
    except FieldError as e:
        raise RequestError(str(e), e.field) from None
    structured = structured_outputs_of(body)
    if structured is not None:
        s.structured_outputs.CopyFrom(structured)
    if chat:
        top = _number(body, "top_logprobs", rule="logprobs")
        if bool_field(body, "logprobs"):
            s.logprobs = top or 0
        elif top:  # 0 with logprobs off asks for nothing (generic clients send both defaults)
            raise RequestError("top_logprobs: requires logprobs to be true", "top_logprobs")
        if bool_field(body, "echo") and not bool_field(body, "stream"):
            s.prompt_logprobs = top or 0  # vLLM's: chat's echo returns the prompt's logprobs
    else:
        logprobs = _number(body, "logprobs")
        if logprobs is not None:
            s.logprobs = logprobs
            if echo:  # the echoed prompt's logprobs too
                s.prompt_logprobs = logprobs
    prompt_logprobs = _number(body, "prompt_logprobs", rule="logprobs")
    if prompt_logprobs is not None:  # vLLM's: the prompt's, beside the answer
        if prompt_logprobs and bool_field(body, "stream"):
            raise RequestError("prompt_logprobs: not available when stream is true (as vLLM)",
                               "prompt_logprobs")
        s.prompt_logprobs = prompt_logprobs
    return s


def structured_outputs_of(body: dict) -> pb.StructuredOutputs | None:
    """OpenAI's ``response_format`` or vLLM's extra-body ``structured_outputs`` as the wire's
    ``StructuredOutputs`` (None: unconstrained); RequestError naming the field."""
    fmt, extra = body.get("response_format"), body.get("structured_outputs")
    guided = [name for name in GUIDED_FIELDS if body.get(name) is not None]
    given = (["response_format"] if fmt is not None else []) + (
        ["structured_outputs"] if extra is not None else []) + guided
    if len(given) > 1:
        raise RequestError(f"{given[0]}: cannot be combined with {given[1]}", given[0])
    spec, field = None, "structured_outputs"
    if fmt is not None:
        spec, field = _response_format_spec(fmt), "response_format"
    elif extra is not None:
        if not isinstance(extra, dict):
            raise RequestError("structured_outputs: must be an object", "structured_outputs")
        spec = {k: v for k, v in extra.items() if v is not None}
    elif guided:
        field = guided[0]
        spec = {GUIDED_FIELDS[field]: body[field]}
    if spec is None:
        return None
    try:
        kind, value = structured_outputs_kind(spec, field)
    except FieldError as e:
        # guided_json, not guided_json.json; response_format, not response_format.structural_tag
        name = field if field in GUIDED_FIELDS or field == "response_format" else e.field
        raise RequestError(name + str(e).removeprefix(e.field), name) from None
    out = pb.StructuredOutputs()
    if kind == "choice":
        out.choice.choices[:] = value
    elif kind in ("json", "structural_tag"):
        setattr(out, kind, json.dumps(value))
    else:
        setattr(out, kind, value)
    return out


def _response_format_spec(fmt) -> dict | None:
    if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_object",
                                                            "json_schema", "structural_tag"):
        raise RequestError("response_format: must be an object whose type is text, json_object, "
                           f"json_schema or structural_tag, got {shown(fmt)}", "response_format")
    if fmt["type"] == "text":
        return None
    if fmt["type"] == "json_object":
        return {"json_object": True}
    if fmt["type"] == "structural_tag":  # vLLM's: the whole object is the tag
        return {"structural_tag": fmt}
    schema = fmt.get("json_schema")
    if not isinstance(schema, dict) or not isinstance(schema.get("schema"), (dict, bool)):
        raise RequestError("response_format.json_schema.schema: a JSON schema (an object) is "
                           "required", "response_format")
    if schema.get("strict") is not None and not isinstance(schema["strict"], bool):
        raise RequestError(f"response_format.json_schema.strict: must be a boolean, got "
                           f"{shown(schema['strict'])}", "response_format")
    return {"json": schema["schema"]}


_MESSAGE_KEYS = frozenset({"role", "content", "name", "tool_calls", "tool_call_id"})
# Echoed back by clients from earlier responses; accepted while empty.
_EMPTY_MESSAGE_KEYS = frozenset({"function_call", "refusal", "audio", "annotations",
                                 "reasoning_content", "reasoning"})
# An assistant's earlier text kept in history beside its content: its reasoning goes to the
# template as ``reasoning_content`` (as vLLM passes it: templates of reasoning models read it,
# others ignore it), a refusal is what it said where content is empty.
_ASSISTANT_TEXT_KEYS = ("reasoning_content", "reasoning", "refusal")


def chat_messages(body: dict, max_chars: int = 1 << 20) -> list[dict]:
    """The conversation, checked before any template rendering; its text may hold at most
    ``max_chars`` characters in all (the same bound as a text prompt)."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError("messages: a non-empty list of messages is required", "messages")
    _check_length(messages, MAX_CHAT_MESSAGES, "messages", "messages")
    out = []
    # the tools the prompt shows count too (their JSON, as the template writes them)
    num_chars = _json_chars(body.get("tools")) if isinstance(body.get("tools"), list) else 0
    if num_chars > max_chars:
        raise RequestError(f"tools: at most {max_chars} characters, got {num_chars}", "tools")
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str) or \
                message["role"] not in _ROLES:
            raise RequestError(f"messages[{i}].role: must be one of {sorted(_ROLES)}", "messages")
        texts = {}
        for key, value in message.items():
            if key in _ASSISTANT_TEXT_KEYS and message["role"] == "assistant" and \
                    isinstance(value, str) and value:
                texts[key] = value
                num_chars += len(value)
            elif key not in _MESSAGE_KEYS and not (key in _EMPTY_MESSAGE_KEYS and value in
                                                   (None, [], "")):
                raise RequestError(f"messages[{i}].{key}: is not supported by this server",
                                   "messages")
        if message.get("name") is not None and not isinstance(message["name"], str):
            raise RequestError(f"messages[{i}].name: must be a string", "messages")
        content = message.get("content")
        if isinstance(content, list):  # content parts: only text is supported
            _check_length(content, MAX_CONTENT_PARTS, f"messages[{i}].content", "parts",
                          param="messages")
            if not all(isinstance(p, dict) and p.get("type") == "text" and
                       isinstance(p.get("text"), str) for p in content):
                raise RequestError(f"messages[{i}].content: only text parts are supported",
                                   "messages")
            content = "\n".join(p["text"] for p in content)  # as vLLM joins them
        if content is not None and not isinstance(content, str):
            raise RequestError(f"messages[{i}].content: must be a string", "messages")
        num_chars += len(content or "")
        if num_chars > max_chars:
            raise RequestError(f"messages: at most {max_chars} characters of content in all",
                               "messages")
        entry = {"role": message["role"], "content": content or texts.get("refusal", "")} | (
            {"name": message["name"]} if message.get("name") is not None else {})
        reasoning = texts.get("reasoning_content") or texts.get("reasoning")
        if reasoning:
            entry["reasoning_content"] = reasoning
        if message.get("tool_calls") not in (None, []):
            if message["role"] != "assistant":
                raise RequestError(f"messages[{i}].tool_calls: only assistant messages carry "
                                   "tool calls", "messages")
            entry["tool_calls"] = _tool_calls(message["tool_calls"], i)
            num_chars += sum(len(c["function"]["name"]) + _json_chars(
                c["function"]["arguments"]) for c in entry["tool_calls"])
            if num_chars > max_chars:
                raise RequestError(f"messages: at most {max_chars} characters of content in "
                                   "all (tool calls' arguments included)", "messages")
        if message.get("tool_call_id") is not None:
            if not isinstance(message["tool_call_id"], str):
                raise RequestError(f"messages[{i}].tool_call_id: must be a string", "messages")
            entry["tool_call_id"] = message["tool_call_id"]
        out.append(entry)
    return out


def _json_chars(value) -> int:
    """The characters ``value`` takes as JSON text (a string: its own length)."""
    if isinstance(value, str):
        return len(value)
    try:
        return len(json.dumps(value, ensure_ascii=False))
    except (TypeError, ValueError, RecursionError):
        return 0  # not JSON: refused where it is checked


def _tool_calls(calls, i: int) -> list[dict]:
    """An assistant message's earlier calls, as OpenAI sends them back."""
    where = f"messages[{i}].tool_calls"
    if not isinstance(calls, list):
        raise RequestError(f"{where}: must be a list", "messages")
    _check_length(calls, MAX_CONTENT_PARTS, where, "calls", param="messages")
    out = []
    for j, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str) or \
                not isinstance(function.get("arguments", ""), (str, dict)):
            raise RequestError(f"{where}[{j}]: must be {{\"type\": \"function\", \"id\": "
                               "..., \"function\": {\"name\": ..., \"arguments\": ...}}",
                               "messages")
        out.append({"id": str(call.get("id") or ""), "type": "function",
                    "function": {"name": function["name"],
                                 "arguments": function.get("arguments", "")}})
    return out
