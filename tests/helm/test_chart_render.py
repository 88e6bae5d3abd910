"""What the chart renders for each CI values file: names, labels, probes, hardening, RBAC,
grace periods, the NetworkPolicy, GPUs, tracing and TLS. Rendered offline; no cluster runs here."""

from __future__ import annotations

import math
import os

import pytest

from tests.helm.conftest import (CHART_DIR, CI_VALUES, NAMESPACE, RELEASE, env_of, find,
                                 load_values, one, pod_spec)

WORKLOADS = ("Deployment", "StatefulSet", "Pod")
STANDARD_LABELS = ("app.kubernetes.io/name", "app.kubernetes.io/instance",
                   "app.kubernetes.io/version", "app.kubernetes.io/managed-by",
                   "app.kubernetes.io/component", "helm.sh/chart")
VALUES_FILES = [p.name for p in CI_VALUES]


def test_ci_values_files_cover_the_required_profiles():
    for name in ("minimal", "multi-replica", "cpu-only", "tls", "tracing",
                 "kubernetes-discovery"):
        assert f"{name}-values.yaml" in VALUES_FILES


@pytest.mark.parametrize("values_file", VALUES_FILES)
def test_lint_is_clean(values_file):
    import helm_python as helm

    report = helm.lint(CHART_DIR, load_values(values_file), strict=True, namespace=NAMESPACE,
                       kube_version="v1.30.0")
    problems = [m for m in report["messages"] if m["severity"] >= 2]
    assert not report["errors"] and not problems, report


@pytest.fixture(scope="module", params=VALUES_FILES)
def rendered(request, render):
    return request.param, render(load_values(request.param))


def engines_enabled(values_file: str) -> bool:
    return load_values(values_file).get("engine", {}).get("enabled", True)


def containers(obj: dict) -> list[dict]:
    spec = pod_spec(obj)
    return spec.get("initContainers", []) + spec["containers"]


def test_objects_have_names_and_standard_labels(rendered):
    values_file, objects = rendered
    # The router's Role lives beside the engine Service it watches.
    discovery_ns = load_values(values_file).get("router", {}).get("discovery", {}).get(
        "namespace") or NAMESPACE
    assert objects
    for obj in objects:
        assert obj["apiVersion"] and obj["kind"] and obj["metadata"]["name"], obj
        labels = obj["metadata"]["labels"]
        for label in STANDARD_LABELS:
            assert labels.get(label), f"{obj['kind']}/{obj['metadata']['name']} lacks {label}"
        assert labels["app.kubernetes.io/instance"] == RELEASE
        if obj["kind"] in ("Role", "RoleBinding"):
            assert obj["metadata"]["namespace"] == discovery_ns
        elif obj["kind"] not in ("ClusterRole", "ClusterRoleBinding"):
            assert obj["metadata"]["namespace"] == NAMESPACE


def test_no_cluster_scoped_access_and_no_latest_images(rendered):
    _, objects = rendered
    assert not find(objects, "ClusterRole") and not find(objects, "ClusterRoleBinding")
    for obj in filter(lambda o: o["kind"] in WORKLOADS, objects):
        for c in containers(obj):
            assert not c["image"].endswith(":latest") and ":" in c["image"], c["image"]


def test_restricted_security_context_everywhere(rendered):
    _, objects = rendered
    for obj in filter(lambda o: o["kind"] in WORKLOADS, objects):
        pod = pod_spec(obj)["securityContext"]
        assert pod["runAsNonRoot"] is True and pod["runAsUser"] > 0
        assert pod["seccompProfile"] == {"type": "RuntimeDefault"}
        for c in containers(obj):
            sc = c["securityContext"]
            where = f"{obj['kind']}/{c['name']}"
            assert sc["runAsNonRoot"] is True, where
            assert sc["readOnlyRootFilesystem"] is True, where
            assert sc["allowPrivilegeEscalation"] is False, where
            assert sc["capabilities"] == {"drop": ["ALL"]}, where
            assert sc["seccompProfile"] == {"type": "RuntimeDefault"}, where
            assert "privileged" not in sc and "add" not in sc["capabilities"], where


def test_writable_cache_volumes_back_the_read_only_root(rendered):
    values_file, objects = rendered
    workloads = [one(objects, "Deployment", "router")]
    if engines_enabled(values_file):
        workloads.append(one(objects, "StatefulSet", "engine"))
    for workload in workloads:
        spec = pod_spec(workload)
        empty_dirs = {v["name"] for v in spec["volumes"] if "emptyDir" in v}
        mounts = {m["mountPath"]: m["name"] for m in spec["containers"][0]["volumeMounts"]}
        assert mounts["/tmp"] in empty_dirs and mounts["/cache"] in empty_dirs
        env = env_of(spec["containers"][0])
        assert env["QUIRE_CACHE_DIR"].startswith("/cache/") and env["HF_HOME"].startswith("/cache/")


def test_grpc_health_probes(rendered):
    name, objects = rendered
    router = one(objects, "Deployment", "router")["spec"]["template"]["spec"]["containers"][0]
    for probe in ("startupProbe", "livenessProbe"):  # the process answers
        assert router[probe]["grpc"] == {"port": 50050, "service": ""}
    # ready only while an engine serves behind it
    assert router["readinessProbe"]["grpc"] == {"port": 50050,
                                                "service": "quire.v1.EngineService"}
    if not engines_enabled(name):
        return
    engine = one(objects, "StatefulSet", "engine")["spec"]["template"]["spec"]["containers"][0]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        if name.startswith("tls"):
            # The kubelet's gRPC probe speaks no TLS: a grpc.health.v1 client over TLS instead.
            script = engine[probe]["exec"]["command"][-1]
            assert "HealthStub" in script and "ssl_channel_credentials" in script
        else:
            assert engine[probe]["grpc"] == {"port": 50051, "service": ""}
    startup = engine["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 300, "room for model load"


def test_grace_period_covers_prestop_and_drain(rendered):
    _, objects = rendered
    for obj in find(objects, "Deployment", "router") + find(objects, "StatefulSet", "engine"):
        spec = pod_spec(obj)
        container = spec["containers"][0]
        command = container["lifecycle"]["preStop"]["exec"]["command"]
        assert command[0] == "sleep"
        drain_s = float(env_of(container)["QUIRE_DRAIN_TIMEOUT_S"])
        assert spec["terminationGracePeriodSeconds"] >= int(command[1]) + math.ceil(drain_s)


def test_grace_period_arithmetic(render):
    engine = one(render({"engine": {"preStopSleepSeconds": 7, "config": {"drainTimeoutS": 45}}}),
                 "StatefulSet", "engine")
    assert pod_spec(engine)["terminationGracePeriodSeconds"] == 7 + 45 + 10
    router = one(render({"router": {"terminationGracePeriodSeconds": 35}}), "Deployment",
                 "router")
    assert pod_spec(router)["terminationGracePeriodSeconds"] == 35


def test_rbac_is_read_only_on_endpointslices(rendered):
    _, objects = rendered
    router = one(objects, "Deployment", "router")
    spec = pod_spec(router)
    mode = env_of(spec["containers"][0])["QUIRE_DISCOVERY"]
    roles = find(objects, "Role")
    if mode != "kubernetes":
        assert not roles and spec["automountServiceAccountToken"] is False
        return
    role = one(objects, "Role")
    assert role["rules"] == [{"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"],
                              "verbs": ["get", "list", "watch"]}]
    binding = one(objects, "RoleBinding")
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": spec["serviceAccountName"],
                                    "namespace": NAMESPACE}]
    assert spec["automountServiceAccountToken"] is True


def test_kubernetes_discovery_watches_the_engine_service(render):
    objects = render(load_values("kubernetes-discovery-values.yaml"))
    env = env_of(pod_spec(one(objects, "Deployment", "router"))["containers"][0])
    engine_service = one(objects, "Service", "engine")
    assert engine_service["spec"]["clusterIP"] == "None"
    ports = {p["name"]: p["port"] for p in engine_service["spec"]["ports"]}
    assert ports["grpc"] == int(env["QUIRE_ENGINE_PORT"]) == 50051
    assert env["QUIRE_K8S_SERVICE"] == engine_service["metadata"]["name"]
    assert env["QUIRE_K8S_NAMESPACE"] == NAMESPACE and env["QUIRE_K8S_PORT_NAME"] == "grpc"
    assert env["QUIRE_API_KEY_FILE"] == "/etc/quire/auth/api-keys"


def test_only_the_router_pods_use_a_token(rendered):
    _, objects = rendered
    for obj in find(objects, "StatefulSet") + find(objects, "Pod"):
        assert pod_spec(obj)["automountServiceAccountToken"] is False
    for sa in find(objects, "ServiceAccount"):
        assert sa["automountServiceAccountToken"] is False
    for obj in filter(lambda o: o["kind"] in WORKLOADS, objects):
        # Service links would inject QUIRE_*_PORT=tcp://... that the CLI reads as options.
        assert pod_spec(obj)["enableServiceLinks"] is False


def test_network_policy_admits_only_the_router_to_engines(rendered):
    values_file, objects = rendered
    if not engines_enabled(values_file):  # engines deployed elsewhere guard themselves
        assert not find(objects, "NetworkPolicy")
        return
    policy = one(objects, "NetworkPolicy")
    engine = one(objects, "StatefulSet", "engine")
    router = one(objects, "Deployment", "router")
    selector = policy["spec"]["podSelector"]["matchLabels"]
    assert selector == engine["spec"]["selector"]["matchLabels"]
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    grpc_rules = [r for r in policy["spec"]["ingress"] if {"port": "grpc", "protocol": "TCP"}
                  in r["ports"]]
    assert len(grpc_rules) == 1
    assert grpc_rules[0]["from"] == [
        {"podSelector": {"matchLabels": router["spec"]["selector"]["matchLabels"]}}]
    for rule in policy["spec"]["ingress"]:
        if rule is not grpc_rules[0]:
            assert rule["ports"] == [{"port": "metrics", "protocol": "TCP"}]


def test_gpu_requests_only_in_the_gpu_profile(render):
    gpu = one(render(load_values("multi-replica-values.yaml")), "StatefulSet", "engine")
    c = pod_spec(gpu)["containers"][0]
    assert c["resources"]["limits"]["nvidia.com/gpu"] == "2"
    assert c["resources"]["requests"]["nvidia.com/gpu"] == "2"
    assert env_of(c)["QUIRE_DEVICE"] == "cuda"
    assert pod_spec(gpu)["tolerations"][0]["key"] == "nvidia.com/gpu"
    assert pod_spec(gpu)["nodeSelector"] and pod_spec(gpu)["affinity"]["podAntiAffinity"]

    cpu = one(render(load_values("cpu-only-values.yaml")), "StatefulSet", "engine")
    c = pod_spec(cpu)["containers"][0]
    assert not any("gpu" in k for k in {**c["resources"]["limits"], **c["resources"]["requests"]})
    assert env_of(c)["QUIRE_DEVICE"] == "cpu" and env_of(c)["QUIRE_NUM_THREADS"] == "4"
    assert c["image"].startswith("quire/engine-cpu:")


def test_tensor_parallel_engines_request_a_gpu_a_rank_and_a_memory_backed_shm(render):
    gpu = one(render({"engine": {"config": {"tensorParallelSize": 4,
                                            "pipelineParallelSize": 2}}}),
              "StatefulSet", "engine")
    spec = pod_spec(gpu)
    c = spec["containers"][0]
    assert c["resources"]["limits"]["nvidia.com/gpu"] == "8"
    assert c["resources"]["requests"]["nvidia.com/gpu"] == "8"
    assert env_of(c)["QUIRE_TENSOR_PARALLEL_SIZE"] == "4"
    assert env_of(c)["QUIRE_PIPELINE_PARALLEL_SIZE"] == "2"
    assert {"name": "shm", "mountPath": "/dev/shm"} in c["volumeMounts"]
    shm = next(v for v in spec["volumes"] if v["name"] == "shm")
    assert shm["emptyDir"]["medium"] == "Memory"
    # a larger gpu.count stays; on a CPU the ranks ask for no GPU
    more = one(render({"engine": {"gpu": {"count": 16}, "config": {"tensorParallelSize": 2}}}),
               "StatefulSet", "engine")
    assert pod_spec(more)["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "16"
    cpu = one(render({"engine": {"gpu": {"enabled": False},
                                 "config": {"tensorParallelSize": 2}}}), "StatefulSet", "engine")
    c = pod_spec(cpu)["containers"][0]
    assert not any("gpu" in k for k in {**c["resources"].get("limits", {}),
                                        **c["resources"].get("requests", {})})
    assert env_of(c)["QUIRE_TENSOR_PARALLEL_SIZE"] == "2"


def test_lora_adapters_from_a_volume_or_an_init_container(render):
    """Adapters from a claim are mounted read-only and become the run-time load directory;
    an init container fills an emptyDir the engine then reads."""
    claim = one(render({"engine": {"config": {"maxLoras": 2, "loraModules": "sql=/adapters/sql"},
                                   "lora": {"volume": {"persistentVolumeClaim": {
                                       "claimName": "adapters"}}}}}), "StatefulSet", "engine")
    spec = pod_spec(claim)
    c = spec["containers"][0]
    env = env_of(c)
    assert env["QUIRE_MAX_LORAS"] == "2" and env["QUIRE_LORA_MODULES"] == "sql=/adapters/sql"
    assert env["QUIRE_LORA_ADAPTER_DIRS"] == "/adapters"
    assert {"name": "lora-adapters", "mountPath": "/adapters", "readOnly": True} in \
        c["volumeMounts"]
    volume = next(v for v in spec["volumes"] if v["name"] == "lora-adapters")
    assert volume["persistentVolumeClaim"] == {"claimName": "adapters"}
    assert "initContainers" not in spec

    fetched = one(render({"engine": {"lora": {"mountPath": "/srv/lora", "initContainers": [
        {"name": "fetch", "image": "busybox:1.36", "command": ["sh", "-c", "true"]}]},
        "config": {"loraAdapterDirs": "/srv/lora,/extra"}}}), "StatefulSet", "engine")
    spec = pod_spec(fetched)
    init = next(c for c in spec["initContainers"] if c["name"] == "fetch")
    assert {"name": "lora-adapters", "mountPath": "/srv/lora"} in init["volumeMounts"]
    assert next(v for v in spec["volumes"] if v["name"] == "lora-adapters")["emptyDir"] == {}
    assert env_of(spec["containers"][0])["QUIRE_LORA_ADAPTER_DIRS"] == "/srv/lora,/extra"

    plain = pod_spec(one(render({}), "StatefulSet", "engine"))
    assert not any(v["name"] == "lora-adapters" for v in plain["volumes"])
    assert "QUIRE_LORA_ADAPTER_DIRS" not in env_of(plain["containers"][0])


def test_engine_options_become_quire_variables(render):
    objects = render(load_values("multi-replica-values.yaml"))
    env = env_of(pod_spec(one(objects, "StatefulSet", "engine"))["containers"][0])
    assert env["QUIRE_MAX_MODEL_LEN"] == "8192" and env["QUIRE_DTYPE"] == "bfloat16"
    assert env["QUIRE_GPU_MEMORY_UTILIZATION"] == "0.9"
    assert env["QUIRE_ENABLE_PREFIX_CACHING"] == "true"
    assert env["QUIRE_MAX_NUM_BATCHED_TOKENS"] == "4096" and env["QUIRE_METRICS_PORT"] == "9090"
    router_env = env_of(pod_spec(one(objects, "Deployment", "router"))["containers"][0])
    assert router_env["QUIRE_MAX_BODY_BYTES"] == "8388608", "never 8.388608e+06"
    assert "QUIRE_TOKENIZER" not in router_env, "null values keep the application default"


def test_model_sources(render):
    hub = pod_spec(one(render(load_values("multi-replica-values.yaml")), "StatefulSet"))
    (download,) = hub["initContainers"]
    assert download["command"][:3] == ["hf", "download", "Qwen/Qwen2.5-7B-Instruct"]
    assert env_of(download)["HF_TOKEN"] == {"secretKeyRef": {"name": "hf-token", "key": "token"}}
    assert env_of(hub["containers"][0])["QUIRE_MODEL"] == download["command"][-1]
    assert "HF_TOKEN" not in env_of(hub["containers"][0]), "only the download sees the token"

    pvc = pod_spec(one(render(load_values("kubernetes-discovery-values.yaml")), "StatefulSet"))
    assert env_of(pvc["containers"][0])["QUIRE_MODEL"] == "/models/llama-3.2-1b-instruct"
    (models,) = [v for v in pvc["volumes"] if v["name"] == "models"]
    assert models["persistentVolumeClaim"] == {"claimName": "models", "readOnly": True}

    baked = pod_spec(one(render(load_values("dns-discovery-values.yaml")), "StatefulSet"))
    assert env_of(baked["containers"][0])["QUIRE_MODEL"] == "/opt/models/smollm2-360m-instruct"
    embedded = pod_spec(one(render(load_values("minimal-values.yaml")), "StatefulSet"))
    assert "QUIRE_MODEL" not in env_of(embedded["containers"][0])
    assert "initContainers" not in embedded


def test_tracing_sets_otel_variables(render):
    for values_file, enabled in (("tracing-values.yaml", True), ("minimal-values.yaml", False)):
        objects = render(load_values(values_file))
        for obj in (one(objects, "Deployment", "router"), one(objects, "StatefulSet", "engine")):
            env = env_of(pod_spec(obj)["containers"][0])
            if not enabled:
                assert not [k for k in env if k.startswith("OTEL_")]
                continue
            component = obj["metadata"]["labels"]["app.kubernetes.io/component"]
            endpoint = "http://otel-collector.observability.svc:4317"
            assert env["OTEL_EXPORTER_OTLP_ENDPOINT"] == endpoint
            assert env["OTEL_EXPORTER_OTLP_PROTOCOL"] == "grpc"
            assert env["OTEL_SERVICE_NAME"] == f"quire-{component}"
            assert env["OTEL_TRACES_SAMPLER"] == "parentbased_traceidratio"
            assert env["OTEL_TRACES_SAMPLER_ARG"] == "0.25"
            assert env["OTEL_EXPORTER_OTLP_HEADERS"] == {
                "secretKeyRef": {"name": "otlp-headers", "key": "headers"}}
            assert "deployment.environment=staging" in env["OTEL_RESOURCE_ATTRIBUTES"]


def test_tls_mounts_secrets_and_passes_flags(render):
    objects = render(load_values("tls-values.yaml"))
    router = pod_spec(one(objects, "Deployment", "router"))
    engine = pod_spec(one(objects, "StatefulSet", "engine"))
    r_env, e_env = env_of(router["containers"][0]), env_of(engine["containers"][0])
    assert e_env["QUIRE_TLS_CERT_FILE"] == "/etc/quire/tls/tls.crt"
    assert e_env["QUIRE_TLS_KEY_FILE"] == "/etc/quire/tls/tls.key"
    assert e_env["QUIRE_TLS_CLIENT_CA_FILE"] == "/etc/quire/tls/ca.crt"
    assert r_env["QUIRE_ENGINE_TLS_CA_FILE"] == "/etc/quire/tls/ca.crt"
    assert r_env["QUIRE_ENGINE_TLS_CERT_FILE"] == "/etc/quire/tls/tls.crt"
    assert r_env["QUIRE_ENGINE_TLS_KEY_FILE"] == "/etc/quire/tls/tls.key"
    assert r_env["QUIRE_ENGINE_TLS_SERVER_NAME"] == f"{RELEASE}-quire-engine.{NAMESPACE}.svc"
    secrets = {spec_name: {v["name"]: v["secret"]["secretName"] for v in spec["volumes"]
                           if "secret" in v} for spec_name, spec in (("router", router),
                                                                      ("engine", engine))}
    assert secrets == {"router": {"tls": "quire-router-tls"}, "engine": {"tls": "quire-engine-tls"}}
    for spec in (router, engine):
        mount = [m for m in spec["containers"][0]["volumeMounts"] if m["name"] == "tls"]
        assert mount == [{"name": "tls", "mountPath": "/etc/quire/tls", "readOnly": True}]

    plain = render(load_values("minimal-values.yaml"))
    for obj in (one(plain, "Deployment", "router"), one(plain, "StatefulSet", "engine")):
        assert not [k for k in env_of(pod_spec(obj)["containers"][0]) if "TLS" in k]


def test_router_replicas_hpa_and_pdbs(render):
    objects = render(load_values("multi-replica-values.yaml"))
    deployment = one(objects, "Deployment", "router")
    assert "replicas" not in deployment["spec"], "the HPA owns the replica count"
    hpa = one(objects, "HorizontalPodAutoscaler", "router")
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (3, 12)
    assert hpa["spec"]["scaleTargetRef"]["name"] == deployment["metadata"]["name"]
    assert one(objects, "StatefulSet", "engine")["spec"]["replicas"] == 4
    for component, workload in (("router", deployment), ("engine", one(objects, "StatefulSet"))):
        pdb = one(objects, "PodDisruptionBudget", component)
        assert pdb["spec"]["selector"]["matchLabels"] == workload["spec"]["selector"]["matchLabels"]
    monitors = {m["metadata"]["labels"]["app.kubernetes.io/component"]: m["spec"]["endpoints"][0]
                for m in find(objects, "ServiceMonitor")}
    assert monitors["router"]["port"] == "http" and monitors["engine"]["port"] == "metrics"
    assert not find(render({}), "ServiceMonitor"), "off by default"


def test_services_expose_named_ports(render):
    objects = render({})
    router = one(objects, "Service", "router")
    assert {p["name"]: p["port"] for p in router["spec"]["ports"]} == {"grpc": 50050, "http": 8000}
    engine = one(objects, "Service", "engine")
    assert {p["name"]: p["port"] for p in engine["spec"]["ports"]} == {"grpc": 50051,
                                                                       "metrics": 9090}
    assert one(objects, "StatefulSet")["spec"]["serviceName"] == engine["metadata"]["name"]


@pytest.mark.parametrize("values_file", VALUES_FILES)
def test_rendered_objects_are_valid_kubernetes_models(values_file, render):
    """Each object survives a round trip through the Kubernetes client's models: a misspelt or
    misplaced field would be dropped and show up as a difference."""
    kubernetes = pytest.importorskip("kubernetes")
    api = kubernetes.client.ApiClient()
    for obj in render(load_values(values_file)):
        if obj["apiVersion"].startswith("monitoring.coreos.com"):
            continue  # a CRD: no model in the client
        version = obj["apiVersion"].rsplit("/", 1)[-1]
        model = getattr(kubernetes.client, version.capitalize() + obj["kind"])
        parsed = api._ApiClient__deserialize(obj, model.__name__)
        assert api.sanitize_for_serialization(parsed) == obj, obj["kind"]


@pytest.mark.parametrize("values_file", VALUES_FILES)
def test_rendered_environment_parses_with_the_real_cli(values_file, render, monkeypatch):
    """The QUIRE_* variables the chart sets are accepted by `quire router` / `quire engine`."""
    from engine_worker.server.config import ServerConfig
    from quire.config_args import dataclass_from_namespace
    from quire_cli.main import build_parser
    from router.config import (DiscoveryConfig, EngineTLSConfig, PlacementConfig,
                               RouterServerConfig)
    from router.flow_config import FlowConfig

    objects = render(load_values(values_file))
    commands = [("router", one(objects, "Deployment", "router"),
                 (RouterServerConfig, DiscoveryConfig, PlacementConfig, EngineTLSConfig,
                  FlowConfig))]
    if engines_enabled(values_file):
        commands.append(("engine", one(objects, "StatefulSet", "engine"), (ServerConfig,)))
    for command, workload, classes in commands:
        with monkeypatch.context() as patch:
            for name, value in env_of(pod_spec(workload)["containers"][0]).items():
                if name.startswith("QUIRE_") and isinstance(value, str):
                    patch.setenv(name, value)
            namespace = build_parser([command]).parse_args([command])  # flags read QUIRE_* here
            for cls in classes:
                dataclass_from_namespace(cls, namespace)  # raises ValueError naming a field


def test_router_only_in_front_of_an_existing_engine_service(render):
    """engine.enabled=false: no engine objects; the router watches the named Service's
    EndpointSlices in its namespace, where its Role is; the binding names the router's account."""
    objects = render(load_values("router-only-values.yaml"))
    assert not [o for o in objects
                if o["metadata"]["labels"]["app.kubernetes.io/component"] == "engine"]
    env = env_of(pod_spec(one(objects, "Deployment", "router"))["containers"][0])
    assert (env["QUIRE_DISCOVERY"], env["QUIRE_K8S_SERVICE"], env["QUIRE_K8S_NAMESPACE"],
            env["QUIRE_K8S_PORT_NAME"]) == ("kubernetes", "llm-engines", "models", "grpc")
    role, binding = one(objects, "Role"), one(objects, "RoleBinding")
    assert role["metadata"]["namespace"] == binding["metadata"]["namespace"] == "models"
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": f"{RELEASE}-quire-router",
                                    "namespace": NAMESPACE}]
    dns = render({"engine": {"enabled": False, "ports": {"grpc": 8001}},
                  "router": {"discovery": {"mode": "dns", "service": "llm-engines",
                                           "namespace": "models"}},
                  "tls": {"enabled": True, "routerSecretName": "router-tls"}})
    env = env_of(pod_spec(one(dns, "Deployment", "router"))["containers"][0])
    assert env["QUIRE_DNS_NAME"] == "llm-engines.models.svc"
    assert env["QUIRE_ENGINE_PORT"] == "8001"
    assert env["QUIRE_ENGINE_TLS_SERVER_NAME"] == "llm-engines.models.svc"
    assert not find(dns, "Role")
    with pytest.raises(Exception, match="router.discovery.service"):
        render({"engine": {"enabled": False}})  # would discover a Service nobody deploys


def test_router_only_in_front_of_an_existing_vllm_service(render):
    """engineKind vllm: the router discovers the vLLM Service's pods as vLLM engines on their
    HTTP port, with each pod's KV-event and replay ports, and a tokenizer of its own."""
    objects = render(load_values("router-vllm-values.yaml"))
    assert not [o for o in objects
                if o["metadata"]["labels"]["app.kubernetes.io/component"] == "engine"]
    env = env_of(pod_spec(one(objects, "Deployment", "router"))["containers"][0])
    assert (env["QUIRE_ENGINE_KIND"], env["QUIRE_ENGINE_PORT"], env["QUIRE_K8S_SERVICE"],
            env["QUIRE_K8S_PORT_NAME"], env["QUIRE_VLLM_KV_EVENTS_PORT"],
            env["QUIRE_VLLM_KV_REPLAY_PORT"], env["QUIRE_TOKENIZER"],
            env["QUIRE_VLLM_BLOCK_SIZE"]) == (
        "vllm", "8000", "vllm", "http", "5557", "5558", "/models/tokenizer", "16")
    quire = env_of(pod_spec(one(render({}), "Deployment", "router"))["containers"][0])
    assert "QUIRE_ENGINE_KIND" not in quire  # this chart's own engines: the default kind
    with pytest.raises(Exception, match="engine.enabled=false"):
        render({"router": {"discovery": {"engineKind": "vllm"}}})


def test_flow_control_values_reach_the_router(render, monkeypatch):
    """router.config's flow options become QUIRE_* variables, router.tenants one JSON variable
    in the router's own (snake_case) names, which the real FlowConfig parses."""
    from quire_cli.main import build_parser
    from quire.config_args import dataclass_from_namespace
    from router.flow_config import FlowConfig
    from router.tenants import TenantPolicy

    digest = "ab" * 32
    objects = render({"router": {
        "config": {"tenantHeader": "x-tenant-id", "queueTimeoutS": 30, "engineSlots": 0},
        "tenants": {"default": {"maxQueue": 16, "tokensPerMinute": 100000, "minPriority": 0},
                    "tenants": {"gold": {"weight": 4, "priority": -1, "minPriority": -1,
                                         "requestsPerMinute": 600, "apiKeySha256": [digest]},
                                "batch": {"weight": 0.5, "priority": 10}}}}})
    env = env_of(pod_spec(one(objects, "Deployment", "router"))["containers"][0])
    assert env["QUIRE_TENANT_HEADER"] == "x-tenant-id" and env["QUIRE_QUEUE_TIMEOUT_S"] == "30"
    with monkeypatch.context() as patch:
        for name, value in env.items():
            if name.startswith("QUIRE_") and isinstance(value, str):
                patch.setenv(name, value)
        cfg = dataclass_from_namespace(FlowConfig, build_parser(["router"]).parse_args(["router"]))
    table = cfg.table()
    assert table.header == "x-tenant-id" and cfg.queue_timeout_s == 30
    assert table.default == TenantPolicy(max_queue=16, tokens_per_minute=100000,
                                         min_priority=0)
    assert table.tenants["gold"] == TenantPolicy(weight=4, priority=-1, max_queue=16,
                                                 requests_per_minute=600, min_priority=-1,
                                                 tokens_per_minute=100000)
    assert table.tenants["batch"].weight == 0.5 and table.key_tenants == {digest: "gold"}
    default_env = env_of(pod_spec(one(render({}), "Deployment", "router"))["containers"][0])
    assert "QUIRE_TENANTS" not in default_env and "QUIRE_GRADIENT_LIMIT" not in default_env


@pytest.mark.parametrize("value, mode", [("auto", "auto"), ("off", "off"), (True, "on"),
                                         (False, "off"), (None, "auto")])
def test_gradient_limit_value_reaches_the_router(render, monkeypatch, value, mode):
    """router.config.gradientLimit: auto / on / off, or a boolean as before auto (null: the
    router's default, auto)."""
    from quire_cli.main import build_parser
    from quire.config_args import dataclass_from_namespace
    from router.flow_config import FlowConfig

    objects = render({"router": {"config": {"gradientLimit": value}}})
    env = env_of(pod_spec(one(objects, "Deployment", "router"))["containers"][0])
    with monkeypatch.context() as patch:
        for name in [n for n in os.environ if n.startswith("QUIRE_")]:
            patch.delenv(name)
        for name, text in env.items():
            if name.startswith("QUIRE_") and isinstance(text, str):
                patch.setenv(name, text)
        cfg = dataclass_from_namespace(FlowConfig, build_parser(["router"]).parse_args(["router"]))
    assert cfg.gradient_limit == mode


def test_gradient_limit_value_is_checked_by_the_schema(render):
    with pytest.raises(Exception, match="gradientLimit"):
        render({"router": {"config": {"gradientLimit": "sometimes"}}})
