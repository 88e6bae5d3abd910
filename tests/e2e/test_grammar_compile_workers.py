"""Grammar compiles run in worker processes that can be stopped (engine_worker.grammar), against
a real engine server on loopback: a costly spec is refused after --grammar-compile-timeout-s
and its compile killed, a compile whose client left is killed, and a costly compile does not
hold back another request's grammar.

The costly spec is a JSON-schema string ``pattern`` with nested bounded repetitions, which
xgrammar 0.2.9 compiles in time growing with the product of the bounds: 9 s for
``([a-w]{1,20}){1,20}`` and 23 s for ``{1,30}`` x ``{1,30}`` on a 2-core Zen 5 (144 s for
``{1,91}`` x ``{1,91}``, the probe's spec). The tests use ``{1,40}`` x ``{1,40}``, which no
machine here compiles within the few seconds the tests allow it."""

from __future__ import annotations

import json
import os
import threading
import time

import grpc
import pytest

from quire.v1 import engine_pb2 as pb
from tests.e2e.router_harness import TIMEOUT_S, start_engine

COSTLY = '{"type": "string", "pattern": "([a-w]{1,40}){1,40}"}'
TIMEOUT = 4.0  # the server's --grammar-compile-timeout-s here


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    running = start_engine(tiny_model_dir, grammar_compile_timeout_s=TIMEOUT)
    yield running
    running.close()


def grammars(engine):
    return engine.server.async_engine.engine.grammars


def worker_pids(engine, busy_only: bool = False) -> list[int]:
    async def read():
        return grammars(engine).worker_pids(busy_only)
    return engine.call(read())


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"  # a zombie has exited
    except (FileNotFoundError, ProcessLookupError):  # gone before the open, or between open and read
        return False


def structured(json_schema: str | None = None, choices=None, **kwargs) -> pb.GenerateRequest:
    outputs = pb.StructuredOutputs(json=json_schema) if json_schema is not None else \
        pb.StructuredOutputs(choice=pb.StructuredOutputs.Choices(choices=choices))
    return pb.GenerateRequest(text="Answer:", sampling=pb.SamplingOptions(
        max_tokens=4, structured_outputs=outputs), **kwargs)


def wait_for(predicate, timeout_s: float = TIMEOUT_S) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


def test_a_costly_grammar_is_refused_after_the_timeout_and_its_compile_killed(engine):
    seen: set[int] = set()
    watching = threading.Event()

    def watch():
        while not watching.is_set():
            seen.update(worker_pids(engine))
            time.sleep(0.05)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        with pytest.raises(grpc.RpcError) as info:
            list(engine.stub.Generate(structured(COSTLY), timeout=TIMEOUT_S))
    finally:
        watching.set()
        watcher.join()
    error = info.value
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error
    assert dict(error.trailing_metadata())["quire-error-field"] == \
        "sampling.structured_outputs.json"
    assert f"not compiled within {TIMEOUT:g} s" in error.details()
    assert seen and os.getpid() not in seen
    # the one worker that ran it was killed (no other compile started one)
    assert wait_for(lambda: not any(alive(p) for p in seen)), seen
    # the engine serves on, structured requests included
    done = list(engine.stub.Generate(structured(choices=["yes", "no"]), timeout=TIMEOUT_S))
    text = "".join(d.text for m in done for d in m.outputs)
    assert text in ("yes", "no") and done[-1].outputs[0].finish_reason == pb.FINISH_REASON_STOP


def test_a_cheap_grammar_is_served_while_a_costly_one_compiles_and_a_leaving_client_stops_it(
        engine):
    grammars(engine).compile_timeout_s = 600.0  # only the client's leaving stops it here
    try:
        costly = engine.stub.Generate(structured(COSTLY), timeout=TIMEOUT_S)
        first: list = []
        reader = threading.Thread(target=lambda: first.extend(_drain(costly)))
        reader.start()
        # the costly compile's worker (an idle one from an earlier test is not it)
        assert wait_for(lambda: len(worker_pids(engine, busy_only=True)) >= 1)
        busy = set(worker_pids(engine, busy_only=True))
        # another spec compiles on the other worker and is answered meanwhile
        done = list(engine.stub.Generate(structured(choices=["red", "blue"]), timeout=TIMEOUT_S))
        text = "".join(d.text for m in done for d in m.outputs)
        assert text in ("red", "blue")
        assert reader.is_alive(), "the costly compile ended before the cheap request was served"
        costly.cancel()  # the client leaves: its compile is killed, not left to run on
        reader.join(TIMEOUT_S)
        assert wait_for(lambda: not any(alive(p) for p in busy)), busy
    finally:
        grammars(engine).compile_timeout_s = TIMEOUT


def _drain(call):
    try:
        return list(call)
    except grpc.RpcError as e:
        assert e.code() == grpc.StatusCode.CANCELLED, e
        return []


def test_a_grammar_past_the_memory_cap_is_refused_without_touching_the_host(engine):
    """A JSON schema of 3,000 required properties drove a compile worker to 16.4 GB on a 24 GiB
    host (found by a probe): the worker's address space is capped (2 GiB by default), so the
    compile fails in it, the request is refused naming its field, and the engine serves on."""
    wide = json.dumps({"type": "object", "required": [f"q{i}" for i in range(3000)],
                       "properties": {f"q{i}": {"type": "string"} for i in range(3000)}})
    # the cap, not the clock, must stop it: a slow or busy CI host took past 4 s to reach 2 GiB
    grammars(engine).compile_timeout_s = TIMEOUT_S - 10
    try:
        with pytest.raises(grpc.RpcError) as info:
            list(engine.stub.Generate(structured(wide), timeout=TIMEOUT_S))
    finally:
        grammars(engine).compile_timeout_s = TIMEOUT
    error = info.value
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error
    assert dict(error.trailing_metadata())["quire-error-field"] == \
        "sampling.structured_outputs.json"
    assert "bytes of memory" in error.details(), error.details()
    done = list(engine.stub.Generate(structured(choices=["yes", "no"]), timeout=TIMEOUT_S))
    assert "".join(d.text for m in done for d in m.outputs) in ("yes", "no")


def test_compile_workers_import_from_the_package_not_the_working_directory(
        engine, tmp_path, monkeypatch):
    """A module in the server's working directory named as one the worker imports (the probe's
    own scripts did this) is not imported by the workers."""
    from engine_worker.grammar import _CompileWorker

    (tmp_path / "xgrammar.py").write_text("raise SystemExit('a stray module was imported')\n")
    monkeypatch.chdir(tmp_path)
    cache = grammars(engine)

    async def compile_once():
        worker = await _CompileWorker.start(cache._get_info_json(), cache.compile_memory_bytes)
        try:
            return await worker.compile("regex", "[ab]+")
        finally:
            worker.kill()

    assert "ok" in engine.call(compile_once())
