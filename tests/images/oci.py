"""Run a built image without a container daemon: buildah mounts the image's filesystem, crun runs
it from an OCI runtime bundle written here. The container runs as Kubernetes would run it under
the chart's security contexts: the image's entrypoint, environment and working directory, a
numeric non-root user, no capabilities, no new privileges, a read-only root filesystem with
tmpfs at /tmp and /cache (the chart's emptyDir volumes). It shares the host's network namespace,
so its ports are on the host's loopback. Needs root (buildah mount, crun)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

UID = GID = 10001  # helm/quire/values.yaml: podSecurityContext.runAsUser / runAsGroup
WRITABLE = ("/tmp", "/cache")  # the chart's emptyDir volumes


# No cgroups (--cgroup-manager=disabled): resource limits are not what is tested. crun 1.8
# refuses a hybrid cgroup layout (v1 controllers plus a v2 mount at /sys/fs/cgroup/unified, as
# on these machines) even then, so it runs in a private mount namespace without that mount.
CGROUP_WORKAROUND = (
    ["unshare", "--mount", "--propagation", "private", "sh", "-c",
     'umount /sys/fs/cgroup/unified && exec "$@"', "crun-unified-hidden"]
    if os.path.ismount("/sys/fs/cgroup/unified") else [])


def buildah(*args: str) -> str:
    return subprocess.run(["buildah", *args], check=True, capture_output=True,
                          text=True).stdout.strip()


def image_config(image: str) -> dict:
    """The image's OCI config: Env, Entrypoint, Cmd, WorkingDir, User."""
    inspected = json.loads(buildah("inspect", "--type", "image", image))
    return inspected["OCIv1"]["config"]


def image_size(image: str) -> str:
    """As buildah reports it, e.g. "481 MB"."""
    return json.loads(buildah("images", "--json", image))[0]["size"]


def runtime_spec(rootfs: str, argv: list[str], env: list[str], cwd: str) -> dict:
    """An OCI runtime spec (config.json) for one process in ``rootfs``."""
    tmpfs = ["nosuid", "nodev", "mode=1777", "size=2g"]
    cache = ["nosuid", "nodev", f"uid={UID}", f"gid={GID}", "mode=0755", "size=4g"]
    return {
        "ociVersion": "1.0.2",
        "process": {
            "terminal": False,
            "user": {"uid": UID, "gid": GID, "additionalGids": [GID]},
            "args": argv,
            "env": env,
            "cwd": cwd or "/",
            "capabilities": {k: [] for k in ("bounding", "effective", "inheritable",
                                              "permitted", "ambient")},
            "noNewPrivileges": True,
        },
        "root": {"path": rootfs, "readonly": True},
        "hostname": "quire-image-test",
        "mounts": [
            {"destination": "/proc", "type": "proc", "source": "proc"},
            {"destination": "/dev", "type": "tmpfs", "source": "tmpfs",
             "options": ["nosuid", "strictatime", "mode=755", "size=65536k"]},
            {"destination": "/dev/pts", "type": "devpts", "source": "devpts",
             "options": ["nosuid", "noexec", "newinstance", "ptmxmode=0666", "mode=0620"]},
            {"destination": "/dev/shm", "type": "tmpfs", "source": "shm",
             "options": ["nosuid", "noexec", "nodev", "mode=1777", "size=256m"]},
            {"destination": "/sys", "type": "sysfs", "source": "sysfs",
             "options": ["nosuid", "noexec", "nodev", "ro"]},
            {"destination": "/tmp", "type": "tmpfs", "source": "tmpfs", "options": tmpfs},
            {"destination": "/cache", "type": "tmpfs", "source": "tmpfs", "options": cache},
        ],
        "linux": {
            # No network namespace: the host's loopback, as a pod's containers share one.
            "namespaces": [{"type": t} for t in ("pid", "ipc", "uts", "mount")],
            "maskedPaths": ["/proc/kcore", "/proc/keys", "/proc/timer_list", "/sys/firmware"],
            "readonlyPaths": ["/proc/bus", "/proc/fs", "/proc/irq", "/proc/sys",
                              "/proc/sysrq-trigger"],
        },
    }


@dataclass
class Container:
    """One running container; ``stop()`` sends SIGTERM and returns the exit status."""

    image: str
    args: list[str]
    env: dict[str, str] = field(default_factory=dict)
    log_path: Path | None = None

    def start(self) -> "Container":
        config = image_config(self.image)
        self._bundle = Path(tempfile.mkdtemp(prefix="quire-oci-"))
        self._name = f"quire-test-{os.getpid()}-{self._bundle.name[-8:]}"
        self._working = buildah("from", "--pull-never", "--name", self._name, self.image)
        rootfs = buildah("mount", self._working)
        for path in WRITABLE:  # mount points must exist in the read-only root
            assert Path(rootfs, path.lstrip("/")).is_dir(), f"{self.image} lacks {path}"
        env = [e for e in config.get("Env", []) if e.split("=", 1)[0] not in self.env]
        env += [f"{k}={v}" for k, v in self.env.items()]
        argv = list(config.get("Entrypoint") or []) + self.args
        spec = runtime_spec(rootfs, argv, env, config.get("WorkingDir", "/"))
        (self._bundle / "config.json").write_text(json.dumps(spec, indent=1))
        self.log_path = self.log_path or self._bundle / "output.log"
        self._log = open(self.log_path, "wb")
        self._process = subprocess.Popen(
            [*CGROUP_WORKAROUND, "crun", "--cgroup-manager=disabled", "run", "--bundle",
             str(self._bundle), self._name],
            stdin=subprocess.DEVNULL, stdout=self._log, stderr=subprocess.STDOUT)
        return self

    def pid(self) -> int:
        """The container's process, as the host sees it."""
        state = subprocess.run(["crun", "state", self._name], capture_output=True, text=True,
                               check=True).stdout
        return json.loads(state)["pid"]

    def alive(self) -> bool:
        return self._process.poll() is None

    def output(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")

    def stop(self, timeout_s: float = 60.0) -> int:
        """SIGTERM to the container's process (as the kubelet sends); its exit status."""
        if self.alive():
            subprocess.run(["crun", "kill", self._name, "TERM"], check=False,
                           capture_output=True)
        try:
            return self._process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            subprocess.run(["crun", "kill", self._name, "KILL"], check=False)
            self._process.wait(timeout=10)
            raise

    def remove(self) -> None:
        if self.alive():
            self._process.send_signal(signal.SIGKILL)
            self._process.wait(timeout=10)
        subprocess.run(["crun", "delete", "--force", self._name], check=False,
                       capture_output=True)
        self._log.close()
        subprocess.run(["buildah", "umount", self._working], check=False, capture_output=True)
        subprocess.run(["buildah", "rm", self._working], check=False, capture_output=True)
        shutil.rmtree(self._bundle, ignore_errors=True)  # failures quote the output already

    def __enter__(self) -> "Container":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.remove()


def wait_until(predicate, timeout_s: float, container: Container) -> None:
    """Poll ``predicate`` until true; fail early, with the output, if the container exits."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not container.alive():
            raise AssertionError(f"{container.image} exited with "
                                 f"{container._process.returncode}:\n{container.output()}")
        if predicate():
            return
        time.sleep(0.5)
    raise AssertionError(f"{container.image}: not ready in {timeout_s} s:\n{container.output()}")
