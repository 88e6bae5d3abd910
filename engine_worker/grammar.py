"""Structured outputs: grammars compiled once per spec, one matcher per sequence, and the token
bitmask of a step.

``GrammarCompilerCache`` compiles a ``StructuredOutputsParams`` with xgrammar and keeps the
result under (kind, canonical spec), so a schema sent a thousand times compiles once. The
server compiles before it hands a request to the engine loop (``compile_async``), in child
processes (``engine_worker.grammar_worker``, up to ``compile_workers`` at once) whose results
come back serialized: a large schema then delays only its own request while the loop keeps
stepping the others, and a compile can be stopped, which a thread running xgrammar's C++ cannot
be. One that outlives ``compile_timeout_s`` is killed and its request refused (INVALID_ARGUMENT
naming the field: the spec is too costly for this server); one whose every waiting request
has gone (the client left) is killed at once. Requests for a spec being compiled wait for that
compile. ``LLMEngine.add_request`` finds it compiled (offline, ``compile`` compiles in the
calling thread). A spec xgrammar refuses is a ``FieldError`` naming
``structured_outputs.<kind>`` and xgrammar's reason.

The scheduler owns a ``RequestGrammar`` per sequence (n > 1: one each, forked fresh from the
compiled grammar), fills the step's ``GrammarBitmask`` for the rows that sample and advances
each matcher with the token it accepted; the runner expands the bitmask to the step's sampled
rows and the sampler masks the logits with it. xgrammar is imported on first use (~2.5 s here),
so engines that never see a structured request never pay for it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import sys
import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np

from engine_worker.grammar_worker import FRAME_LENGTH, compile_spec, frame
from engine_worker.sampling_params import StructuredOutputsParams
from quire.errors import FieldError

logger = logging.getLogger(__name__)

_MAX_CACHED_GRAMMARS = 256
# a compile past this is stopped and its request refused: xgrammar compiles ordinary schemas in
# milliseconds to a second or two here; nested bounded repetitions in a pattern take minutes
DEFAULT_COMPILE_TIMEOUT_S = 30.0
DEFAULT_COMPILE_WORKERS = 2  # compiles at once: one costly spec leaves the other free
# A worker's start (Python, xgrammar's import, the vocabulary: 1.4 s here, 3 s on a host at a
# third of this one's speed) is not its first compile's: it has a bound of its own.
WORKER_START_TIMEOUT_S = 120.0
# the address space a worker's compiles may take beyond what it maps after importing xgrammar
# (about 0.75 GB with a CPU torch, gigabytes more with a CUDA one): ordinary schemas compile
# within a few MB; a 1,000-property object took 3.6 GB
DEFAULT_COMPILE_MEMORY_BYTES = 2 << 30
# the directory holding the engine_worker package: the workers import from it, not from their
# working directory
_PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


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


class WorkerDidNotStart(RuntimeError):
    """A compile worker exited or hung before it was ready: the server's fault, not the
    request's (UNAVAILABLE)."""

    def __init__(self, status: int | None) -> None:
        super().__init__("structured outputs are unavailable on this server now: a grammar "
                         "compile worker did not start" + (
                             "" if status is None else f" (exit status {status})"))


class _CompileWorker:
    """One ``engine_worker.grammar_worker`` process and its pipes."""

    def __init__(self, process: asyncio.subprocess.Process) -> None:
        self.process = process

    @classmethod
    async def start(cls, tokenizer_info_json: str, memory_bytes: int) -> _CompileWorker:
        # -P: the working directory is not on its import path (a stray xgrammar.py or h2.py
        # there would be imported instead); the package's own root is, first
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(
            p for p in (_PACKAGE_ROOT, os.environ.get("PYTHONPATH")) if p))
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-P", "-m", "engine_worker.grammar_worker",
            "--memory-bytes", str(memory_bytes), env=env,
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE)
        worker = cls(process)
        try:
            async with asyncio.timeout(WORKER_START_TIMEOUT_S):
                await worker._send(tokenizer_info_json)  # (megabytes: it reads as it starts)
                ready = await worker._read()
        except BaseException as e:  # cancelled (its requests left) while starting: no orphan
            worker.kill()
            if isinstance(e, (asyncio.IncompleteReadError, BrokenPipeError,
                              ConnectionResetError, TimeoutError)):
                status = await process.wait()
                logger.warning("a grammar compile worker (pid %d) did not start (exit status "
                               "%d)", process.pid, status)
                raise WorkerDidNotStart(status) from None
            raise
        if ready != {"ready": True}:
            worker.kill()
            raise WorkerDidNotStart(None)
        return worker

    async def _read(self) -> object:
        head = await self.process.stdout.readexactly(FRAME_LENGTH.size)
        return json.loads(await self.process.stdout.readexactly(FRAME_LENGTH.unpack(head)[0]))

    async def _send(self, payload: object) -> None:
        self.process.stdin.write(frame(payload))
        await self.process.stdin.drain()

    async def compile(self, kind: str, spec: str) -> dict:
        """The worker's answer; FieldError naming the spec's field when the worker died on it
        (killed for memory by the kernel, or crashed in xgrammar), logged with its status."""
        try:
            await self._send([kind, spec])
            return await self._read()
        except (asyncio.IncompleteReadError, BrokenPipeError, ConnectionResetError):
            status = await self.process.wait()
            logger.warning("the grammar compile worker (pid %d) exited with %d while compiling "
                           "a %s spec; the request is refused", self.process.pid, status, kind)
            raise FieldError(f"structured_outputs.{kind}", f"cannot be compiled: the compile "
                             f"stopped (exit status {status}) before it finished") from None

    def kill(self) -> None:
        if self.process.returncode is None:
            try:  # by pid: the transport may belong to a loop that has ended
                os.kill(self.process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


class GrammarCompilerCache:
    """Compiled grammars by (kind, spec), compiled with one xgrammar compiler for the model's
    tokenizer and vocabulary (``vocab_size``: the model's logits width, which may exceed the
    tokenizer's)."""

    def __init__(self, hf_tokenizer: Callable[[], Any], vocab_size: int,
                 stop_token_ids: frozenset[int], max_cached: int = _MAX_CACHED_GRAMMARS,
                 compile_timeout_s: float = DEFAULT_COMPILE_TIMEOUT_S,
                 compile_workers: int = DEFAULT_COMPILE_WORKERS,
                 compile_memory_bytes: int = DEFAULT_COMPILE_MEMORY_BYTES) -> None:
        if compile_timeout_s <= 0 or compile_workers < 1:
            raise ValueError("compile_timeout_s must be > 0 and compile_workers >= 1")
        self._hf_tokenizer = hf_tokenizer  # transformers' tokenizer, asked for on first use
        self.vocab_size = vocab_size
        self._stop_token_ids = sorted(stop_token_ids)
        self._max_cached = max_cached
        self.compile_timeout_s = compile_timeout_s
        self.compile_workers = compile_workers
        self.compile_memory_bytes = compile_memory_bytes
        self._lock = threading.Lock()
        self._compiler = None  # built on first use (imports xgrammar)
        self._info = None  # its TokenizerInfo, which the workers' results are read with
        self._info_json: str | None = None  # serialized once, sent to each worker at start
        self._cache: OrderedDict[tuple[str, str], object] = OrderedDict()
        # a thread for what blocks: building the compiler (xgrammar's import, the vocabulary)
        # and reading a worker's result; compiles themselves run in the workers
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="grammar-compile")
        # the server loop's: compiles running by key, how many requests wait for each, idle
        # workers, and the slots that bound the workers (made on first use, in that loop)
        self._running: dict[tuple[str, str], asyncio.Task] = {}
        self._waiting: dict[tuple[str, str], int] = {}
        self._idle: list[_CompileWorker] = []
        self._busy: set[_CompileWorker] = set()
        self._slots: asyncio.Semaphore | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def _get_compiler(self):
        with self._lock:
            if self._compiler is None:
                import xgrammar as xgr

                info = xgr.TokenizerInfo.from_huggingface(
                    self._hf_tokenizer(), vocab_size=self.vocab_size,
                    stop_token_ids=self._stop_token_ids or None)
                self._compiler = xgr.GrammarCompiler(info, max_threads=1)
                self._info = info
            return self._compiler

    def _get_info_json(self) -> str:
        self._get_compiler()
        with self._lock:
            if self._info_json is None:
                self._info_json = self._info.serialize_json()
            return self._info_json

    def _store(self, key: tuple[str, str], compiled) -> None:
        with self._lock:
            self._cache[key] = compiled
            self._cache.move_to_end(key)
            while len(self._cache) > self._max_cached:
                self._cache.popitem(last=False)

    def compile(self, params: StructuredOutputsParams):
        """The compiled grammar (cached); FieldError naming the field when xgrammar refuses."""
        key = params.spec()
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
        compiled = compile_spec(self._get_compiler(), *key)
        self._store(key, compiled)
        return compiled

    async def compile_async(self, params: StructuredOutputsParams):
        """The compiled grammar, compiled in a worker process (see the module's docstring)
        without blocking the caller's event loop or the engine loop. Cancelling the last
        request that waits for a spec kills its compile."""
        key = params.spec()
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
        task = self._running.get(key)
        if task is None or task.cancelling():  # none, or one being stopped: a fresh compile
            task = asyncio.ensure_future(self._compile_in_worker(key))
            self._running[key] = task
            self._waiting[key] = 0
            task.add_done_callback(partial(self._compile_done, key))
        self._waiting[key] += 1
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            if not task.done() and self._running.get(key) is task:
                self._waiting[key] -= 1
                if self._waiting[key] == 0:  # nobody wants it any more: stop the work
                    task.cancel()
            raise

    def _compile_done(self, key: tuple[str, str], task: asyncio.Task) -> None:
        if self._running.get(key) is task:  # not a fresh compile of the same spec since
            del self._running[key]
            self._waiting.pop(key, None)

    async def _compile_in_worker(self, key: tuple[str, str]):
        loop = asyncio.get_running_loop()
        if self._loop is not loop:  # workers' pipes and the slots belong to one event loop
            for worker in self._idle:
                worker.kill()
            self._idle.clear()
            self._slots = asyncio.Semaphore(self.compile_workers)
            self._loop = loop
        kind, spec = key
        async with self._slots:
            while self._idle and self._idle[-1].process.returncode is not None:
                self._idle.pop()  # it died while idle: not this request's fault
            if self._idle:
                worker = self._idle.pop()
            else:  # a new worker reads the tokenizer first (built and serialized once)
                info_json = await loop.run_in_executor(self._pool, self._get_info_json)
                worker = await _CompileWorker.start(info_json, self.compile_memory_bytes)
            self._busy.add(worker)
            try:
                async with asyncio.timeout(self.compile_timeout_s):
                    reply = await worker.compile(kind, spec)
                if reply.get("retire"):  # out of memory: it has exited
                    await worker.process.wait()
                    logger.warning("a %s spec needed more than %d bytes to compile: the "
                                   "request is refused", kind, self.compile_memory_bytes)
            except TimeoutError:
                worker.kill()
                logger.warning("a %s spec did not compile within %g s: its compile was "
                               "stopped and the request refused", kind,
                               self.compile_timeout_s)
                raise FieldError(f"structured_outputs.{kind}",
                                 f"not compiled within {self.compile_timeout_s:g} s (the "
                                 "server's limit, --grammar-compile-timeout-s): too costly a "
                                 "grammar for this server") from None
            except BaseException:  # cancelled (every waiting request left), or the worker died
                worker.kill()
                raise
            else:
                if worker.process.returncode is None:
                    self._idle.append(worker)
            finally:
                self._busy.discard(worker)
        if "error" in reply:
            raise FieldError(reply["field"], reply["error"].removeprefix(reply["field"] + ": "))
        import xgrammar as xgr

        compiled = await loop.run_in_executor(
            self._pool, xgr.CompiledGrammar.deserialize_json, reply["ok"], self._info)
        self._store(key, compiled)
        return compiled

    def worker_pids(self, busy_only: bool = False) -> list[int]:
        """The compile workers alive now, busy or idle, or only those compiling (for tests and
        diagnostics)."""
        return [w.process.pid for w in (*self._busy, *(() if busy_only else self._idle))
                if w.process.returncode is None]

    def matcher(self, params: StructuredOutputsParams) -> RequestGrammar:
        return RequestGrammar(self.compile(params))

    def close(self) -> None:
        """Kill the compile workers (their compiles fail) and stop the thread."""
        for worker in (*self._busy, *self._idle):
            worker.kill()
        self._idle.clear()
        self._pool.shutdown(wait=False, cancel_futures=True)

    async def aclose(self) -> None:
        """``close``, then wait for the workers to exit (on the loop that started them)."""
        workers = [*self._busy, *self._idle]
        self.close()
        if workers and self._loop is asyncio.get_running_loop():
            await asyncio.gather(*(w.process.wait() for w in workers))
