"""One OpenAI request's answer on the router's HTTP front: its deltas rendered as OpenAI's
choices, chunks, logprobs and usage (``OpenAIRequest``), and relayed from its call, whole
(``collect``) or as server-sent events (``stream``). What a request may carry and how it is
checked is ``router.openai_protocol``'s.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc
from aiohttp import web

from quire.errors import FieldError
from quire.token_pieces import TokenPieces
from quire.tool_call_stream import ToolCallStream
from quire.tool_calls import ToolChoice, tool_choice_of
from quire.v1 import engine_pb2 as pb
from router.openai_protocol import (FINISH, GUIDED_FIELDS, RequestError, bool_field,
                                    error_response)


_PRIME_TOKENS = 4  # prompt tokens a choice's token texts follow (the engine's detokenizer's)


@dataclass
class Choice:
    text: list[str] = field(default_factory=list)
    logprobs: list[pb.PositionLogprobs] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str = ""  # the engine's: the stop string or stop token id that ended it
    token_ids: list[int] = field(default_factory=list)


class OpenAIRequest:
    """One OpenAI request in flight: its kind, ids and how to render deltas and usage."""

    def __init__(self, body: dict, *, chat: bool, model_name: str,
                 token_text: Callable[[int], str],
                 decode: Callable[[list[int]], str] | None = None,
                 pieces: TokenPieces | None = None) -> None:
        """``token_text``: one token's text; ``decode``: a prompt's text from its ids (for
        ``echo``; default: its tokens' texts joined); ``pieces``: the tokenizer's token bytes
        and text steps, so that logprobs name a sequence's tokens by the text each adds
        (None: each by ``token_text``, its bytes that text's)."""
        self.body, self.chat = body, chat
        self.model_name, self.token_text = model_name, token_text
        self.pieces = pieces
        self._text_steps: dict[int, Callable[[int], str]] = {}  # per choice: its tokens' texts
        self.decode = decode or (lambda ids: "".join(map(token_text, ids)))
        # completions' echo: each answer starts with its prompt (and its logprobs); with
        # max_tokens 0 it is the prompt alone (the one token generated is left out)
        self.echo = not chat and bool(bool_field(body, "echo"))
        self.echo_only = self.echo and body.get("max_tokens") == 0
        # chat's (vLLM's): the answer's role, and the text each choice starts with
        self.role, self.chat_echo = chat_role_and_echo(body) if chat else ("assistant", "")
        prompt = body.get("prompt")  # as sent: a batch's prompts, one per k
        self._echoed_prompts = prompt if isinstance(prompt, list) and all(
            isinstance(p, (str, list)) for p in prompt) else [prompt]
        self.n = body.get("n") or 1
        self.truncated: set[int] = set()  # the prompts (k) truncate_prompt_tokens cut
        self.cut_now = False  # the prompt being built was cut (``note_truncation`` reads it)
        self._prompts: dict[int, tuple[str, list[int], list]] = {}  # k -> text, ids, logprobs
        # vLLM's return_token_ids: the prompt's ids and each choice's generated ids beside the
        # text (in a stream: the prompt's in each choice's first chunk, each chunk's own ids)
        self.return_token_ids = bool(bool_field(body, "return_token_ids"))
        # vLLM's return_tokens_as_token_ids: logprobs name tokens "token_id:<id>" (for tokens
        # whose text is not valid UTF-8 on its own)
        self.tokens_as_ids = bool(bool_field(body, "return_tokens_as_token_ids"))
        self.prompt_ids: dict[int, list[int]] = {}  # k -> its prompt's ids (return_token_ids)
        # vLLM's prompt_logprobs beside a whole answer (asked for, or implied by echo: chat's
        # always, completions' with logprobs)
        self.want_prompt_logprobs = not bool_field(body, "stream") and (
            body.get("prompt_logprobs") is not None or (
                bool(bool_field(body, "echo")) if chat else
                self.echo and body.get("logprobs") is not None))
        self._prompt_logprobs: dict[int, list] = {}  # k -> its prompt's entries
        self._prompt_first: dict[int, int] = {}  # k -> its prompt's first token id
        self._prompt_tail: dict[int, list[int]] = {}  # k -> its prompt's last token ids
        self._prompt_logprobs_json: dict[int, list] = {}  # k -> them rendered, once
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.object = "chat.completion" if chat else "text_completion"
        self.stream = bool(bool_field(body, "stream"))
        options = body.get("stream_options") or {}
        # include_obfuscation (OpenAI's padding against length side channels): accepted and
        # ignored, as vLLM does; continuous_usage_stats (vLLM's): usage on every chunk
        if not isinstance(options, dict) or not set(options) <= {
                "include_usage", "include_obfuscation", "continuous_usage_stats"}:
            raise RequestError("stream_options: must be an object with at most "
                               "include_usage, continuous_usage_stats and include_obfuscation",
                               "stream_options")
        flags = {name: bool(bool_field(options, name, where="stream_options."))
                 for name in ("include_usage", "continuous_usage_stats", "include_obfuscation")}
        self.include_usage = flags["include_usage"]
        # as vLLM: only with include_usage
        self.continuous_usage = self.include_usage and flags["continuous_usage_stats"]
        self.want_logprobs = bool(bool_field(body, "logprobs")) if chat else (
            body.get("logprobs") is not None)
        # fields the engine names by their wire name, named as this request sent them (the
        # LoRA adapter is the request's model)
        self.field_aliases: dict[str, str] = {
            "lora_name": "model",
            # the engine names the ids the router sent it, and a prompt too long for the
            # model "prompt"; the client sent a prompt (or messages, rendered into ids)
            "token_ids": "messages" if chat else "prompt", "prompt": "messages" if chat
            else "prompt"}
        if body.get("response_format") is not None:
            self.field_aliases["structured_outputs.json"] = "response_format"
            self.field_aliases["structured_outputs.structural_tag"] = "response_format"
        for name, kind in GUIDED_FIELDS.items():
            if body.get(name) is not None:
                self.field_aliases[f"structured_outputs.{kind}"] = name
        self.tools: ToolChoice | None = None  # how tools may be called; None: not at all
        self.prompt_tools: tuple[dict, ...] = ()  # the tools the prompt shows (any choice)
        if chat:
            try:
                self.tools = tool_choice_of(body)
            except FieldError as e:
                raise RequestError(str(e), e.field) from None
            self.prompt_tools = tuple(body.get("tools") or ())
        if self.tools is not None and self.tools.schema() is not None:
            if body.get("response_format") is not None or \
                    body.get("structured_outputs") is not None or \
                    any(body.get(name) is not None for name in GUIDED_FIELDS):
                raise RequestError("tool_choice: required or a named function cannot be "
                                   "combined with response_format or structured_outputs",
                                   "tool_choice")
            self.field_aliases["structured_outputs.json"] = "tools"
        self._tool_streams: dict[int, ToolCallStream] = {}
        self._text_offsets: dict[int, int] = {}  # per choice: characters of its tokens so far

    def note_truncation(self, k: int) -> None:
        """Record whether prompt ``k``, just built, was cut."""
        if self.cut_now:
            self.truncated.add(k)
        self.cut_now = False

    def envelope(self, choices: list[dict], *, chunk: bool = False) -> dict:
        obj = self.object + (".chunk" if chunk and self.chat else "")
        return {"id": self.id, "object": obj, "created": self.created,
                "model": self.model_name, "choices": choices}

    def prompt_of(self, message) -> int:
        """Which prompt of the request a response message answers: a batch's messages name
        their prompt's request, ``<id>-<k>``."""
        if len(self._echoed_prompts) > 1 and message.request_id.startswith(f"{self.id}-"):
            return int(message.request_id[len(self.id) + 1:])
        return 0

    def saw(self, message) -> None:
        """Keep what ``echo`` repeats from a response message: its prompt's ids (the first
        message of each prompt) and logprobs (one message per prefill chunk, all before the
        prompt's first output); with ``return_token_ids``, its prompt's ids."""
        if self.return_token_ids and message.prompt_token_ids:
            self.prompt_ids[self.prompt_of(message)] = list(message.prompt_token_ids)
        if message.prompt_token_ids:  # (prompt_logprobs' position 0 has none)
            k = self.prompt_of(message)
            self._prompt_first[k] = message.prompt_token_ids[0]
            # what the output's first token follows, as the engine primes its detokenizer
            # (a SentencePiece token's leading space shows only after other text)
            self._prompt_tail[k] = list(message.prompt_token_ids[-_PRIME_TOKENS:])
        if self.want_prompt_logprobs and message.prompt_logprobs:
            self._prompt_logprobs.setdefault(self.prompt_of(message), []).extend(
                message.prompt_logprobs)
        if not self.echo or not (message.prompt_token_ids or message.prompt_logprobs):
            return
        k = self.prompt_of(message)
        if message.prompt_token_ids:
            prompt = self._echoed_prompts[k]
            ids = list(message.prompt_token_ids)
            text = prompt if isinstance(prompt, str) and k not in self.truncated \
                else self.decode(ids)
            self._prompts[k] = (text, ids, [])
        if message.prompt_logprobs and k in self._prompts:
            self._prompts[k][2].extend(message.prompt_logprobs)

    def usage(self, usage: pb.Usage) -> dict:
        """OpenAI's usage object (with ``echo`` and max_tokens 0, nothing was completed)."""
        body = usage_json(usage)
        if self.echo_only:
            body["completion_tokens"] = 0
            body["total_tokens"] = usage.prompt_tokens
        return body

    def _echoed(self, index: int, text: str, entries) -> tuple[str, list, tuple | None]:
        """(text, entries, prompt) of a choice's first output with ``echo``: its prompt in
        front (``prompt``: (ids, logprob entries) for ``logprobs``)."""
        if self.echo_only:
            text, entries = "", []
        prompt = self._prompts.get(index // self.n)
        if prompt is None:
            return text, list(entries), None
        return prompt[0] + text, list(entries), (prompt[1], prompt[2])

    def prompt_logprobs(self, k: int) -> list | None:
        """vLLM's ``prompt_logprobs`` of prompt ``k``: per position (the first has none) the
        prompt's token and the top k by token id, each ``{logprob, rank, decoded_token}``
        (-inf written as -9999.0, as vLLM clamps it; rank null where the engine did not say:
        a vLLM server's token beyond the top k)."""
        entries = self._prompt_logprobs.get(k)
        if entries is None:
            return None
        if k in self._prompt_logprobs_json:  # (the same for each of prompt k's n choices)
            return self._prompt_logprobs_json[k]
        out: list = []
        steps = self._steps()  # the prompt's own tokens: the text each adds (as vLLM's)
        if k in self._prompt_first:
            steps(self._prompt_first[k])
        for e in entries:
            if not e.token_ids:
                out.append(None)
                continue
            ranks = [e.chosen_rank] + list(range(1, len(e.token_ids)))
            names = [steps(e.token_ids[0])] + [self.token_text(t) for t in e.token_ids[1:]]
            position: dict[str, dict] = {}
            for tid, lp, rank, name in zip(e.token_ids, e.logprobs, ranks, names):
                position.setdefault(str(tid), {"logprob": max(lp, -9999.0), "rank": rank or None,
                                               "decoded_token": name})
            out.append(position)
        self._prompt_logprobs_json[k] = out
        return out

    def logprobs(self, entries, index: int = 0, prompt: tuple | None = None) -> dict | None:
        """OpenAI's logprobs object for ``entries`` of choice ``index`` (chat: ``content``;
        completions: ``tokens``, ``token_logprobs``, ``top_logprobs`` holding the chosen
        token and the top k, as vLLM's, and ``text_offset``, each token's start in the
        choice's text, counted on across a stream's chunks)."""
        if not self.want_logprobs:
            return None
        token = (lambda tid: f"token_id:{tid}") if self.tokens_as_ids else self.token_text
        # the choice's own tokens: the text each adds to it (module quire.token_pieces)
        steps = self._text_steps.get(index)
        if steps is None:
            steps = self._text_steps[index] = self._steps()
            for token_id in self._prompt_tail.get(index // self.n, ()):
                steps(token_id)  # (their text is the prompt's, not the choice's)
        chosen_token = token if self.tokens_as_ids else steps
        if self.chat:
            def item(tid, lp, name):  # (bytes: the token's own, whatever names it)
                return {"token": name, "logprob": lp, "bytes": list(self._bytes_of(tid))}
            return {"content": [
                {**item(e.token_ids[0], e.logprobs[0], chosen_token(e.token_ids[0])),
                 "top_logprobs": [item(t, lp, token(t))
                                  for t, lp in zip(e.token_ids[1:], e.logprobs[1:])]}
                for e in entries]}
        tokens = [chosen_token(e.token_ids[0]) for e in entries]
        chosen = [e.logprobs[0] for e in entries]
        tops = [{token(t): lp for t, lp in zip(e.token_ids, e.logprobs)} for e in entries]
        if prompt is not None:  # echo: the prompt's positions first; the first has none
            ids, prompt_entries = prompt
            prompt_token = token if self.tokens_as_ids else self._steps()
            tokens = [prompt_token(t) for t in ids] + tokens
            firsts = [e.logprobs[0] if e.token_ids else None for e in prompt_entries]
            chosen = ([None] * len(ids) if not prompt_entries else firsts) + chosen
            tops = ([None] * len(ids) if not prompt_entries else
                    [{token(t): lp for t, lp in zip(e.token_ids, e.logprobs)} or None
                     for e in prompt_entries]) + tops
        offsets, at = [], self._text_offsets.get(index, 0)
        for text in tokens:
            offsets.append(at)
            at += len(text)
        self._text_offsets[index] = at
        return {"tokens": tokens, "token_logprobs": chosen, "top_logprobs": tops,
                "text_offset": offsets}

    def _steps(self) -> Callable[[int], str]:
        return self.token_text if self.pieces is None else self.pieces.text_steps()

    def _bytes_of(self, token_id: int) -> bytes:
        return self.token_text(token_id).encode() if self.pieces is None else \
            self.pieces.bytes_of(token_id)

    def role_choice(self, index: int) -> dict:
        """A chat stream's first chunk of a choice: the role alone, as OpenAI and vLLM send it
        (readers that skip it as the role chunk lose no text)."""
        return {"index": index, "delta": {"role": self.role, "content": ""},
                "logprobs": None, "finish_reason": None}

    def echo_choice(self, index: int) -> dict | None:
        """A chat stream's second chunk of a choice with ``echo``: the echoed message's text
        (None: nothing to echo), as vLLM sends it before any output."""
        if not self.chat_echo:
            return None
        return {"index": index, "delta": {"content": self.chat_echo}, "logprobs": None,
                "finish_reason": None}

    def stop_reason(self, value: str) -> str | int | None:
        """vLLM's ``stop_reason``: the stop string that ended the choice, or the stop token id
        (an integer); None for EOS or length."""
        stops = self.body.get("stop")
        if not value or value in ([stops] if isinstance(stops, str) else stops or []):
            return value or None
        ids = self.body.get("stop_token_ids") or []
        return int(value) if value.isdigit() and int(value) in ids else value

    def choice(self, index: int, text: str, entries, finish: str | None, *,
               chunk: bool, first: bool = False, stop_reason: str = "",
               token_ids=()) -> dict:
        calls: list = []
        if self.tools is not None:  # the calls in the text, parsed out of it
            if chunk:
                stream = self._tool_streams.setdefault(index, ToolCallStream(self.tools))
                text, calls = stream.feed(text, finished=finish is not None)
                finish = self.tools.finish_reason(stream.calls, finish)
            else:
                text, calls = self.tools.parse(text)
                finish = self.tools.finish_reason(calls, finish)
        prompt = None
        if self.echo and (first or not chunk):
            text, entries, prompt = self._echoed(index, text, entries)
        elif self.echo_only:
            text, entries = "", []
        body: dict = {"index": index, "logprobs": self.logprobs(entries, index, prompt),
                      "finish_reason": finish}
        if finish is not None or not chunk:
            body["stop_reason"] = self.stop_reason(stop_reason)
        if self.return_token_ids:  # (with echo alone, the one token generated is left out)
            body["token_ids"] = [] if self.echo_only else list(token_ids)
            if not self.chat and (first or not chunk):  # completions: on the choice
                body["prompt_token_ids"] = self.prompt_ids.get(index // self.n)
        if self.want_prompt_logprobs and not self.chat:
            body["prompt_logprobs"] = self.prompt_logprobs(index // self.n)
        if not self.chat:
            body["text"] = text
        elif chunk:  # the role came in its own first chunk (role_choice)
            body["delta"] = ({"content": text} if text else {}) | (
                {"tool_calls": calls} if calls else {})
        else:
            content = self.chat_echo + (text or "") if self.chat_echo else text
            # reasoning: vLLM's field, always there (null: no reasoning parser), which code
            # written against vLLM reads as message.reasoning
            body["message"] = {"role": self.role, "content": content, "reasoning": None} | (
                {"tool_calls": [c.as_json() for c in calls]} if calls else {})
        return body


def chat_role_and_echo(body: dict) -> tuple[str, str]:
    """A chat answer's role (vLLM's: the assistant's, or with ``add_generation_prompt`` false
    the last message's) and, with ``echo``, the text each choice starts with: the last
    message's content where its role is the answer's (text parts joined by newlines, as vLLM
    joins them), else nothing. The messages are checked later; a malformed one echoes
    nothing here."""
    echo = bool(bool_field(body, "echo"))
    messages = body.get("messages")
    last = messages[-1] if isinstance(messages, list) and messages else None
    last = last if isinstance(last, dict) else {}
    role = "assistant"
    if body.get("add_generation_prompt") is False and isinstance(last.get("role"), str):
        role = last["role"]
    if not echo or last.get("role") != role:
        return role, ""
    content = last.get("content")
    if isinstance(content, list):
        content = "\n".join(part["text"] for part in content
                            if isinstance(part, dict) and isinstance(part.get("text"), str))
    return role, content if isinstance(content, str) else ""


class _RunningUsage:
    """vLLM's ``continuous_usage_stats``: each chunk's usage, of its own choice so far (its
    prompt's tokens, the tokens it has generated)."""

    def __init__(self, req: OpenAIRequest) -> None:
        self.req = req
        self.prompt_tokens: dict[int, int] = {}  # prompt k -> its tokens
        self.generated: dict[int, int] = {}  # choice index -> tokens so far

    def saw(self, message) -> None:
        if message.prompt_token_ids:
            self.prompt_tokens[self.req.prompt_of(message)] = len(message.prompt_token_ids)
        for delta in message.outputs:
            self.generated[delta.index] = self.generated.get(delta.index, 0) + len(
                delta.token_ids)

    def of(self, index: int, before_output: bool = False) -> dict:
        """The usage a chunk of choice ``index`` carries (a chat choice's role-only first
        chunk and its echo: nothing generated yet, as vLLM counts them)."""
        prompt = self.prompt_tokens.get(index // self.req.n, 0)
        completion = 0 if self.req.echo_only or before_output else self.generated.get(index, 0)
        return {"prompt_tokens": prompt, "completion_tokens": completion,
                "total_tokens": prompt + completion}


def usage_json(usage: pb.Usage) -> dict:
    return {"prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
            "total_tokens": usage.prompt_tokens + usage.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": usage.cached_tokens}}


def sse(payload: dict) -> bytes:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n".encode()


async def messages_of(call, first):
    """``first``, then every later message of ``call``."""
    message = first
    while message is not grpc.aio.EOF:
        yield message
        message = await call.read()



async def collect(req: OpenAIRequest, call, first,
                  account: Callable[[pb.Usage], None]) -> web.Response:
    """The whole answer of ``call`` (``first``: its first message, already read) as one JSON
    response; ``account(usage)`` counts its tokens."""
    return web.json_response(await collect_body(req, call, first, account))


async def collect_body(req: OpenAIRequest, call, first,
                       account: Callable[[pb.Usage], None]) -> dict:
    """``collect``'s answer, as the JSON object."""
    choices: dict[int, Choice] = {}
    usage = pb.Usage()
    async for message in messages_of(call, first):
        req.saw(message)
        for delta in message.outputs:
            choice = choices.setdefault(delta.index, Choice())
            choice.text.append(delta.text)
            choice.token_ids.extend(delta.token_ids)
            choice.logprobs.extend(delta.logprobs)
            if delta.finish_reason:
                choice.finish_reason = FINISH.get(delta.finish_reason, "stop")
                choice.stop_reason = delta.stop_reason
        if message.HasField("usage"):
            usage = message.usage
    account(usage)
    body = req.envelope([req.choice(i, "".join(c.text), c.logprobs, c.finish_reason,
                                    chunk=False, stop_reason=c.stop_reason,
                                    token_ids=c.token_ids)
                         for i, c in sorted(choices.items())])
    if req.chat and req.return_token_ids:  # chat: the prompt's ids on the answer
        body["prompt_token_ids"] = req.prompt_ids.get(0)
    if req.chat and req.want_prompt_logprobs:
        body["prompt_logprobs"] = req.prompt_logprobs(0)
    body["usage"] = req.usage(usage)
    return body

async def stream(request: web.Request, req: OpenAIRequest, call, first,
                 account: Callable[[pb.Usage], None]) -> web.StreamResponse:
    """The answer of ``call`` relayed as server-sent events, ending with ``[DONE]`` (an error
    after the headers went out is reported in-band)."""
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                           "Cache-Control": "no-cache"})
    await response.prepare(request)
    started: set[int] = set()
    usage = _RunningUsage(req) if req.continuous_usage else None
    try:
        async for message in messages_of(call, first):
            req.saw(message)
            if usage is not None:
                usage.saw(message)
            choices = []  # one per chunk, as OpenAI and vLLM stream n > 1
            before_output: set[int] = set()  # the role and echo chunks among them (ids)
            extra: dict[int, dict] = {}  # fields beside the choices of some chunks (by id)
            for delta in message.outputs:
                finish = FINISH.get(delta.finish_reason) if delta.finish_reason else None
                ids = req.return_token_ids and delta.token_ids  # (text may lag its tokens)
                if delta.text or finish or delta.logprobs or ids or delta.index not in started:
                    if req.chat and delta.index not in started:
                        role = req.role_choice(delta.index)
                        opening = [role, req.echo_choice(delta.index)]
                        opening = [c for c in opening if c is not None]
                        before_output.update(map(id, opening))
                        choices.extend(opening)
                        if req.return_token_ids:  # vLLM's: on each choice's role chunk
                            extra[id(role)] = {"prompt_token_ids": req.prompt_ids.get(0)}
                    choice = req.choice(delta.index, delta.text, delta.logprobs, finish,
                                        chunk=True, first=delta.index not in started,
                                        stop_reason=delta.stop_reason,
                                        token_ids=delta.token_ids)
                    started.add(delta.index)
                    if req.tools is None or choice["delta"] or choice["finish_reason"] \
                            or choice["logprobs"] or ids:  # empty while a call is held back
                        choices.append(choice)
            if choices:
                await response.write(b"".join(sse(req.envelope([choice], chunk=True) | (
                    extra.get(id(choice), {})) | ({} if usage is None else {"usage": usage.of(
                        choice["index"], before_output=id(choice) in before_output)}))
                    for choice in choices))
            if message.HasField("usage"):
                account(message.usage)
                if req.include_usage:
                    chunk = req.envelope([], chunk=True) | {"usage": req.usage(message.usage)}
                    await response.write(sse(chunk))
    except grpc.aio.AioRpcError as e:  # headers are gone: report the error in-band
        await response.write(sse(json.loads(error_response(e).text)))
    except ConnectionResetError:
        return response  # the client left; the front's finally cancels the call
    await response.write(b"data: [DONE]\n\n")
    await response.write_eof()
    return response
