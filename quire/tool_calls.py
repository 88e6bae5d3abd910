"""Tool calling on chat completions: OpenAI's ``tools`` / ``tool_choice`` /
``parallel_tool_calls`` checked, rendered into the prompt, enforced and parsed back. Shared by
the router's OpenAI front and the offline ``LLM.chat``, so both render, enforce and parse calls
the same way (plain Python: no torch, no grammar engine).

- **Rendering.** A chat template that reads ``tools`` gets them (``apply_chat_template(...,
  tools=...)``) with the conversation as OpenAI sent it (a call's ``arguments`` decoded to an
  object, as vLLM hands them to templates). A template that ignores tools (SmolLM2's) gets the
  Hermes format spelled out instead: a system block listing the functions and asking for
  ``<tool_call>{"name": ..., "arguments": ...}</tool_call>``, earlier calls written the same
  way in the assistant's turn, and tool results as ``<tool_response>`` in a user turn.
- **Enforcing.** ``"required"`` constrains the output to a JSON array of ``{"name",
  "parameters"}`` objects, one per call (``anyOf`` over the functions, at most one with
  ``parallel_tool_calls: false``); a named function constrains it to that function's
  ``parameters`` schema (vLLM's grammars for both), so arguments always parse.
- **Parsing.** ``"auto"`` output is read as Hermes: text before the first ``<tool_call>`` is
  the content, each ``<tool_call>`` block whose JSON names a known function is a call. Whole
  or streamed, one reader does it (``quire.tool_call_stream``).
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field

from quire.errors import FieldError

TOOL_CALL_START, TOOL_CALL_END = "<tool_call>", "</tool_call>"
_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")
MAX_TOOLS = 128

_SYSTEM_BLOCK = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
    "{tools}\n</tools>\n\nFor each function call, return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>')


@dataclass(frozen=True, slots=True)
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def as_json(self, index: int | None = None) -> dict:
        out = {"id": self.id, "type": "function",
               "function": {"name": self.name, "arguments": self.arguments}}
        return out if index is None else {"index": index} | out


@dataclass(frozen=True, slots=True)
class ToolChoice:
    """The request's tools (OpenAI's function objects) and how they may be used: ``mode`` is
    auto, required or named (``name``); tool_choice none leaves a request without one."""

    tools: tuple[dict, ...]
    mode: str
    name: str | None
    parallel: bool

    @property
    def names(self) -> set[str]:
        return {t["function"]["name"] for t in self.tools}

    def schema(self) -> dict | None:
        """The JSON schema the output must follow (None for auto)."""
        if self.mode == "named":
            return _parameters(next(t for t in self.tools if t["function"]["name"] == self.name))
        if self.mode == "auto":
            return None
        # each function's parameters sit under the array's items, so its local definitions
        # ($defs / definitions, which its "#/$defs/..." refs name from its root) move to the
        # array's root, as vLLM moves them; two functions may not define one name apart
        defs: dict[str, dict] = {}
        branches = []
        for t in self.tools:
            params = dict(_parameters(t))
            for key in ("$defs", "definitions"):
                found = params.pop(key, None)
                if found is not None and not isinstance(found, dict):
                    raise FieldError("tools", f"function {t['function']['name']!r}: "
                                     f"parameters.{key} must be an object")
                for name, schema in (found or {}).items():
                    if defs.setdefault(key, {}).setdefault(name, schema) != schema:
                        raise FieldError("tools", f"two functions define {key}/{name} "
                                         "differently; give them distinct names")
            branches.append({"type": "object", "additionalProperties": False,
                             "required": ["name", "parameters"],
                             "properties": {"name": {"type": "string",
                                                     "enum": [t["function"]["name"]]},
                                            "parameters": params}})
        return {"type": "array", "minItems": 1, "items": {"anyOf": branches}} | (
            {} if self.parallel else {"maxItems": 1}) | defs

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content, calls) of a finished output: what its stream would have sent, read by
        the same reader (``quire.tool_call_stream``), so a whole answer and a streamed one
        never disagree."""
        from quire.tool_call_stream import parse_whole

        return parse_whole(self, text)

    def finish_reason(self, calls: list[ToolCall], finish: str | None) -> str | None:
        """OpenAI's: tool_calls when the model chose to call; stop for a named function."""
        if calls and finish == "stop" and self.mode != "named":
            return "tool_calls"
        return finish


def _compact(text: str) -> str:
    try:
        return json.dumps(json.loads(text), ensure_ascii=False)
    except (ValueError, RecursionError):
        return text


def _parameters(tool: dict) -> dict:
    params = tool["function"].get("parameters")
    return params if isinstance(params, dict) and params else {"type": "object",
                                                               "properties": {}}


def tool_choice_of(body: dict) -> ToolChoice | None:
    """The request's tool use, checked (FieldError naming tools / tool_choice /
    parallel_tool_calls); None when it uses no tools (none, or no tools sent)."""
    tools = body.get("tools") or []
    if not isinstance(tools, list):
        raise FieldError("tools", "must be a list of function tools")
    if len(tools) > MAX_TOOLS:
        raise FieldError("tools", f"at most {MAX_TOOLS} tools, got {len(tools)}")
    seen: set[str] = set()
    for i, tool in enumerate(tools):
        _check_tool(tool, i, seen)
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise FieldError("parallel_tool_calls", "must be a boolean")
    choice = body.get("tool_choice")
    if choice is None:
        choice = "auto" if tools else "none"
    name = None
    if isinstance(choice, dict):
        function = choice.get("function")
        if choice.get("type") != "function" or not isinstance(function, dict) or \
                not isinstance(function.get("name"), str):
            raise FieldError("tool_choice", 'a named choice is {"type": "function", '
                             '"function": {"name": ...}}')
        name = function["name"]
        if name not in seen:
            raise FieldError("tool_choice", f"names the function {name!r}, which is not among "
                             f"the request's tools")
        mode = "named"
    elif choice in ("auto", "required", "none"):
        mode = choice
    else:
        raise FieldError("tool_choice", 'must be "none", "auto", "required" or a named '
                         "function")
    if mode == "none":
        return None
    if not tools:
        raise FieldError("tool_choice", f"{mode!r} needs at least one tool in tools")
    out = ToolChoice(tuple(tools), mode, name, parallel is not False)
    out.schema()  # its definitions must merge (a FieldError naming tools otherwise)
    return out


def _check_tool(tool, i: int, seen: set[str]) -> None:
    where = f"tools[{i}]"
    if not isinstance(tool, dict) or tool.get("type", "function") != "function" or \
            not isinstance(tool.get("function"), dict):
        raise FieldError("tools", f"{where}: must be {{\"type\": \"function\", "
                         "\"function\": {...}}")
    function = tool["function"]
    name = function.get("name")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise FieldError("tools", f"{where}.function.name: must be 1 to 64 letters, digits, "
                         "_ . or -")
    if name in seen:
        raise FieldError("tools", f"{where}.function.name: {name!r} is defined twice")
    seen.add(name)
    params = function.get("parameters")
    if params is not None and not isinstance(params, dict):
        raise FieldError("tools", f"{where}.function.parameters: must be a JSON schema object")
    if function.get("description") is not None and not isinstance(function["description"], str):
        raise FieldError("tools", f"{where}.function.description: must be a string")


# ---- rendering ----------------------------------------------------------------------------------

def template_reads_tools(template: str | None) -> bool:
    return bool(template) and "tools" in template


def render_inputs(messages: list[dict], tools: Sequence[dict] | None, template: str | None
                  ) -> tuple[list[dict], list[dict] | None]:
    """(messages, tools) for the chat template: as sent (calls' arguments as objects) when the
    template reads tools, else in the Hermes format written into the messages themselves.
    ``tools``: the request's checked tools, whatever its tool_choice: as vLLM does by default
    (its ``--exclude-tools-when-tool-choice-none`` off), "none" still shows the model its
    tools, and only forbids calling them."""
    tools = list(tools) if tools else None
    if template_reads_tools(template):
        return [_with_argument_objects(m) for m in messages], tools
    out = []
    for message in messages:
        if message.get("tool_calls"):
            text = "\n".join(f"{TOOL_CALL_START}\n" + json.dumps(
                {"name": c["function"]["name"],
                 "arguments": _arguments_object(c["function"]["arguments"])},
                ensure_ascii=False) + f"\n{TOOL_CALL_END}" for c in message["tool_calls"])
            content = message.get("content") or ""
            out.append({"role": "assistant", "content": (content + "\n" if content else "") +
                        text})
        elif message["role"] == "tool":
            out.append({"role": "user", "content": "<tool_response>\n" +
                        (message.get("content") or "") + "\n</tool_response>"})
        else:
            out.append({k: v for k, v in message.items() if k not in ("tool_calls",
                                                                       "tool_call_id")})
    if tools:
        block = _SYSTEM_BLOCK.format(tools="\n".join(json.dumps(t, ensure_ascii=False)
                                                     for t in tools))
        if out[0]["role"] in ("system", "developer"):
            out[0] = out[0] | {"role": "system",
                               "content": (out[0]["content"] + "\n\n" + block).lstrip()}
        else:
            out.insert(0, {"role": "system", "content": block})
    return out, None


def _arguments_object(arguments):
    if isinstance(arguments, str):
        try:
            value = json.loads(arguments)
            # an escaped lone surrogate ("\ud800") decodes to text no tokenizer takes
            json.dumps(value, ensure_ascii=False).encode("utf-8")
            return value
        except (ValueError, RecursionError):  # not JSON, too deep, or such text: as sent
            return arguments
    return arguments


def _with_argument_objects(message: dict) -> dict:
    if not message.get("tool_calls"):
        return message
    calls = [c | {"function": c["function"] | {
        "arguments": _arguments_object(c["function"]["arguments"])}}
        for c in message["tool_calls"]]
    return message | {"tool_calls": calls}
