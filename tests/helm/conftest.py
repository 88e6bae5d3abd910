"""The chart rendered offline with Helm's own Go SDK (helm-python-sdk); no cluster is involved."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

CHART_DIR = Path(__file__).resolve().parents[2] / "helm" / "quire"
CI_VALUES = sorted((CHART_DIR / "ci").glob("*-values.yaml"))
RELEASE, NAMESPACE = "demo", "serving"


def load_values(name: str) -> dict:
    return yaml.safe_load((CHART_DIR / "ci" / name).read_text()) or {}


@pytest.fixture(scope="session")
def chart():
    import helm_python as helm  # from the dev extra; a missing SDK fails, it does not skip

    with helm.Chart.load(CHART_DIR) as loaded:
        yield loaded


@pytest.fixture(scope="session")
def render(chart):
    """values -> the rendered Kubernetes objects (NOTES.txt left out)."""

    def _render(values: dict | None = None, kube_version: str | None = None) -> list[dict]:
        if kube_version is None:
            manifests = chart.render(values or {}, name=RELEASE, namespace=NAMESPACE,
                                     is_install=True)
        else:
            manifests = render_for_kube_version(chart, values or {}, kube_version)
        return [doc for path, text in sorted(manifests.items()) if path.endswith(".yaml")
                for doc in yaml.safe_load_all(text) if doc]

    return _render


def render_for_kube_version(chart, values: dict, kube_version: str) -> dict[str, str]:
    """Render as for a cluster of ``kube_version`` (``.Capabilities.KubeVersion``). The SDK's
    Python ``Chart.render`` does not pass this option on; its Go wrapper reads it."""
    import json

    from helm_python import _native

    opts = {"name": RELEASE, "namespace": NAMESPACE, "is_install": True,
            "kube_version": f"v{kube_version}"}
    return json.loads(_native.call_string("helm_render", chart._raw(), json.dumps(values),
                                          json.dumps(opts)))


def find(objects: list[dict], kind: str, component: str | None = None) -> list[dict]:
    return [o for o in objects if o["kind"] == kind and (
        component is None
        or o["metadata"]["labels"].get("app.kubernetes.io/component") == component)]


def one(objects: list[dict], kind: str, component: str | None = None) -> dict:
    found = find(objects, kind, component)
    assert len(found) == 1, f"expected one {kind} ({component}), got {len(found)}"
    return found[0]


def pod_spec(obj: dict) -> dict:
    return obj["spec"] if obj["kind"] == "Pod" else obj["spec"]["template"]["spec"]


def env_of(container: dict) -> dict[str, object]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container.get("env", [])}
