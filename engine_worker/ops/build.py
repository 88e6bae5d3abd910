"""Compiles a shared library into a cache directory, atomically, once, and never hangs.

Torch's extension builder waits forever on a lock file that a killed build leaves behind, and
retries a failing compile in every process. This builder instead:

- builds into a private temporary directory and renames it into place, so the cache holds a
  complete library or none (a killed build leaves only a temporary directory, which the next
  build removes);
- serialises builds of one library with ``fcntl.flock`` on a lock file holding the builder's
  pid: the kernel drops the lock when its holder dies, however it dies; a waiter says once
  what it waits for and on whom, and gives up after a timeout;
- remembers a failed compile in a marker file keyed by the inputs' digest (sources, flags,
  compiler) and the CPU's flags, so later processes report the reason instead of recompiling;
  ``retry_failed`` (or new sources) builds again.

Layout under ``cache_root``::

    <name>-<digest>/<name>.so            a finished build (renamed into place whole)
    <name>-<digest>.lock                 the lock file (kept; holds the last holder's pid)
    <name>-<digest>.tmp-XXXX/            a build in progress, or a killed one's remains
    <name>-<digest>-<cpu>.failed         why the build failed (JSON)
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import functools
import hashlib
import json
import logging
import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

LOCK_POLL_S = 0.2
LOG_TAIL_CHARS = 2000


class BuildFailed(Exception):
    """The library is not available; the message says why (one line, for logs)."""


class BuildTimedOut(BuildFailed):
    """A build or a wait ran out of time: a loaded machine, not the sources; not remembered."""


@dataclass(frozen=True, slots=True)
class LibrarySpec:
    """What to compile and how. Everything here (and the compiler's identity) is part of the
    digest that names the cached library."""

    name: str
    sources: tuple[Path, ...]
    depends: tuple[Path, ...]  # headers and other inputs: hashed, not compiled
    cflags: tuple[str, ...]
    ldflags: tuple[str, ...]
    key_extra: str = ""  # e.g. the torch version the library links against


@dataclass(frozen=True, slots=True)
class BuildOptions:
    compiler: str = "c++"
    lock_timeout_s: float = 900.0
    build_timeout_s: float = 1800.0
    retry_failed: bool = False
    cpu_key: str = ""  # the CPU flags' digest: a failure is remembered per CPU
    jobs: int = 0  # parallel compiles; 0: one per core


@dataclass(frozen=True, slots=True)
class CachePaths:
    final_dir: Path
    library: Path
    lock: Path
    failed: Path
    tmp_prefix: str


@functools.lru_cache(maxsize=8)
def compiler_identity(compiler: str) -> str:
    """The compiler's resolved path and version line: a new compiler is a new digest."""
    path = shutil.which(compiler)
    if path is None:
        raise BuildFailed(f"no C++ compiler: {compiler!r} is not on PATH")
    try:
        out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise BuildFailed(f"the C++ compiler {path} does not run: {exc}") from exc
    first = out.stdout.strip().splitlines()[0] if out.stdout.strip() else "unknown version"
    return f"{os.path.realpath(path)} {first}"


def spec_digest(spec: LibrarySpec, compiler_id: str) -> str:
    h = hashlib.sha256()
    for part in (spec.name, spec.key_extra, compiler_id, *spec.cflags, "|", *spec.ldflags):
        h.update(part.encode() + b"\0")
    for path in sorted(set(spec.sources + spec.depends)):
        h.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()[:16]


def cache_paths(spec: LibrarySpec, cache_root: Path, opts: BuildOptions) -> CachePaths:
    """Where the library, its lock and its failure marker live for these inputs."""
    digest = spec_digest(spec, compiler_identity(opts.compiler))
    return _paths(spec, cache_root, digest, opts.cpu_key)


def _paths(spec: LibrarySpec, root: Path, digest: str, cpu_key: str) -> CachePaths:
    stem = f"{spec.name}-{digest}"
    return CachePaths(root / stem, root / stem / f"{spec.name}.so", root / f"{stem}.lock",
                  root / f"{stem}-{cpu_key or 'any'}.failed", f"{stem}.tmp-")


def _read_failure(marker: Path) -> str | None:
    try:
        return json.loads(marker.read_text())["reason"]
    except (OSError, ValueError, KeyError):
        return None


def build_library(spec: LibrarySpec, cache_root: Path, opts: BuildOptions = BuildOptions()
                  ) -> Path:
    """The path of the built library, building it first if no process has; raises
    ``BuildFailed`` with the reason (a compile error, a remembered one, a lock timeout)."""
    compiler_id = compiler_identity(opts.compiler)
    digest = spec_digest(spec, compiler_id)
    paths = _paths(spec, cache_root, digest, opts.cpu_key)
    if paths.library.is_file():
        return paths.library
    _raise_if_remembered(paths, opts)
    cache_root.mkdir(parents=True, exist_ok=True)
    with _locked(paths.lock, spec.name, opts.lock_timeout_s):
        if paths.library.is_file():  # built by the process we waited for
            return paths.library
        _raise_if_remembered(paths, opts)
        _remove_stale_builds(cache_root, paths.tmp_prefix)
        tmp = Path(tempfile.mkdtemp(prefix=paths.tmp_prefix, dir=cache_root))
        try:
            logger.info("building %s (%d sources) in %s", spec.name, len(spec.sources), tmp)
            start = time.monotonic()
            _compile_and_link(spec, tmp, opts)
            for part in (*tmp.glob("*.o"), *tmp.glob("*.out")):  # build.log holds their output
                part.unlink()
            tmp.chmod(0o755)  # mkdtemp's 0700 would hide it from other users of a shared cache
            if paths.final_dir.exists():  # an incomplete directory from elsewhere: replace it
                shutil.rmtree(paths.final_dir)
            os.rename(tmp, paths.final_dir)
        except BuildTimedOut:
            raise
        except BuildFailed as exc:
            _remember_failure(paths.failed, str(exc), compiler_id, tmp)
            raise
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
        with contextlib.suppress(FileNotFoundError):
            paths.failed.unlink()
        logger.info("built %s in %.0f s", spec.name, time.monotonic() - start)
        return paths.library


def _raise_if_remembered(paths: CachePaths, opts: BuildOptions) -> None:
    reason = _read_failure(paths.failed)
    if reason is not None and not opts.retry_failed:
        raise BuildFailed(f"{reason} (an earlier build failed the same way; remembered in "
                          f"{paths.failed}: delete it, or change the sources, to retry)")


def _lock_holder(lock_file) -> str:
    lock_file.seek(0)
    text = lock_file.read().strip()
    return text or "an unknown process"


@contextlib.contextmanager
def _locked(lock_path: Path, what: str, timeout_s: float) -> Iterator[None]:
    """An exclusive ``flock`` on ``lock_path``; the kernel releases it when the holder exits
    or is killed, so a stale file never blocks. Says once whom it waits for."""
    with open(lock_path, "a+") as f:
        deadline = time.monotonic() + timeout_s
        said = False
        while True:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except OSError as exc:
                if exc.errno not in (errno.EAGAIN, errno.EACCES):
                    raise
            holder = _lock_holder(f)
            if time.monotonic() >= deadline:
                raise BuildTimedOut(f"gave up after {timeout_s:.0f} s waiting for {holder} to "
                                  f"finish building {what} (lock {lock_path})")
            if not said:
                logger.warning("waiting for %s to finish building %s (lock %s; up to %.0f s)",
                               holder, what, lock_path, timeout_s)
                said = True
            time.sleep(LOCK_POLL_S)
        try:
            f.seek(0)
            f.truncate()
            f.write(f"pid {os.getpid()} on {socket.gethostname()} since "
                    f"{time.strftime('%Y-%m-%dT%H:%M:%S%z')}\n")
            f.flush()
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _remove_stale_builds(root: Path, tmp_prefix: str) -> None:
    # Called under the lock: any temporary directory of this digest is a dead build's.
    for stale in root.glob(tmp_prefix + "*"):
        logger.info("removing the remains of an interrupted build: %s", stale)
        shutil.rmtree(stale, ignore_errors=True)


def _remember_failure(marker: Path, reason: str, compiler_id: str, tmp: Path) -> None:
    log = ""
    with contextlib.suppress(OSError):
        log = (tmp / "build.log").read_text(errors="replace")[-LOG_TAIL_CHARS:]
    record = {"reason": reason, "compiler": compiler_id, "pid": os.getpid(),
              "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "log_tail": log}
    part = marker.with_name(marker.name + f".{os.getpid()}.part")
    part.write_text(json.dumps(record, indent=2) + "\n")
    os.replace(part, marker)


def _compile_and_link(spec: LibrarySpec, out_dir: Path, opts: BuildOptions) -> None:
    deadline = time.monotonic() + opts.build_timeout_s
    objects = [out_dir / f"{i}-{src.stem}.o" for i, src in enumerate(spec.sources)]
    compiles = [(src.name, [opts.compiler, *spec.cflags, "-c", str(src), "-o", str(obj)])
                for src, obj in zip(spec.sources, objects)]
    _run_all(compiles, opts.jobs or os.cpu_count() or 1, out_dir, deadline)
    link = [opts.compiler, *map(str, objects), *spec.ldflags,
            "-o", str(out_dir / f"{spec.name}.so")]
    _run_all([("the link", link)], 1, out_dir, deadline)


def _run_all(commands: list[tuple[str, list[str]]], jobs: int, out_dir: Path,
             deadline: float) -> None:
    """Runs (label, command) pairs, ``jobs`` at a time, each one's output into its own file
    (a pipe could fill and stall it), appended to ``build.log`` as each ends; raises
    ``BuildFailed`` with the first error line of the first that fails."""
    pending, running = list(commands), []
    with open(out_dir / "build.log", "ab") as log:
        try:
            while pending or running:
                while pending and len(running) < jobs:
                    label, cmd = pending.pop(0)
                    out_path = out_dir / f"{len(commands) - len(pending)}.out"
                    with open(out_path, "wb") as out:
                        out.write((" ".join(cmd) + "\n").encode())
                        out.flush()
                        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
                    running.append((label, out_path, proc))
                for item in list(running):
                    label, out_path, proc = item
                    if proc.poll() is None:
                        continue
                    running.remove(item)
                    output = out_path.read_bytes()
                    log.write(output)
                    log.flush()
                    if proc.returncode != 0:
                        raise BuildFailed(f"compiling failed on {label}: {_first_error(output)}")
                if time.monotonic() > deadline:
                    raise BuildTimedOut("the build ran past its time limit")
                time.sleep(0.05)
        finally:
            for _, _, proc in running:
                proc.kill()
                proc.wait()


def _first_error(output: bytes) -> str:
    lines = output.decode(errors="replace").splitlines()[1:]  # past the command line
    for line in lines:
        if "error" in line.lower():
            return line.strip()[:300]
    return (lines[-1].strip() if lines else "no output")[:300]
