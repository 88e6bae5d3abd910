"""Structured outputs: grammars compiled once per spec, one matcher per sequence, and the token
bitmask of a step.

``GrammarCompilerCache`` compiles a ``StructuredOutputsParams`` with xgrammar and keeps the
result under (kind, canonical spec), so a schema sent a thousand times compiles once. The
server compiles on the cache's own worker thread before it hands a request to the engine loop
(``compile_async``): a large schema then delays only its own request while the loop keeps
stepping the others; ``LLMEngine.add_request`` finds it compiled. A spec xgrammar refuses is a
``FieldError`` naming ``structured_outputs.<kind>`` and xgrammar's reason.

The scheduler owns a ``RequestGrammar`` per sequence (n > 1: one each, forked fresh from the
compiled grammar), fills the step's ``GrammarBitmask`` for the rows that sample and advances
each matcher with the token it accepted; the runner expands the bitmask to the step's sampled
rows and the sampler masks the logits with it. xgrammar is imported on first use (~2.5 s here),
so engines that never see a structured request never pay for it.
"""

from __future__ import annotations

import asyncio
import re
import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from engine_worker.sampling_params import StructuredOutputsParams
from quire.errors import FieldError

_MAX_CACHED_GRAMMARS = 256
_LOG_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: ")


@dataclass(frozen=True, slots=True)
class GrammarBitmask:
    """One step's allowed tokens for the sequences that sample under a grammar: row i of
    ``words`` (int32 [num_rows, ceil(vocab_size / 32)], bit b of word w allows token 32 w + b)
    is ``req_ids[i]``'s."""

    req_ids: tuple[str, ...]
    words: np.ndarray

    def rows_for(self, req_ids: list[str]) -> np.ndarray | None:
        """Rows for ``req_ids`` in order; -1 (every token allowed) for a request without a
        row; None when none has one."""
        index = {r: i for i, r in enumerate(self.req_ids)}
        picked = [index.get(r, -1) for r in req_ids]
        if all(i < 0 for i in picked):
            return None
        out = np.full((len(req_ids), self.words.shape[1]), -1, dtype=np.int32)
        for row, i in enumerate(picked):
            if i >= 0:
                out[row] = self.words[i]
        return out


class RequestGrammar:
    """One sequence's matcher: which tokens may come next, and the tokens it took."""

    __slots__ = ("compiled", "_matcher")

    def __init__(self, compiled) -> None:
        import xgrammar as xgr

        self.compiled = compiled
        self._matcher = xgr.GrammarMatcher(compiled, max_rollback_tokens=0)

    def fork(self) -> RequestGrammar:
        """A fresh matcher on the same grammar (a sample forked before its first token)."""
        return RequestGrammar(self.compiled)

    def accept(self, token_id: int) -> bool:
        """Advance past ``token_id``; False if the grammar did not allow it."""
        return self._matcher.accept_token(token_id)

    @property
    def is_terminated(self) -> bool:
        return self._matcher.is_terminated()

    def fill(self, bitmask, row: int) -> None:
        self._matcher.fill_next_token_bitmask(bitmask, row)


def grammar_bitmask(rows: list[tuple[str, RequestGrammar]]) -> GrammarBitmask | None:
    """The step's bitmask for ``rows`` (req_id, grammar) that sample this step."""
    if not rows:
        return None
    import xgrammar as xgr

    vocab_size = rows[0][1].compiled.tokenizer_info.vocab_size
    bitmask = xgr.allocate_token_bitmask(len(rows), vocab_size)
    for i, (_, grammar) in enumerate(rows):
        grammar.fill(bitmask, i)
    return GrammarBitmask(tuple(r for r, _ in rows), bitmask.numpy())


def choice_grammar(choices: list[str]) -> str:
    """EBNF accepting exactly one of ``choices`` (vLLM's ``choice_as_grammar``)."""
    return "root ::= " + " | ".join('"' + re.sub(r'(["\\])', r"\\\1", c) + '"'
                                    for c in choices)


class GrammarCompilerCache:
    """Compiled grammars by (kind, spec), compiled with one xgrammar compiler for the model's
    tokenizer and vocabulary (``vocab_size``: the model's logits width, which may exceed the
    tokenizer's)."""

    def __init__(self, hf_tokenizer: Callable[[], Any], vocab_size: int,
                 stop_token_ids: frozenset[int], max_cached: int = _MAX_CACHED_GRAMMARS) -> None:
        self._hf_tokenizer = hf_tokenizer  # transformers' tokenizer, asked for on first use
        self.vocab_size = vocab_size
        self._stop_token_ids = sorted(stop_token_ids)
        self._max_cached = max_cached
        self._lock = threading.Lock()
        self._compiler = None  # built on first use (imports xgrammar)
        self._cache: OrderedDict[tuple[str, str], object] = OrderedDict()
        # one thread: compilations queue behind each other, never behind the engine loop
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="grammar-compile")

    def _get_compiler(self):
        with self._lock:
            if self._compiler is None:
                import xgrammar as xgr

                info = xgr.TokenizerInfo.from_huggingface(
                    self._hf_tokenizer(), vocab_size=self.vocab_size,
                    stop_token_ids=self._stop_token_ids or None)
                self._compiler = xgr.GrammarCompiler(info, max_threads=1)
            return self._compiler

    def compile(self, params: StructuredOutputsParams):
        """The compiled grammar (cached); FieldError naming the field when xgrammar refuses."""
        key = params.spec()
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
        compiled = self._compile(self._get_compiler(), *key)
        with self._lock:
            self._cache[key] = compiled
            while len(self._cache) > self._max_cached:
                self._cache.popitem(last=False)
        return compiled

    async def compile_async(self, params: StructuredOutputsParams):
        """``compile`` on the cache's worker thread (awaited without blocking the caller's
        event loop or the engine loop)."""
        key = params.spec()
        with self._lock:
            if key in self._cache:
                return self._cache[key]
        return await asyncio.get_running_loop().run_in_executor(self._pool, self.compile, params)

    def matcher(self, params: StructuredOutputsParams) -> RequestGrammar:
        return RequestGrammar(self.compile(params))

    @staticmethod
    def _compile(compiler, kind: str, spec: str):
        field = f"structured_outputs.{kind}"
        try:
            if kind == "json":
                return compiler.compile_json_schema(spec, any_whitespace=False)
            if kind == "json_object":  # an object, as OpenAI's json_object promises
                return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
            if kind == "regex":
                return compiler.compile_regex(spec)
            if kind == "choice":
                import json

                return compiler.compile_grammar(choice_grammar(json.loads(spec)))
            return compiler.compile_grammar(spec)
        except (RuntimeError, ValueError, TypeError) as e:
            # xgrammar's messages start "[hh:mm:ss] /path/file.cc:123: ": not the client's concern
            reason = _LOG_PREFIX.sub("", " ".join(str(e).split()))[:500] or type(e).__name__
            raise FieldError(field, f"cannot be compiled: {reason}") from None

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
