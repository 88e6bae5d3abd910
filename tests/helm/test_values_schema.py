"""values.yaml, values.schema.json and the application's options stay in step; bad values fail
with a message that names the key."""

from __future__ import annotations

import dataclasses
import json
import re

import pytest
import yaml

from tests.helm.conftest import CHART_DIR, env_of, one, pod_spec

VALUES = yaml.safe_load((CHART_DIR / "values.yaml").read_text())
SCHEMA = json.loads((CHART_DIR / "values.schema.json").read_text())

# Options the chart sets itself from other values (ports, model source, TLS, discovery, keys).
ENGINE_MANAGED = {"host", "port", "metrics_port", "model", "tls_cert_file", "tls_key_file",
                  "tls_client_ca_file"}
ROUTER_MANAGED = {"host", "port", "http_port", "api_keys", "api_key_file", "discovery",
                  "engines", "dns_name", "engine_port", "dns_interval_s", "k8s_namespace",
                  "k8s_service", "k8s_label_selector", "k8s_port_name", "k8s_watch_timeout_s",
                  "engine_tls_ca_file", "engine_tls_cert_file", "engine_tls_key_file",
                  "engine_tls_server_name", "engine_kind", "vllm_kv_events_port",
                  "vllm_kv_replay_port", "tenants"}  # tenants: from router.tenants


def snake(name: str) -> str:
    return re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower()


def schema_paths(node: dict, prefix: str = "") -> set[str]:
    """Dotted paths of every described key; free-form objects (labels, resources) are leaves."""
    paths = set()
    for key, child in node.get("properties", {}).items():
        path = f"{prefix}{key}"
        paths.add(path)
        paths |= schema_paths(child, path + ".")
    return paths


def values_paths(values: dict, schema: dict, prefix: str = "") -> set[str]:
    paths = set()
    for key, value in values.items():
        path = f"{prefix}{key}"
        paths.add(path)
        child = schema.get("properties", {}).get(key, {})
        if isinstance(value, dict) and "properties" in child:
            paths |= values_paths(value, child, path + ".")
    return paths


def test_values_and_schema_describe_the_same_keys():
    in_values, in_schema = values_paths(VALUES, SCHEMA), schema_paths(SCHEMA)
    assert not in_values - in_schema, f"keys in values.yaml missing from the schema: " \
                                      f"{sorted(in_values - in_schema)}"
    assert not in_schema - in_values, f"keys in the schema missing from values.yaml: " \
                                      f"{sorted(in_schema - in_values)}"


def test_schema_is_strict_and_documented():
    assert SCHEMA["$schema"] == "http://json-schema.org/draft-07/schema#"

    def walk(node: dict, path: str) -> None:
        if "properties" in node:
            assert node.get("additionalProperties") is False, f"{path or '<root>'}: not strict"
        for key, child in node.get("properties", {}).items():
            assert child.get("description"), f"{path}{key}: no description"
            walk(child, f"{path}{key}.")

    walk(SCHEMA, "")


def test_every_key_in_values_yaml_has_a_comment():
    described, stack = schema_paths(SCHEMA), []
    lines = (CHART_DIR / "values.yaml").read_text().splitlines()
    for i, line in enumerate(lines):
        match = re.match(r"^( *)([A-Za-z0-9]+):", line)
        if not match:
            continue
        stack = stack[:len(match.group(1)) // 2] + [match.group(2)]
        if ".".join(stack) in described:  # not the contents of free-form maps
            assert lines[i - 1].lstrip().startswith("#"), f"values.yaml:{i + 1}: {line.strip()}"


def test_chart_defaults_follow_the_house_style():
    for path in schema_paths(SCHEMA):
        leaf = path.rsplit(".", 1)[-1]
        assert re.fullmatch(r"[a-z][a-zA-Z0-9]*", leaf), f"{path}: not camelCase"
        assert not re.fullmatch(r"enable[A-Z]\w*", leaf) or path.startswith("engine.config."), \
            f"{path}: use <feature>.enabled"
    for component in ("router", "engine"):
        image = VALUES[component]["image"]
        assert image["tag"] == "" and image["digest"] == "", "the tag follows the appVersion"
    assert not VALUES["engine"]["nodeSelector"] and not VALUES["engine"]["tolerations"]


def test_default_values_pass_the_schema(chart):
    chart.validate_schema(VALUES)
    chart.validate_schema({})


@pytest.mark.parametrize(("values", "message"), [
    ({"router": {"replicaCount": -1}}, "at '/router/replicaCount': minimum: got -1, want 0"),
    ({"engine": {"replicas": 2}}, "at '/engine': additional properties 'replicas' not allowed"),
    ({"router": {"discovery": {"mode": "consul"}}},
     "at '/router/discovery/mode': value must be one of"),
    ({"tracing": {"protocol": "udp"}}, "at '/tracing/protocol': value must be one of"),
    ({"engine": {"image": {"tag": "latest"}}}, "at '/engine/image/tag'"),
    ({"engine": {"config": {"gpuMemoryUtilization": 1.5}}},
     "at '/engine/config/gpuMemoryUtilization': maximum"),
    ({"engine": {"config": {"dtype": "int4"}}}, "at '/engine/config/dtype'"),
    ({"engine": {"gpu": {"count": 0}}}, "at '/engine/gpu/count': minimum"),
    ({"tracing": {"enabled": True}}, "at '/tracing/endpoint': minLength"),
    ({"tls": {"enabled": True}}, "at '/tls/engineSecretName': minLength"),
    ({"engine": {"model": {"source": "hub"}}}, "at '/engine/model/hub/repoId': minLength"),
    ({"engine": {"model": {"source": "pvc", "pvc": {"path": "m"}}}},
     "at '/engine/model/pvc/claimName': minLength"),
    ({"router": {"discovery": {"mode": "static"}}}, "at '/router/discovery/engines': minItems"),
    ({"router": {"apiKeys": {"enabled": True}}}, "at '/router/apiKeys/secretName': minLength"),
    ({"serviceMonitor": {"interval": "soon"}}, "at '/serviceMonitor/interval'"),
    ({"router": {"config": {"engineSlots": -1}}}, "at '/router/config/engineSlots': minimum"),
    ({"router": {"tenants": {"tenants": {"gold": {"weight": 0}}}}},
     "at '/router/tenants/tenants/gold/weight': exclusiveMinimum"),
    ({"router": {"tenants": {"tenants": {"gold": {"wieght": 2}}}}},
     "at '/router/tenants/tenants/gold': additional properties 'wieght' not allowed"),
    ({"router": {"tenants": {"tenants": {"gold": {"apiKeySha256": ["secret"]}}}}},
     "at '/router/tenants/tenants/gold/apiKeySha256/0'"),
    ({"router": {"tenants": {"default": {"requestsPerMinute": -1}}}},
     "at '/router/tenants/default/requestsPerMinute': minimum"),
])
def test_schema_rejects_bad_values_naming_the_key(render, values, message):
    import helm_python as helm

    with pytest.raises(helm.HelmValuesError) as error:
        render(values)
    assert message in str(error.value), str(error.value)


@pytest.mark.parametrize(("values", "message"), [
    ({"engine": {"terminationGracePeriodSeconds": 20}},
     "engine.terminationGracePeriodSeconds: must be at least engine.preStopSleepSeconds + "
     "engine.config.drainTimeoutS = 40, got 20"),
    ({"router": {"autoscaling": {"enabled": True, "minReplicas": 5, "maxReplicas": 2}}},
     "router.autoscaling.minReplicas: must not exceed maxReplicas"),
])
def test_templates_reject_inconsistent_values(render, values, message):
    import helm_python as helm

    with pytest.raises(helm.HelmRenderError) as error:
        render(values)
    assert message in str(error.value), str(error.value)


def _fields(*classes) -> set[str]:
    return {f.name for cls in classes for f in dataclasses.fields(cls)}


def test_engine_config_covers_every_engine_option():
    from engine_worker.config import DTYPE_NAMES, EngineArgs
    from engine_worker.server.config import ServerConfig

    options = _fields(ServerConfig, EngineArgs)
    in_values = {snake(k) for k in VALUES["engine"]["config"]}
    assert in_values | ENGINE_MANAGED == options, (
        f"missing from engine.config: {sorted(options - in_values - ENGINE_MANAGED)}; "
        f"unknown to the engine: {sorted(in_values | ENGINE_MANAGED - options)}")
    dtype = SCHEMA["properties"]["engine"]["properties"]["config"]["properties"]["dtype"]
    assert set(dtype["enum"]) - {None} == set(DTYPE_NAMES)


def test_router_config_covers_every_router_option():
    from router.balancer import POLICIES
    from router.config import (DISCOVERY_KINDS, DiscoveryConfig, EngineTLSConfig,
                               PlacementConfig, RouterServerConfig)
    from router.flow_config import FlowConfig
    from router.tenants import TenantPolicy

    options = _fields(RouterServerConfig, DiscoveryConfig, PlacementConfig, EngineTLSConfig,
                      FlowConfig)
    in_values = {snake(k) for k in VALUES["router"]["config"]}
    assert in_values | ROUTER_MANAGED == options, (
        f"missing from router.config: {sorted(options - in_values - ROUTER_MANAGED)}; "
        f"unknown to the router: {sorted(in_values | ROUTER_MANAGED - options)}")
    router_schema = SCHEMA["properties"]["router"]["properties"]
    assert set(router_schema["config"]["properties"]["policy"]["enum"]) - {None} == set(POLICIES)
    assert set(router_schema["discovery"]["properties"]["mode"]["enum"]) == set(DISCOVERY_KINDS)
    tenants = router_schema["tenants"]["properties"]
    policy_keys = {f.name for f in dataclasses.fields(TenantPolicy)}
    assert {snake(k) for k in tenants["default"]["properties"]} == policy_keys
    assert {snake(k) for k in tenants["tenants"]["additionalProperties"]["properties"]} == \
        policy_keys | {"api_key_sha256"}


def test_rendered_quire_variables_are_real_options(render):
    """With every option set, each QUIRE_* variable names a field of the component's config."""
    from engine_worker.config import EngineArgs
    from engine_worker.server.config import ServerConfig
    from router.config import (DiscoveryConfig, EngineTLSConfig, PlacementConfig,
                               RouterServerConfig)
    from router.flow_config import FlowConfig

    def filled(config: dict) -> dict:
        """A valid non-null value for every option."""
        out = {}
        for key, spec in config.items():
            kind = spec["type"][0] if isinstance(spec["type"], list) else spec["type"]
            sample = {"boolean": True, "integer": max(3, spec.get("minimum", 0)),
                      "number": 0.5, "string": "cpu" if key == "device" else "x"}[kind]
            out[key] = (spec.get("enum") or [sample])[0]
        return out

    props = SCHEMA["properties"]
    values = {
        "router": {"config": filled(props["router"]["properties"]["config"]["properties"]),
                   "apiKeys": {"enabled": True, "secretName": "keys"}},
        "engine": {"config": filled(props["engine"]["properties"]["config"]["properties"]),
                   "model": {"source": "image", "image": {"path": "/m"}}},
        "tls": {"enabled": True, "engineSecretName": "e", "routerSecretName": "r",
                "mutual": {"enabled": True}},
    }
    objects = render(values)
    expected = {
        "router": {"QUIRE_" + f.upper() for f in _fields(RouterServerConfig, DiscoveryConfig,
                                                         PlacementConfig, EngineTLSConfig,
                                                         FlowConfig)},
        "engine": {"QUIRE_" + f.upper() for f in _fields(ServerConfig, EngineArgs)} | {
            "QUIRE_CACHE_DIR"},
    }
    expected["router"].add("QUIRE_CACHE_DIR")
    for kind, component in (("Deployment", "router"), ("StatefulSet", "engine")):
        env = env_of(pod_spec(one(objects, kind, component))["containers"][0])
        names = {k for k in env if k.startswith("QUIRE_")}
        assert names <= expected[component], sorted(names - expected[component])
        assert len(names) >= len(values[component]["config"])
