"""Engine discovery: static, DNS (scripted resolver and one real lookup), and Kubernetes.

The Kubernetes tests run the official ``kubernetes`` client over real HTTP against a loopback
stand-in for the API server (``tests.k8s_standin``); nothing in the client is replaced.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import socket
import subprocess
import sys
import threading
import time

import pytest

from router.config import DiscoveryConfig
from router.discovery import DISCOVERIES, DnsDiscovery, Endpoint, StaticDiscovery, make_discovery
from router.discovery_k8s import K8sWatchParams, KubernetesDiscovery
from tests.k8s_standin import K8sStandin, api_client_for, make_slice, pod_endpoint

NS = "serving"
SERVICE = "engines"


def endpoints(*pairs: tuple[str, str]) -> frozenset[Endpoint]:
    return frozenset(Endpoint(engine_id, address) for engine_id, address in pairs)


class Updates:
    """Consumes a discovery's updates in a task, so a test can wait for one with a timeout
    (cancelling ``anext`` itself would close the generator); leaving cancels the task."""

    def __init__(self, discovery) -> None:
        self._discovery = discovery
        self._queue: asyncio.Queue[frozenset[Endpoint]] = asyncio.Queue()

    async def _consume(self) -> None:
        async for found in self._discovery.updates():
            self._queue.put_nowait(found)

    async def __aenter__(self) -> Updates:
        self._task = asyncio.create_task(self._consume())
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task

    async def next(self, timeout_s: float = 3.0) -> frozenset[Endpoint]:
        get = asyncio.ensure_future(self._queue.get())
        await asyncio.wait({get, self._task}, timeout=timeout_s,
                           return_when=asyncio.FIRST_COMPLETED)
        if get.done():
            return get.result()
        get.cancel()
        if self._task.done():
            self._task.result()  # raises what ended the discovery
            raise AssertionError("discovery ended")
        raise TimeoutError(f"no update within {timeout_s}s")

    async def quiet(self, wait_s: float = 0.2) -> None:
        """No update arrives within ``wait_s``."""
        with pytest.raises(TimeoutError):
            await self.next(wait_s)


def discovery_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "quire-discovery-k8s"]


# ------------------------------------------------------------------------------------- static
def test_static_yields_once_then_waits():
    async def body():
        discovery = make_discovery(DiscoveryConfig(engines="a:1, [::1]:2"))
        assert isinstance(discovery, StaticDiscovery)
        async with Updates(discovery) as updates:
            assert await updates.next() == endpoints(("a:1", "a:1"), ("[::1]:2", "[::1]:2"))
            await updates.quiet()

    asyncio.run(body())


# ---------------------------------------------------------------------------------------- DNS
class ScriptedResolver:
    """Answers from a script, one entry a call (lists of IPs, or exceptions); the last repeats."""

    def __init__(self, *script):
        self.script = list(script)
        self.calls = 0

    async def __call__(self, name: str, port: int) -> list[str]:
        assert (name, port) == ("engines.serving.svc", 7000)
        answer = self.script[min(self.calls, len(self.script) - 1)]
        self.calls += 1
        if isinstance(answer, Exception):
            raise answer
        return answer


def dns_discovery(resolver: ScriptedResolver) -> DnsDiscovery:
    cfg = DiscoveryConfig(discovery="dns", dns_name="engines.serving.svc", engine_port=7000,
                          dns_interval_s=0.01)
    discovery = make_discovery(cfg, resolver=resolver)
    assert isinstance(discovery, DnsDiscovery)
    return discovery


def by_address(*addresses: str) -> frozenset[Endpoint]:
    return frozenset(Endpoint(a, a) for a in addresses)


def test_dns_yields_on_change_only():
    resolver = ScriptedResolver(["10.0.0.1", "10.0.0.2"], ["10.0.0.2", "10.0.0.1"],
                                ["10.0.0.1", "10.0.0.2", "10.0.0.1"], ["10.0.0.2", "fd00::3"])

    async def body():
        async with Updates(dns_discovery(resolver)) as updates:
            assert await updates.next() == by_address("10.0.0.1:7000", "10.0.0.2:7000")
            # the same set, in other orders and with duplicates, twice: no update for those
            assert await updates.next() == by_address("10.0.0.2:7000", "[fd00::3]:7000")
            await updates.quiet(0.05)
            assert resolver.calls >= 4

    asyncio.run(body())


def test_dns_failure_keeps_the_last_set_and_nxdomain_empties_it():
    blip = socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution")
    nxdomain = socket.gaierror(socket.EAI_NONAME, "Name or service not known")
    resolver = ScriptedResolver(blip, OSError("no resolver"), ["10.0.0.1"], blip, blip,
                                ["10.0.0.1"], ["10.0.0.2"], nxdomain)

    async def body():
        async with Updates(dns_discovery(resolver)) as updates:
            # failures before the first answer yield nothing; failures after keep the set
            assert await updates.next() == by_address("10.0.0.1:7000")
            assert await updates.next() == by_address("10.0.0.2:7000")
            # a headless Service with no ready pod: the name does not exist, the set is empty
            assert await updates.next() == frozenset()
            await updates.quiet(0.05)

    asyncio.run(body())


def test_dns_resolves_localhost_for_real():
    async def body():
        cfg = DiscoveryConfig(discovery="dns", dns_name="localhost", engine_port=50051)
        async with Updates(make_discovery(cfg)) as updates:
            found = await updates.next(timeout_s=10.0)
        assert found and found <= by_address("127.0.0.1:50051", "[::1]:50051")

    asyncio.run(body())


# --------------------------------------------------------------------------------- Kubernetes
@pytest.fixture
def standin():
    with K8sStandin() as server:
        yield server
    # Every test's discovery thread has left its watch and ended, promptly.
    deadline = time.monotonic() + 3.0
    while (discovery_threads() or server.open_watches) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not discovery_threads() and server.open_watches == 0


def k8s_config(**overrides) -> DiscoveryConfig:
    return DiscoveryConfig(discovery="kubernetes", k8s_namespace=NS, k8s_service=SERVICE,
                           **overrides)


def k8s_discovery(url: str, **overrides) -> KubernetesDiscovery:
    params = K8sWatchParams(namespace=NS, label_selector=f"kubernetes.io/service-name={SERVICE}",
                            port_name="grpc", default_port=50051, watch_timeout_s=30,
                            backoff_initial_s=0.05, backoff_max_s=0.2)
    return KubernetesDiscovery(api_client_for(url), dataclasses.replace(params, **overrides))


def run_k8s(standin: K8sStandin, scenario, cfg: DiscoveryConfig | None = None,
            discovery: KubernetesDiscovery | None = None) -> None:
    async def body():
        found = discovery or make_discovery(cfg or k8s_config(),
                                            api_client=api_client_for(standin.url))
        assert isinstance(found, KubernetesDiscovery)
        async with Updates(found) as updates:
            await scenario(updates)

    asyncio.run(body())


def two_pods(*, b: dict | None = None) -> dict:
    return make_slice("engines-abc", SERVICE, [pod_endpoint("engine-a", "10.1.0.1"),
                                               b or pod_endpoint("engine-b", "10.1.0.2")])


def one_pod() -> dict:
    return make_slice("engines-abc", SERVICE, [pod_endpoint("engine-a", "10.1.0.1")])


A = ("engine-a", "10.1.0.1:50051")
B = ("engine-b", "10.1.0.2:50051")


def test_k8s_initial_list_names_pods_and_ports(standin):
    standin.put_slice(NS, two_pods())
    standin.put_slice(NS, make_slice("engines-v6", SERVICE, [pod_endpoint("engine-c", "fd00::c")],
                                     port=7000, address_type="IPv6"))
    # no port named "grpc": engine_port; no targetRef: the address is the id
    standin.put_slice(NS, make_slice("engines-x", SERVICE, [pod_endpoint(None, "10.1.0.9")],
                                     port=9999, port_name="metrics"))

    async def scenario(updates):
        assert await updates.next() == endpoints(
            A, B, ("engine-c", "[fd00::c]:7000"), ("10.1.0.9:50051", "10.1.0.9:50051"))
        await updates.quiet()

    run_k8s(standin, scenario)


def test_k8s_watch_events_add_and_remove_engines(standin):
    standin.put_slice(NS, one_pod())

    async def scenario(updates):
        assert await updates.next() == endpoints(A)
        standin.put_slice(NS, two_pods())  # a pod joins
        assert await updates.next() == endpoints(A, B)
        standin.put_slice(NS, two_pods(b=pod_endpoint("engine-b", "10.1.0.2", ready=False)))
        assert await updates.next() == endpoints(A)
        standin.put_slice(NS, two_pods(b=pod_endpoint("engine-b", "10.1.0.2", ready=None)))
        assert await updates.next() == endpoints(A, B)  # no ready condition means ready
        # draining: still serving, but new requests must go elsewhere
        standin.put_slice(NS, two_pods(b=pod_endpoint("engine-b", "10.1.0.2", ready=None,
                                                      serving=True, terminating=True)))
        assert await updates.next() == endpoints(A)
        standin.put_slice(NS, make_slice("engines-def", SERVICE,
                                         [pod_endpoint("engine-d", "10.1.0.4")]))
        assert await updates.next() == endpoints(A, ("engine-d", "10.1.0.4:50051"))
        standin.delete_slice(NS, "engines-abc")
        assert await updates.next() == endpoints(("engine-d", "10.1.0.4:50051"))
        standin.put_slice(NS, make_slice("engines-def", SERVICE, []))  # the last pod leaves
        assert await updates.next() == frozenset()
        assert standin.num_lists == 1

    run_k8s(standin, scenario)


def test_k8s_unchanged_set_is_not_yielded_again(standin):
    standin.put_slice(NS, two_pods())

    async def scenario(updates):
        assert await updates.next() == endpoints(A, B)
        # a new slice object whose usable endpoints are the same (a not-ready extra pod)
        standin.put_slice(NS, make_slice("engines-abc", SERVICE, [
            pod_endpoint("engine-b", "10.1.0.2"), pod_endpoint("engine-a", "10.1.0.1"),
            pod_endpoint("engine-z", "10.1.0.26", ready=False)]))
        await updates.quiet()

    run_k8s(standin, scenario)


def test_k8s_dual_stack_pod_is_one_engine(standin):
    standin.put_slice(NS, make_slice("engines-v6", SERVICE, [pod_endpoint("engine-a", "fd00::a")],
                                     address_type="IPv6"))

    async def scenario(updates):
        assert await updates.next() == endpoints(("engine-a", "[fd00::a]:50051"))
        standin.put_slice(NS, make_slice("engines-v4", SERVICE,
                                         [pod_endpoint("engine-a", "10.1.0.1")]))
        assert await updates.next() == endpoints(A)  # IPv4 first, deterministically

    run_k8s(standin, scenario)


def test_k8s_watch_expiry_relists_and_sees_changes_missed_meanwhile(standin):
    standin.put_slice(NS, two_pods())

    async def scenario(updates):
        assert await updates.next() == endpoints(A, B)
        # no event reaches the watch: only the LIST after the watch times out can see it
        standin.delete_slice(NS, "engines-abc", broadcast=False)
        assert await updates.next(timeout_s=4.0) == frozenset()
        assert standin.num_lists >= 2

    run_k8s(standin, scenario, cfg=k8s_config(k8s_watch_timeout_s=1))


def test_k8s_gone_410_relists(standin):
    standin.put_slice(NS, two_pods(b=pod_endpoint("engine-b", "10.1.0.2", ready=False)))

    async def scenario(updates):
        assert await updates.next() == endpoints(A)
        standin.put_slice(NS, two_pods(), broadcast=False)
        standin.compact()  # the watch is behind the newest version, and history is gone
        assert await updates.next() == endpoints(A, B)
        assert standin.num_lists == 2

    run_k8s(standin, scenario)


def test_k8s_label_selector_ignores_other_services(standin):
    standin.put_slice(NS, make_slice("other-xyz", "other", [pod_endpoint("other-a", "10.2.0.1")]))
    standin.put_slice("elsewhere", two_pods())
    standin.put_slice(NS, one_pod())

    async def scenario(updates):
        assert await updates.next() == endpoints(A)
        standin.put_slice(NS, make_slice("other-xyz", "other", [pod_endpoint("o-b", "10.2.0.2")]))
        standin.put_slice("elsewhere", make_slice("engines-abc", SERVICE, []))
        await updates.quiet()

    run_k8s(standin, scenario)
    # the same through a label selector instead of a Service name
    run_k8s(standin, scenario, cfg=DiscoveryConfig(
        discovery="kubernetes", k8s_namespace=NS,
        k8s_label_selector=f"kubernetes.io/service-name={SERVICE},tier!=cache"))


def test_k8s_api_server_down_at_start_then_up():
    with socket.socket() as probe:  # a free port, closed: connections are refused
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    url = f"http://127.0.0.1:{port}"

    async def body():
        async with Updates(k8s_discovery(url)) as updates:
            await updates.quiet(0.5)  # refused, retried, nothing to say yet
            with K8sStandin(port) as standin:
                standin.put_slice(NS, two_pods())
                assert await updates.next() == endpoints(A, B)

    asyncio.run(body())


def test_k8s_server_errors_back_off_and_keep_the_last_set(standin):
    standin.fail_next(503, 500)
    standin.put_slice(NS, two_pods())

    async def scenario(updates):
        assert await updates.next() == endpoints(A, B)
        assert standin.num_lists == 1  # the stand-in counts only the LIST it answered
        standin.fail_next(500, 503, 500)
        standin.delete_slice(NS, "engines-abc", broadcast=False)
        standin.compact()  # the watch ends with 410; the re-LISTs fail, then one succeeds
        assert await updates.next() == frozenset()

    run_k8s(standin, scenario, discovery=k8s_discovery(standin.url))


def test_k8s_idle_watch_resumes_without_relisting(standin):
    standin.put_slice(NS, one_pod())

    async def scenario(updates):
        assert await updates.next() == endpoints(A)
        await updates.quiet(0.8)  # longer than the read timeout: the watch resumes
        standin.put_slice(NS, two_pods())
        assert await updates.next() == endpoints(A, B)
        assert standin.num_lists == 1 and standin.num_watches >= 2

    run_k8s(standin, scenario, discovery=k8s_discovery(standin.url, read_timeout_s=0.3))


def test_k8s_cancellation_ends_the_watch_promptly(standin):
    standin.put_slice(NS, two_pods())

    async def body():
        discovery = make_discovery(k8s_config(), api_client=api_client_for(standin.url))
        seen = []

        async def consume():
            async for found in discovery.updates():
                seen.append(found)

        task = asyncio.create_task(consume())
        while not (seen and standin.open_watches):
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        # the thread was blocked reading an idle watch (read timeout 5 s): it must not wait it out
        deadline = time.monotonic() + 1.0
        while (discovery_threads() or standin.open_watches) and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        assert not discovery_threads() and standin.open_watches == 0

        # a consumer that just stops iterating closes the generator: the same prompt end
        async with contextlib.aclosing(discovery.updates()) as updates:
            async for found in updates:
                assert found == endpoints(A, B)
                break
        deadline = time.monotonic() + 1.0
        while (discovery_threads() or standin.open_watches) and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        assert not discovery_threads() and standin.open_watches == 0

    asyncio.run(body())


# ----------------------------------------------------------------------------- config, registry
def raises_for(field: str):
    return pytest.raises(ValueError, match=rf"^{field}: ")


@pytest.mark.parametrize("kwargs, field", [
    (dict(discovery="consul"), "discovery"),
    (dict(engines=""), "engines"),
    (dict(engines="a:1,nohost"), "engines"),
    (dict(engines="a:1", engine_port=0), "engine_port"),
    (dict(discovery="dns"), "dns_name"),
    (dict(discovery="dns", dns_name="x", dns_interval_s=0), "dns_interval_s"),
    (dict(discovery="kubernetes"), "k8s_service"),
    (dict(discovery="kubernetes", k8s_service="e", k8s_label_selector="app=e"), "k8s_service"),
    (dict(discovery="kubernetes", k8s_service="e", k8s_watch_timeout_s=0), "k8s_watch_timeout_s"),
])
def test_discovery_config_errors_name_the_field(kwargs, field):
    with raises_for(field):
        DiscoveryConfig(**kwargs)


def test_registry_covers_every_kind():
    from router.config import DISCOVERY_KINDS

    assert sorted(DISCOVERIES) == sorted(DISCOVERY_KINDS)


def test_k8s_without_any_cluster_config_is_a_config_error(tmp_path, monkeypatch):
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "missing"))
    with raises_for("discovery"):
        make_discovery(k8s_config())


def test_discovery_modules_do_not_import_each_other():
    """Both import router.endpoint; the registry imports the Kubernetes one only when asked."""
    code = ("import sys, router.discovery_k8s; assert 'router.discovery' not in sys.modules; "
            "import router.discovery; assert router.discovery.Endpoint is "
            "router.discovery_k8s.Endpoint")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
    code = "import sys, router.discovery; assert 'router.discovery_k8s' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
