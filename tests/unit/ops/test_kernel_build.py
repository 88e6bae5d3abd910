"""The kernel builder (engine_worker/ops/build.py) never hangs and never repeats a failure,
and every variant of csrc/cpu compiles on any x86 host.

Real compiles of a one-op library (data/answer_op.cpp) and of a broken source: a build killed
mid-way, a waiter on a held lock, a failure remembered across calls and retried on request.
"""

from __future__ import annotations

import fcntl
import logging
import os
import platform
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from engine_worker.ops import VARIANTS, build_variant
from engine_worker.ops.build import (BuildFailed, BuildOptions, BuildTimedOut, LibrarySpec,
                                     build_library, cache_paths)
from engine_worker.ops.cpu_build import CpuVariant, torch_library_spec
from engine_worker.ops.cpu_isa import available_isas

SOURCE = Path(__file__).parent / "data" / "answer_op.cpp"
REPO_ROOT = Path(__file__).resolve().parents[3]
CHILD_ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(
    [str(REPO_ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])}


def _answer_spec(namespace: str, offset: int) -> LibrarySpec:
    return torch_library_spec(namespace, (SOURCE,), namespace, (f"-DOFFSET={offset}",))


def _answer(namespace: str) -> int:
    return getattr(torch.ops, namespace).answer(0)


BUILD_IN_CHILD = """
import sys
from pathlib import Path
from engine_worker.ops.build import build_library
from tests.unit.ops.test_kernel_build import _answer_spec
build_library(_answer_spec(sys.argv[1], 2), Path(sys.argv[2]))
"""


def test_a_killed_build_leaves_nothing_that_blocks_the_next(tmp_path):
    namespace = "quire_test_killed"
    child = subprocess.Popen([sys.executable, "-c", BUILD_IN_CHILD, namespace, str(tmp_path)],
                             env=CHILD_ENV)
    try:
        # the compiler is running in the child's private directory: kill the child there
        while not list(tmp_path.glob("*.tmp-*/*.out")):
            assert child.poll() is None, "the build ended before it could be killed"
            time.sleep(0.02)
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    assert list(tmp_path.glob("*.tmp-*")), "the killed build's private directory"
    paths = cache_paths(_answer_spec(namespace, 2), tmp_path, BuildOptions())
    assert not paths.final_dir.exists()  # nothing half-built where loaders look
    assert f"pid {child.pid} " in paths.lock.read_text()  # the dead holder's file is still there

    # a short lock timeout: a stale lock would fail this build instead of hanging it
    library = build_library(_answer_spec(namespace, 2), tmp_path, BuildOptions(lock_timeout_s=30))
    assert library == paths.library and library.is_file()
    assert not list(tmp_path.glob("*.tmp-*"))  # the remains were removed under the lock
    assert f"pid {os.getpid()} " in paths.lock.read_text()
    torch.ops.load_library(str(library))
    assert _answer(namespace) == 42


def test_two_builds_of_one_source_load_side_by_side(tmp_path):
    # like the avx512 and avx2 variants: same C++ names, own namespaces, own code
    for namespace, offset in (("quire_test_one", 1), ("quire_test_three", 3)):
        torch.ops.load_library(str(build_library(_answer_spec(namespace, offset), tmp_path)))
    assert _answer("quire_test_one") == 41
    assert _answer("quire_test_three") == 43


def test_a_waiter_says_once_whom_it_waits_for_then_gives_up(tmp_path, caplog):
    spec = _answer_spec("quire_test_waiter", 2)
    paths = cache_paths(spec, tmp_path, BuildOptions())
    with open(paths.lock, "a+") as held:  # another open file: flock conflicts in one process too
        fcntl.flock(held, fcntl.LOCK_EX)
        held.write("pid 4242 on a-test-host since now\n")
        held.flush()
        with caplog.at_level(logging.WARNING, logger="engine_worker.ops.build"):
            with pytest.raises(BuildTimedOut, match="waiting for pid 4242 on a-test-host"):
                build_library(spec, tmp_path, BuildOptions(lock_timeout_s=1.0))
    waits = [r.getMessage() for r in caplog.records if "waiting for" in r.getMessage()]
    assert len(waits) == 1 and "pid 4242 on a-test-host" in waits[0] and str(paths.lock) in waits[0]
    assert not paths.failed.exists()  # a busy machine is not a broken source


def test_a_failed_build_is_remembered_and_retried_only_when_asked(tmp_path):
    source = tmp_path / "broken.cpp"
    source.write_text("int broken( {\n")
    spec = LibrarySpec("quire_test_broken", (source,), (), ("-fPIC",), ("-shared",))
    root = tmp_path / "cache"
    with pytest.raises(BuildFailed, match="compiling failed on broken.cpp: .*error"):
        build_library(spec, root)
    paths = cache_paths(spec, root, BuildOptions())
    assert paths.failed.exists()
    first = paths.failed.stat().st_mtime_ns

    # later calls (in this process or any other) report it without compiling
    done = subprocess.run(
        [sys.executable, "-c", "import sys; from pathlib import Path\n"
         "from engine_worker.ops.build import *\n"
         f"spec = LibrarySpec('quire_test_broken', (Path({str(source)!r}),), (), ('-fPIC',), "
         "('-shared',))\n"
         f"try: build_library(spec, Path({str(root)!r}))\n"
         "except BuildFailed as exc: print(exc)"],
        capture_output=True, text=True, env=CHILD_ENV)
    assert "an earlier build failed the same way" in done.stdout, done.stderr
    assert paths.failed.stat().st_mtime_ns == first and not list(root.glob("*.tmp-*"))
    # another CPU does not inherit it; a retry compiles again
    with pytest.raises(BuildFailed, match="compiling failed"):
        build_library(spec, root, BuildOptions(cpu_key="another-cpu"))
    with pytest.raises(BuildFailed, match="compiling failed"):
        build_library(spec, root, BuildOptions(retry_failed=True))
    assert paths.failed.stat().st_mtime_ns != first
    # new sources are a new digest: built, whatever the old one's marker says
    source.write_text("int fixed() { return 1; }\n")
    assert build_library(spec, root).is_file()


def test_a_variant_without_sources_says_so(tmp_path):
    empty = CpuVariant("avx2", "avx2", VARIANTS["avx2"].isa_flags, source_dir=tmp_path)
    with pytest.raises(BuildFailed, match="avx2 kernels not present"):
        build_variant(empty, cache_root=tmp_path)


# What each variant registers (csrc/cpu/*.cpp for all, csrc/cpu/<isa>/linear.cpp its own), as
# the backends call it.
SHARED_OPS = ("rms_norm", "silu_and_mul", "rotary_embedding", "paged_attention", "write_kv",
              "norm_qkv_rope", "residual_mlp", "llama_layers")
OWN_OPS = {"avx512": ("skinny_linear", "pack_skinny", "pack_coded", "skinny_linear_packed"),
           "avx2": ("pack_bf16w", "linear_bf16w")}


@pytest.mark.parametrize("isa", sorted(VARIANTS))
def test_every_variant_compiles_on_any_x86_host(isa):
    """Compiling takes the compiler's instruction-set flags, not the CPU's: a variant this CPU
    cannot run (the avx512 one on an AVX2-only machine) is built all the same, never loaded,
    so its sources cannot break unseen. Into the engine's cache: once per source digest."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        pytest.skip(f"the variants are x86 code; this is {platform.machine()}")
    try:
        library = build_variant(isa)
    except BuildFailed as exc:
        if str(exc).startswith("no C++ compiler"):
            pytest.skip(str(exc))
        raise
    assert OWN_OPS.keys() == VARIANTS.keys()
    # read, not loaded: loading runs code built for the variant's instructions
    binary = library.read_bytes()
    for name in SHARED_OPS + OWN_OPS[isa]:  # the names the ops are implemented under
        assert name.encode() + b"\0" in binary, f"{isa} registers no {name}"
    # a shared library links with undefined symbols; every kernel the variant calls is its own
    namespace = VARIANTS[isa].namespace
    undefined = subprocess.run(["nm", "-D", "--undefined-only", "-C", str(library)],
                               capture_output=True, text=True, check=True).stdout
    assert f"{namespace}::" not in undefined
    if isa not in available_isas():
        assert str(library) not in torch.ops.loaded_libraries


def test_the_ci_prebuild_builds_the_sets_the_suite_builds_here_but_the_engines_own():
    """`python -m tests.prebuild_kernels` (CI runs it beside the suite) must build the very
    libraries the suite's tests build besides the engine's own set: the emulated AVX-512 set
    (the same variant value, so the same cache entry) where the real one cannot run, and
    every other real set (``test_every_variant_compiles_on_any_x86_host``)."""
    from tests.conftest import _emulated_avx512
    from tests.prebuild_kernels import sets_to_build

    runs_here = available_isas()
    planned = sets_to_build()
    own = runs_here[0]  # the engine's: its first engines build it
    assert VARIANTS[own] not in planned
    assert set(planned) >= {v for name, v in VARIANTS.items() if name != own}
    assert (_emulated_avx512() in planned) == ("avx512" not in runs_here)
    assert len(planned) == len(set(planned)) == len(VARIANTS) - 1 + ("avx512" not in runs_here)
