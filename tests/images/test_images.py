"""The built images, started as Kubernetes would start them under the chart (uid 10001, no
capabilities, read-only root, tmpfs at /tmp and /cache) with no container daemon: the engine-cpu
image's `quire engine` serves the embedded model and answers a Generate; the router image's
`quire router` finds that engine through a static list and answers an OpenAI chat request; both
exit 0 on SIGTERM. Build the images first (scripts/build-images.sh); run as root with
QUIRE_IMAGE_TESTS=1 (.ci/run does both)."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import urllib.error
import urllib.request
from pathlib import Path

import pytest

pytestmark = [
    pytest.mark.images,
    pytest.mark.skipif(os.environ.get("QUIRE_IMAGE_TESTS") != "1",
                       reason="image tests run with QUIRE_IMAGE_TESTS=1 (after building them)"),
]

ROOT = Path(__file__).resolve().parents[2]
TAG = os.environ.get("QUIRE_IMAGE_TAG") or re.search(
    r'^version = "(.+)"', (ROOT / "pyproject.toml").read_text(), re.M).group(1)
ENGINE_IMAGE = f"localhost/quire/engine-cpu:{TAG}"
ROUTER_IMAGE = f"localhost/quire/router:{TAG}"
ENGINE_READY_S = 900.0  # first start converts the embedded model on a shared 2-core machine
ROUTER_READY_S = 120.0


@pytest.fixture(scope="module", autouse=True)
def _runtime():
    if os.geteuid() != 0:
        pytest.fail("the image tests need root (buildah mount, crun)")
    for tool in ("buildah", "crun", "unshare"):
        assert shutil.which(tool), f"{tool} missing: run scripts/build-images.sh first"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def assert_runs_as_the_chart_expects(container) -> None:
    """uid/gid 10001 (podSecurityContext) and a read-only root filesystem."""
    from tests.images.oci import GID, UID

    pid = container.pid()
    status = Path(f"/proc/{pid}/status").read_text()
    uids = re.search(r"^Uid:\s+(.+)$", status, re.M).group(1).split()
    gids = re.search(r"^Gid:\s+(.+)$", status, re.M).group(1).split()
    assert set(uids) == {str(UID)} and set(gids) == {str(GID)}, (uids, gids)
    assert re.search(r"^CapEff:\s+0+$", status, re.M), "capabilities left"
    root = [line.split() for line in Path(f"/proc/{pid}/mountinfo").read_text().splitlines()
            if line.split()[4] == "/"]
    assert root and "ro" in root[-1][5].split(","), root


def print_size(image: str) -> None:
    from tests.images.oci import image_size

    print(f"{image}: {image_size(image)}")


@pytest.fixture(scope="module")
def engine():
    """The engine image serving the embedded model on loopback."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from tests.images.oci import Container, wait_until

    port, metrics_port = free_port(), free_port()
    args = ["engine", "--host", "127.0.0.1", "--port", str(port),
            "--metrics-port", str(metrics_port), "--dtype", "float32",
            "--max-model-len", "1024", "--kv-cache-memory-bytes", str(64 << 20)]
    print_size(ENGINE_IMAGE)
    with Container(ENGINE_IMAGE, args) as container:
        channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        health = health_pb2_grpc.HealthStub(channel)

        def serving() -> bool:
            try:
                reply = health.Check(health_pb2.HealthCheckRequest(service=""), timeout=2)
            except grpc.RpcError:
                return False
            return reply.status == health_pb2.HealthCheckResponse.SERVING

        wait_until(serving, ENGINE_READY_S, container)
        yield container, port, channel
        channel.close()


def test_engine_image_serves_a_generate_and_stops_cleanly(engine):
    from quire.v1 import engine_pb2 as pb
    from quire.v1 import engine_pb2_grpc

    container, _, channel = engine
    assert_runs_as_the_chart_expects(container)
    stub = engine_pb2_grpc.EngineServiceStub(channel)
    request = pb.GenerateRequest(text="The capital of France is", sampling=pb.SamplingOptions(
        temperature=0, max_tokens=8, ignore_eos=True))
    tokens, text = [], ""
    for message in stub.Generate(request, timeout=300):
        for delta in message.outputs:
            tokens += delta.token_ids
            text += delta.text
    assert len(tokens) == 8 and text.strip(), (tokens, text)


def test_router_image_answers_an_openai_chat_request(engine):
    from tests.images.oci import Container, wait_until

    _, engine_port, _ = engine
    grpc_port, http_port = free_port(), free_port()
    args = ["router", "--host", "127.0.0.1", "--port", str(grpc_port),
            "--http-port", str(http_port), "--discovery", "static",
            "--engines", f"127.0.0.1:{engine_port}"]
    print_size(ROUTER_IMAGE)
    base = f"http://127.0.0.1:{http_port}"
    with Container(ROUTER_IMAGE, args) as router:

        def ready() -> bool:
            try:
                with urllib.request.urlopen(f"{base}/health", timeout=2) as reply:
                    return reply.status == 200
            except (urllib.error.URLError, ConnectionError, OSError):
                return False

        wait_until(ready, ROUTER_READY_S, router)
        assert_runs_as_the_chart_expects(router)
        with urllib.request.urlopen(f"{base}/v1/models", timeout=10) as reply:
            model = json.load(reply)["data"][0]["id"]
        body = json.dumps({"model": model, "max_tokens": 8, "temperature": 0,
                           "messages": [{"role": "user", "content": "Say hello."}]}).encode()
        request = urllib.request.Request(f"{base}/v1/chat/completions", data=body,
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=300) as reply:
            completion = json.load(reply)
        choice = completion["choices"][0]
        assert choice["message"]["role"] == "assistant" and choice["message"]["content"]
        assert completion["usage"]["completion_tokens"] > 0
        assert router.stop() == 0, router.output()


def test_engine_image_exits_zero_on_sigterm(engine):
    container, _, _ = engine
    assert container.stop() == 0, container.output()


@pytest.mark.parametrize("image", [ROUTER_IMAGE, ENGINE_IMAGE])
def test_build_time_sources_stay_out_of_the_images(image):
    """The CA bundle and wheel directory mounted during the build, and pip's build arguments,
    leave nothing behind; the images run as the chart's uid."""
    from tests.images.oci import buildah, image_config

    config = image_config(image)
    assert config["User"] == "10001:10001"
    names = {entry.split("=", 1)[0] for entry in config.get("Env", [])}
    assert not names & {"PIP_CERT", "PIP_FIND_LINKS", "PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL",
                        "DEBIAN_FRONTEND"}, names
    working = buildah("from", "--pull-never", image)
    try:
        rootfs = Path(buildah("mount", working))
        host_ca = Path("/etc/ssl/certs/ca-certificates.crt")
        image_ca = rootfs / "etc/ssl/certs/ca-certificates.crt"
        assert image_ca.read_bytes() != host_ca.read_bytes(), "the host's CA bundle is baked in"
        assert not list((rootfs / "mnt").iterdir()), "the wheel directory left files"
        assert (rootfs / "cache").stat().st_uid == 10001
    finally:
        buildah("umount", working)
        buildah("rm", working)
