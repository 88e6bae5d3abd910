"""A child process that compiles grammars with xgrammar, so that a compile can be stopped.

xgrammar compiles in C++ and cannot be interrupted: a JSON schema whose string ``pattern`` nests
bounded repetitions (``([a-w]{1,91}){1,91}``) took 144 s here, and a thread running it could
neither be timed out nor stopped when its client left. The engine's server compiles in these
processes instead (``engine_worker.grammar.GrammarCompilerCache.compile_async``) and kills one
whose compile outlives its deadline or every request that waits for it.

The protocol, on the child's stdin and stdout, is frames of an 8-byte little-endian length
and that many bytes of UTF-8 JSON: first the tokenizer info (``TokenizerInfo.serialize_json``),
answered by ``{"ready": true}`` once xgrammar is imported and the compiler built (so a
compile's deadline counts the compile alone, not the worker's start), then one ``[kind,
spec]`` per compile, each answered by ``{"ok": CompiledGrammar JSON}`` or
``{"field": ..., "error": ...}`` (a spec xgrammar refuses; ``"retire": true`` as well after it
ran out of memory: the worker is not used again). Imports only xgrammar and the shared
error type, so a worker starts in the time xgrammar's import takes (about 2-3 s here).

``--memory-bytes N`` caps the worker's address space (RLIMIT_AS) at what it maps once xgrammar
(and the torch it imports, whose CUDA builds map gigabytes of libraries) is imported, plus N:
a JSON schema of 3,000 required properties drove a compile to 16.4 GB on a 24 GiB host, which
thrashed for 7 minutes until the kernel killed it. Under the cap the allocation fails, the
request is refused naming its field, and nothing else on the host notices.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import struct
import sys
from typing import BinaryIO

from quire.errors import FieldError

_LOG_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: ")
FRAME_LENGTH = struct.Struct("<Q")


def choice_grammar(choices: list[str]) -> str:
    """EBNF accepting exactly one of ``choices`` (vLLM's ``choice_as_grammar``)."""
    return "root ::= " + " | ".join('"' + re.sub(r'(["\\])', r"\\\1", c) + '"'
                                    for c in choices)


def compile_spec(compiler, kind: str, spec: str):
    """``spec`` of ``kind`` (a ``StructuredOutputsParams.spec()``) compiled by ``compiler``;
    FieldError naming ``structured_outputs.<kind>`` and xgrammar's reason when it refuses."""
    field = f"structured_outputs.{kind}"
    try:
        if kind == "json":
            compiled = compiler.compile_json_schema(spec, any_whitespace=False)
        elif kind == "json_object":  # an object, as OpenAI's json_object promises
            compiled = compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
        elif kind == "regex":
            compiled = compiler.compile_regex(spec)
        elif kind == "choice":
            compiled = compiler.compile_grammar(choice_grammar(json.loads(spec)))
        elif kind == "structural_tag":
            compiled = _compile_structural_tag(compiler, spec)
        else:
            compiled = compiler.compile_grammar(spec)
    except (RuntimeError, ValueError, TypeError) as e:
        if "bad_alloc" in str(e):  # C++'s out-of-memory, as xgrammar passes it on
            raise MemoryError(str(e)) from None
        # xgrammar's messages start "[hh:mm:ss] /path/file.cc:123: ": not the client's concern
        reason = _LOG_PREFIX.sub("", " ".join(str(e).split()))[:500] or type(e).__name__
        raise FieldError(field, f"cannot be compiled: {reason}") from None
    # JSON is never empty: a schema whose only first token is the end ({"anyOf": []}) allows
    # no value at all
    json_kind = kind in ("json", "json_object")
    if not _can_begin(compiled, text_first=json_kind):
        raise FieldError(field, "allows no JSON value" if json_kind else
                         "matches no text: no token can begin it, not even the end (a rule "
                         "that only refers to itself?)")
    return compiled


def _compile_structural_tag(compiler, spec: str):
    """As vLLM's xgrammar backend: the older form through xgrammar's (deprecated) tags and
    triggers, the newer one as the JSON it is."""
    tag = json.loads(spec)
    if "structures" not in tag:
        return compiler.compile_structural_tag(spec)
    import warnings

    import xgrammar as xgr

    # (a structure without a schema takes any JSON, as vLLM's optional schema)
    items = [xgr.StructuralTagItem(
        begin=s["begin"], schema=json.dumps({} if s.get("schema") is None else s["schema"]),
        end=s["end"]) for s in tag["structures"]]
    with warnings.catch_warnings():  # (xgrammar's deprecation of the form vLLM still takes)
        warnings.simplefilter("ignore", DeprecationWarning)
        return compiler.compile_structural_tag(items, tag["triggers"])


def _can_begin(compiled, text_first: bool) -> bool:
    """Whether any token may come first (the end counts unless ``text_first``): a spec that
    allows none (``root ::= root``) would answer every request with nothing."""
    import xgrammar as xgr

    matcher = xgr.GrammarMatcher(compiled, max_rollback_tokens=0)
    info = compiled.tokenizer_info
    bitmask = xgr.allocate_token_bitmask(1, info.vocab_size)
    matcher.fill_next_token_bitmask(bitmask, 0)
    if text_first:
        for token_id in info.stop_token_ids:  # the end's bits cleared
            bitmask[0, token_id // 32] &= ~(1 << (token_id % 32))
    return bool(bitmask.any())


def frame(payload: object) -> bytes:
    """``payload`` as one frame: its JSON's length, then the JSON."""
    data = json.dumps(payload).encode("utf-8")
    return FRAME_LENGTH.pack(len(data)) + data


def write_frame(stream: BinaryIO, payload: object) -> None:
    stream.write(frame(payload))
    stream.flush()


def read_frame(stream: BinaryIO) -> object | None:
    """The next frame's JSON; None at the end of the stream."""
    head = stream.read(FRAME_LENGTH.size)
    if len(head) < FRAME_LENGTH.size:
        return None
    (length,) = FRAME_LENGTH.unpack(head)
    data = stream.read(length)
    if len(data) < length:
        return None
    return json.loads(data)


def _address_space_bytes() -> int:
    """This process's mapped address space (VmSize), which RLIMIT_AS bounds."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m engine_worker.grammar_worker")
    parser.add_argument("--memory-bytes", type=int, default=0, help="address-space cap (0: none)")
    memory_bytes = parser.parse_args(argv).memory_bytes
    # frames go out on a private copy of stdout; anything the libraries print goes to stderr
    out = os.fdopen(os.dup(sys.stdout.fileno()), "wb")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    source = sys.stdin.buffer
    info_json = read_frame(source)
    if info_json is None:
        return 0
    import xgrammar as xgr

    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo.deserialize_json(info_json),
                                   max_threads=1, cache_enabled=False)
    if memory_bytes > 0:  # what the process maps now, plus the compiles' budget
        limit = _address_space_bytes() + memory_bytes
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    write_frame(out, {"ready": True})
    while (request := read_frame(source)) is not None:
        kind, spec = request
        field = f"structured_outputs.{kind}"
        try:
            compiled = compile_spec(compiler, kind, spec)
            answer = {"ok": compiled.serialize_json()}
        except FieldError as e:
            answer = {"field": e.field, "error": str(e)}
        except (MemoryError, RuntimeError) as e:
            if not isinstance(e, MemoryError) and "bad_alloc" not in str(e):
                raise
            compiled = None
            write_frame(out, {"field": field, "retire": True, "error": (
                f"{field}: needs more than the {memory_bytes} bytes of memory a grammar may "
                "take to compile on this server (--grammar-compile-memory-bytes): too costly "
                "a grammar")})
            return 0  # its heap may be in any state: the engine starts a fresh worker
        write_frame(out, answer)
    return 0


if __name__ == "__main__":
    sys.exit(main())
