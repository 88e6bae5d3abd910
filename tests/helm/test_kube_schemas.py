"""Every object the chart renders, for every CI values file and the defaults, checked against
Kubernetes' own API schemas (kubernetes-validate, strict: unknown fields are errors) for the
oldest and the newest Kubernetes release Chart.yaml's kubeVersion claims. No cluster runs here."""

from __future__ import annotations

import re

import pytest
import yaml

from tests.helm.conftest import CHART_DIR, CI_VALUES, load_values

# Custom resources have no schema in Kubernetes' own API.
CUSTOM_KINDS = {"ServiceMonitor"}


def claimed_versions() -> tuple[str, str]:
    """(oldest, newest) minor releases of kubeVersion, which reads ">=A.B.0-0 <C.D.0-0"."""
    kube_version = yaml.safe_load((CHART_DIR / "Chart.yaml").read_text())["kubeVersion"]
    match = re.fullmatch(r">=(\d+)\.(\d+)\.0-0 <(\d+)\.(\d+)\.0-0", kube_version)
    assert match, f"kubeVersion {kube_version!r}: expected '>=A.B.0-0 <C.D.0-0'"
    low_major, low_minor, high_major, high_minor = map(int, match.groups())
    assert low_major == high_major == 1 and high_minor > low_minor, kube_version
    return f"1.{low_minor}.0", f"1.{high_minor - 1}.0"


OLDEST, NEWEST = claimed_versions()
VALUES_FILES = [None] + [p.name for p in CI_VALUES]


def test_kube_version_range_is_covered_by_the_schemas():
    from kubernetes_validate import utils

    shipped = set(utils.all_versions())
    assert OLDEST in shipped and NEWEST in shipped, (OLDEST, NEWEST, sorted(shipped))


def test_ci_values_cover_the_deployments_users_run():
    names = {p.name for p in CI_VALUES}
    for name in ("router-only", "cpu-only", "tls", "multi-replica"):
        assert f"{name}-values.yaml" in names


@pytest.mark.parametrize("kube_version", [OLDEST, NEWEST])
@pytest.mark.parametrize("values_file", VALUES_FILES, ids=lambda v: v or "defaults")
def test_every_object_matches_the_kubernetes_schema(render, values_file, kube_version):
    from kubernetes_validate import utils

    values = load_values(values_file) if values_file else {}
    objects = render(values, kube_version=kube_version)
    checked, errors = 0, []
    for obj in objects:
        if obj["kind"] in CUSTOM_KINDS:
            continue
        try:
            utils.validate(obj, kube_version, strict=True)
        except utils.ValidationError as exc:
            errors.append(f"{utils.kn(obj)}: {exc.message} at {list(exc.path)}")
        checked += 1
    assert not errors, "\n".join(errors)
    assert checked >= 4  # a router Deployment, its Service, ... (never an empty render)


def test_an_unknown_field_fails_strict_validation(render):
    """The check above can fail: a typo in a container spec is reported."""
    from kubernetes_validate import utils

    deployment = next(o for o in render({}, kube_version=NEWEST) if o["kind"] == "Deployment")
    deployment["spec"]["template"]["spec"]["containers"][0]["imagePullPolocy"] = "Always"
    with pytest.raises(utils.ValidationError):
        utils.validate(deployment, NEWEST, strict=True)


@pytest.mark.parametrize("kube_version", [OLDEST, NEWEST])
def test_the_render_is_for_that_kube_version(tmp_path, kube_version):
    """The SDK passes the version on to the templates (a one-template chart shows it)."""
    import helm_python as helm

    from tests.helm.conftest import render_for_kube_version

    (tmp_path / "templates").mkdir()
    (tmp_path / "Chart.yaml").write_text("apiVersion: v2\nname: probe\nversion: 0.1.0\n")
    (tmp_path / "templates" / "cm.yaml").write_text(
        "kind: ConfigMap\ndata:\n  v: {{ .Capabilities.KubeVersion.Version | quote }}\n")
    with helm.Chart.load(tmp_path) as probe:
        manifests = render_for_kube_version(probe, {}, kube_version)
    assert yaml.safe_load(manifests["probe/templates/cm.yaml"])["data"]["v"] == f"v{kube_version}"
