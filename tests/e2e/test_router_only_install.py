"""A router-only install, as the router image builds it: a fresh venv with `pip install
".[router]"` (no torch). `quire --help` and `quire router --help` work there, and a real router
starts, reports that it has no engine, serves once an engine comes up, and exits 0 on SIGTERM.

Slow (minutes on two busy cores): pip installs the router's dependencies into the new venv
from the package registry (pip's own cache is reused).
"""

from __future__ import annotations

import fnmatch
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import tomllib
import urllib.error
import urllib.request
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _source_copy(dest: Path) -> Path:
    """The files the image copies: pyproject, README and every package pyproject includes.
    (Installing from a copy keeps setuptools' build/ and *.egg-info out of the work tree.)"""
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    patterns = pyproject["tool"]["setuptools"]["packages"]["find"]["include"]
    dest.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, dest / name)
    for path in ROOT.iterdir():
        if (path / "__init__.py").is_file() and any(fnmatch.fnmatch(path.name, p)
                                                    for p in patterns):
            shutil.copytree(path, dest / path.name,
                            ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    return dest


@pytest.fixture(scope="module")
def venv_bin(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("router-only")
    source = _source_copy(tmp / "src")
    subprocess.run([sys.executable, "-m", "venv", str(tmp / "venv")], check=True, timeout=120)
    bin_dir = tmp / "venv" / "bin"
    # --no-compile: byte-compiling the kubernetes client's thousands of modules is a third of
    # the install's CPU time; the router compiles what it imports on its first start.
    result = subprocess.run([str(bin_dir / "pip"), "install", "-q", "--no-compile",
                             f"{source}[router]"],
                            capture_output=True, text=True, timeout=900, env=_env())
    assert result.returncode == 0, result.stderr[-3000:]
    return bin_dir


def _env() -> dict[str, str]:
    """This environment without PYTHONPATH, so only the installed package is importable."""
    return {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}


def _run(venv_bin: Path, *argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(venv_bin / argv[0]), *argv[1:]], capture_output=True, text=True,
                          timeout=120, env=_env(), cwd=venv_bin)


def _get(url: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_help_works_and_torch_is_absent(venv_bin):
    result = _run(venv_bin, "python", "-c", "import torch")
    assert result.returncode != 0 and "No module named 'torch'" in result.stderr
    result = _run(venv_bin, "quire", "--help")
    assert result.returncode == 0, result.stderr
    assert "router" in result.stdout and "bench" in result.stdout
    result = _run(venv_bin, "quire", "router", "--help")
    assert result.returncode == 0, result.stderr
    assert "--engines" in result.stdout and "--policy" in result.stdout


def _wait_health(url: str, status: int, timeout_s: float) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        got, body = _get(url)
        if got == status or time.monotonic() > deadline:
            assert got == status, body
            return body
        time.sleep(0.5)


def test_router_starts_without_engines_then_serves_one_and_exits_on_sigterm(venv_bin,
                                                                            tiny_model_dir):
    engine_port, http_port = _free_port(), _free_port()
    router = subprocess.Popen(
        [str(venv_bin / "quire"), "router", "--engines", f"127.0.0.1:{engine_port}",
         "--host", "127.0.0.1", "--port", "0", "--http-port", str(http_port)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(), cwd=venv_bin)
    engine = None
    try:
        line = router.stdout.readline()
        assert re.search(r"quire router listening on 127\.0\.0\.1:\d+ \(gRPC\)", line), (
            line, router.stderr.read() if router.poll() is not None else "")
        health = f"http://127.0.0.1:{http_port}/health"
        body = _wait_health(health, 503, timeout_s=30)  # its one engine is not there yet
        assert body["serving_engines"] == 0 and body["engines"]["unreachable"] == 1

        # the engine (from the full install running this test) comes up on that address
        engine = subprocess.Popen(
            [sys.executable, "-m", "quire_cli", "engine", "--model", str(tiny_model_dir),
             "--dtype", "float32", "--kv-cache-memory-bytes", str(1 << 24), "--host",
             "127.0.0.1", "--port", str(engine_port)],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        assert "listening on" in engine.stdout.readline()
        assert _wait_health(health, 200, timeout_s=60)["serving_engines"] == 1
        request = urllib.request.Request(
            f"http://127.0.0.1:{http_port}/v1/completions", method="POST",
            headers={"Content-Type": "application/json"},
            data=json.dumps({"prompt": "The weather today", "max_tokens": 4,
                             "temperature": 0}).encode())
        with urllib.request.urlopen(request, timeout=60) as response:
            completion = json.loads(response.read())
        assert completion["usage"]["completion_tokens"] == 4

        router.send_signal(signal.SIGTERM)
        assert router.wait(timeout=60) == 0, router.stderr.read()[-2000:]
    finally:
        for proc in (router, engine):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()
