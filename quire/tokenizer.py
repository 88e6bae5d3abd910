"""The tokenizer both sides use: tokenize, render chat templates, hash blocks.

No torch and no transformers: the Rust ``tokenizers`` package loads ``tokenizer.json`` and a
sandboxed ``jinja2`` environment renders the chat template with the settings transformers uses
(``transformers/utils/chat_template_utils.py``), so the token ids, prompts and block hashes are
transformers' (the contract tests compare). The router tokenizes with it; the engine too
(``engine_worker.tokenizer``), so the block hashes both sides compute start from one
implementation. ``digest`` is the SHA-256 of ``tokenizer.json``, the value the engine reports
in ``GetModelInfo.tokenizer_digest``; a router compares the two before trusting its hashes.
"""
from __future__ import annotations

import copy
import functools
import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer, processors

from quire.token_pieces import TokenPieces
from quire.tokenizer_digest import TOKENIZER_FILES, tokenizer_digest
from quire.block_hash import hash_block_tokens

_SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token")
_GIL_FREE_CHARS = 4096  # longer texts are tokenized with the GIL released


class FastTokenizer:
    """A fast tokenizer plus chat template loaded from a model directory (no torch, no
    transformers): the router's and the engine's tokenizer both."""

    def __init__(self, backend: Tokenizer, *, digest: str, special_tokens: dict[str, str],
                 chat_template: str | None, config: dict | None = None,
                 named_templates: Mapping[str, str] | None = None) -> None:
        self.backend = backend
        self.digest = digest
        self.special_tokens = special_tokens  # bos_token, eos_token, ... -> token text
        self.chat_template = chat_template  # the default one
        self.config = config or {}  # tokenizer_config.json
        # templates by name (tokenizer_config.json's list form), "default" and "tool_use" as
        # transformers picks them
        self.named_templates = dict(named_templates or {})
        if chat_template is None:
            self.chat_template = self.named_templates.get("default")
        self._compiled: dict[str, jinja2.Template] = {}
        if self.chat_template is not None:  # a broken default fails the load, not a request
            self._compiled[self.chat_template] = _compile_template(self.chat_template)

    @classmethod
    def from_dir(cls, path: str | Path) -> FastTokenizer:
        path = Path(path)
        files = {name: (path / name).read_bytes() for name in TOKENIZER_FILES
                 if (path / name).is_file()}
        if "tokenizer.json" not in files:
            raise ValueError(f"tokenizer: {path} has no tokenizer.json")
        return cls.from_files(files)

    @classmethod
    def from_files(cls, files: Mapping[str, bytes]) -> FastTokenizer:
        """From file contents by name (an engine's ``GetTokenizer`` answer, or a directory)."""
        raw = files.get("tokenizer.json")
        if raw is None:
            raise ValueError("tokenizer: tokenizer.json is missing")
        backend = Tokenizer.from_str(raw.decode("utf-8"))
        config = json.loads(files["tokenizer_config.json"]) \
            if "tokenizer_config.json" in files else {}
        special = {key: text for key in _SPECIAL_KEYS
                   if (text := _token_text(config.get(key))) is not None}
        _prepare_backend(backend, config, special)
        template = files["chat_template.jinja"].decode("utf-8") \
            if "chat_template.jinja" in files else None
        listed = config.get("chat_template")
        if template is None and isinstance(listed, str):
            template = listed
        named = {t["name"]: t["template"] for t in listed if isinstance(t, dict)
                 and isinstance(t.get("name"), str) and isinstance(t.get("template"), str)} \
            if isinstance(listed, list) else {}
        return cls(backend, digest=tokenizer_digest(raw), special_tokens=special,
                   chat_template=template, config=config, named_templates=named)

    @functools.cached_property
    def pieces(self) -> TokenPieces:
        """Token bytes and per-sequence token texts (for logprobs)."""
        return TokenPieces(self.backend)

    @property
    def bos_token(self) -> str | None:
        return self.special_tokens.get("bos_token")

    @property
    def eos_token(self) -> str | None:
        return self.special_tokens.get("eos_token")

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids exactly as transformers' ``tokenizer.encode(text)`` gives them.

        Long texts go through ``encode_batch``, which releases the GIL while it works
        (``encode`` holds it: a 700,000-character prompt froze every other thread for ~1 s),
        so a worker thread tokenizing a giant prompt leaves the event loop running."""
        if len(text) > _GIL_FREE_CHARS:
            return self.backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None, continue_final_message: bool = False,
                            **kwargs) -> str:
        """The prompt text, rendered as transformers' ``apply_chat_template(tokenize=False)``
        (``tools``: OpenAI's function tools, for templates that read them;
        ``continue_final_message``: end the text inside the last message, as transformers
        does it: a tag appended to that message's text marks where to cut)."""
        source = self._template_source(tools)
        final = None
        if continue_final_message:
            messages, final = _tag_final_message(messages, source)
        compiled = self._compiled.get(source)
        if compiled is None:
            compiled = self._compiled[source] = _compile_template(source)
        variables = {**self.special_tokens, **kwargs}  # kwargs override special tokens
        text = compiled.render(messages=messages, tools=tools or None, documents=None,
                               add_generation_prompt=add_generation_prompt, **variables)
        return text if final is None else _cut_at_tag(text, final)

    def _template_source(self, tools: list[dict] | None) -> str:
        """transformers' choice: with tools a "tool_use" template if the model names one, else
        the default; several named templates and no default is an error."""
        if tools and "tool_use" in self.named_templates:
            return self.named_templates["tool_use"]
        if self.chat_template is not None:
            return self.chat_template
        if self.named_templates:
            raise ValueError("messages: this model has several chat templates and no default "
                             f"({', '.join(sorted(self.named_templates))})")
        raise ValueError("messages: this model's tokenizer has no chat template")

    def block_hashes(self, token_ids: Sequence[int], block_size: int,
                     cache_salt: str | None = None, lora_name: str | None = None) -> list[int]:
        """The engine's hashes of every full block of ``token_ids`` (under the LoRA adapter
        ``lora_name``, None: the base model)."""
        return hash_block_tokens(token_ids, block_size, cache_salt=cache_salt,
                                 lora_name=lora_name)


_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "  # transformers' marker


def _tag_final_message(messages: list[dict], template: str | None) -> tuple[list[dict], str]:
    """A copy of ``messages`` whose last message's text (its last text part) ends in the tag,
    and that text as it was."""
    if not messages:
        raise ValueError("continue_final_message: the conversation is empty")
    if template is None or "content" not in template:
        raise ValueError("continue_final_message: the chat template reads no message content")
    messages = copy.deepcopy(messages)
    final = messages[-1].get("content")
    if isinstance(final, (list, tuple)):
        for part in reversed(final):
            if isinstance(part, dict) and isinstance(part.get("text"), str):
                final, part["text"] = part["text"], part["text"] + _CONTINUE_TAG
                break
        else:
            raise ValueError("continue_final_message: the final message has no text to continue")
    elif isinstance(final, str):
        messages[-1]["content"] = final + _CONTINUE_TAG
    else:
        raise ValueError("continue_final_message: the final message has no content to continue")
    return messages, final


def _cut_at_tag(text: str, final: str) -> str:
    tag = _CONTINUE_TAG.strip()
    if final.strip() not in text or tag not in text:
        raise ValueError("continue_final_message: the chat template dropped part of the final "
                         "message")
    at = text.rindex(tag)
    # the template kept the tag's trailing space: cut there; it trimmed it: trim as well
    return text[:at] if text[at:at + len(_CONTINUE_TAG)] == _CONTINUE_TAG else text[:at].rstrip()


def _token_text(value) -> str | None:
    """A special token from tokenizer_config.json: a string or an AddedToken-style dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _prepare_backend(backend: Tokenizer, config: dict, special: dict[str, str]) -> None:
    """Apply what transformers' TokenizersBackend changes in the backend when it loads."""
    backend.no_truncation()
    backend.no_padding()
    backend.encode_special_tokens = bool(config.get("split_special_tokens", False))
    explicit = "add_bos_token" in config or "add_eos_token" in config
    if not explicit and backend.post_processor is not None:
        return  # transformers keeps tokenizer.json's post-processor as it is
    bos, eos = special.get("bos_token"), special.get("eos_token")
    add_bos = bool(config.get("add_bos_token", False)) and bos is not None
    add_eos = bool(config.get("add_eos_token", False)) and eos is not None
    single = f"{bos + ':0 ' if add_bos else ''}$A:0{' ' + eos + ':0' if add_eos else ''}"
    pair = f"{single}{' ' + bos + ':1' if add_bos else ''} $B:1{' ' + eos + ':1' if add_eos else ''}"
    tokens = []
    if add_bos:
        tokens.append((bos, backend.token_to_id(bos)))
    if add_eos:
        tokens.append((eos, backend.token_to_id(eos)))
    backend.post_processor = processors.TemplateProcessing(single=single, pair=pair,
                                                           special_tokens=tokens)


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # as transformers: no HTML escaping, and its options exposed
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(format):
    return datetime.now().strftime(format)


class _TemplateDict:
    """``dict`` for templates without attribute access to the real type."""

    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """``namespace`` that refuses underscore-prefixed attributes."""

    def __init__(*args, **kwargs):
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"chat templates cannot store underscore-prefixed attributes, got {name!r}")


class _GenerationTag(jinja2.ext.Extension):
    """Accepts ``{% generation %}...{% endgeneration %}`` and renders its body unchanged."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller):
        return caller()


def _compile_template(source: str) -> jinja2.Template:
    """The environment of transformers' ``_cached_compile_jinja_template``."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    return env.from_string(source)
