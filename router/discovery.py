"""How the router finds its engines: a static list, DNS records, or Kubernetes EndpointSlices.

Every discovery yields the *full* set of usable endpoints, first as soon as it knows one, then
each time that set changes; the engine pool diffs consecutive sets itself. A discovery never
yields the same set twice in a row, and keeps its last set through transient failures: a DNS
blip or an unreachable API server must not empty the pool while the engines still serve.

- ``StaticDiscovery``: the configured ``host:port`` list, once.
- ``DnsDiscovery``: A/AAAA records of a name (typically the engines' headless Service),
  re-resolved every ``interval_s``. NXDOMAIN (and "no address for this name") is an answer,
  the empty set: a headless Service with no ready pod has no records (a misspelt name looks
  the same, so an empty set is logged as a warning). Any other failure (timeout, SERVFAIL, no
  resolver) keeps the last set; until the first answer (NXDOMAIN included) nothing is yielded.
- ``KubernetesDiscovery``: LIST then WATCH ``discovery.k8s.io/v1`` EndpointSlices with the
  official (synchronous) client in one daemon thread, re-LISTing when a watch expires or the
  server answers 410 Gone. An endpoint is usable when ``conditions.ready`` is not False and
  ``conditions.terminating`` is not True (the API: nil ready means ready, nil terminating
  means not terminating). ``serving`` is ignored on purpose: it stays true while a pod drains,
  and a draining engine must get no new requests (its open streams are the pool's business).
  Services with ``publishNotReadyAddresses`` report every pod ready; that is the Service
  owner's choice and we follow it.

The ``kubernetes`` package is imported only by ``KubernetesDiscovery``: it is slow to import,
and static or DNS routers do not need it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from typing import Any

from router.config import DiscoveryConfig
from router.endpoint import Discovery, Endpoint, join_host_port, parse_engine

__all__ = ["DISCOVERIES", "Discovery", "DnsDiscovery", "Endpoint", "StaticDiscovery",
           "join_host_port", "make_discovery"]

logger = logging.getLogger(__name__)

Resolver = Callable[[str, int], Awaitable[list[str]]]

# getaddrinfo's "this name does not exist" / "this name has no address": real answers.
_EMPTY_ANSWER_ERRNOS = frozenset(
    e for e in (socket.EAI_NONAME, getattr(socket, "EAI_NODATA", None)) if e is not None)


class StaticDiscovery:
    name = "static"

    def __init__(self, addresses: Iterable[str]) -> None:
        # "host:port" (a Quire engine) or "vllm://host:port?kv_events=...&kv_replay=..."
        self._endpoints = frozenset(parse_engine(a) for a in addresses)

    @classmethod
    def from_config(cls, cfg: DiscoveryConfig, **_: Any) -> StaticDiscovery:
        return cls(cfg.static_addresses())

    async def updates(self) -> AsyncIterator[frozenset[Endpoint]]:
        yield self._endpoints
        await asyncio.Event().wait()  # nothing ever changes; wait for cancellation


async def _getaddrinfo_resolver(name: str, port: int) -> list[str]:
    infos = await asyncio.get_running_loop().getaddrinfo(name, port, type=socket.SOCK_STREAM)
    return [info[4][0] for info in infos]


class DnsDiscovery:
    name = "dns"

    def __init__(self, dns_name: str, port: int, interval_s: float, *,
                 resolver: Resolver | None = None) -> None:
        self._dns_name = dns_name
        self._port = port
        self._interval_s = interval_s
        self._resolver = resolver or _getaddrinfo_resolver

    @classmethod
    def from_config(cls, cfg: DiscoveryConfig, *, resolver: Resolver | None = None,
                    **_: Any) -> DnsDiscovery:
        assert cfg.dns_name  # DiscoveryConfig checks it for dns discovery
        return cls(cfg.dns_name, cfg.engine_port, cfg.dns_interval_s, resolver=resolver)

    async def _resolve(self) -> frozenset[Endpoint] | None:
        """The endpoints the name has now; None when the resolver could not tell."""
        try:
            ips = await self._resolver(self._dns_name, self._port)
        except OSError as e:  # socket.gaierror among them
            if isinstance(e, socket.gaierror) and e.errno in _EMPTY_ANSWER_ERRNOS:
                return frozenset()
            logger.warning("dns discovery: cannot resolve %s (%s); keeping the last set",
                           self._dns_name, e)
            return None
        addresses = {join_host_port(ip, self._port) for ip in ips}
        return frozenset(Endpoint(a, a) for a in addresses)

    async def updates(self) -> AsyncIterator[frozenset[Endpoint]]:
        last: frozenset[Endpoint] | None = None
        while True:
            endpoints = await self._resolve()
            if endpoints is not None and endpoints != last:
                if not endpoints:
                    logger.warning("dns discovery: %s has no addresses", self._dns_name)
                last = endpoints
                yield endpoints
            await asyncio.sleep(self._interval_s)


def _kubernetes(cfg: DiscoveryConfig, **deps: Any) -> Discovery:
    from router.discovery_k8s import KubernetesDiscovery  # imports the slow kubernetes package

    return KubernetesDiscovery.from_config(cfg, **deps)


DISCOVERIES: dict[str, Callable[..., Discovery]] = {
    "static": StaticDiscovery.from_config,
    "dns": DnsDiscovery.from_config,
    "kubernetes": _kubernetes,
}


class EngineKindDiscovery:
    """Another discovery's endpoints as engines of one kind: DNS and Kubernetes find
    addresses; this says they are vLLM servers and where each publishes its KV events (the
    same ports on every pod)."""

    def __init__(self, inner: Discovery, kind: str, kv_events_port: int | None = None,
                 kv_replay_port: int | None = None) -> None:
        self.inner = inner
        self.name = inner.name
        self.kind = kind
        self.kv_events_port = kv_events_port
        self.kv_replay_port = kv_replay_port

    def _endpoint(self, endpoint: Endpoint) -> Endpoint:
        host = endpoint.address.rpartition(":")[0]
        tcp = lambda port: None if port is None else f"tcp://{host}:{port}"  # noqa: E731
        return Endpoint(endpoint.engine_id, endpoint.address, self.kind,
                        tcp(self.kv_events_port), tcp(self.kv_replay_port))

    async def updates(self) -> AsyncIterator[frozenset[Endpoint]]:
        async with contextlib.aclosing(self.inner.updates()) as updates:
            async for endpoints in updates:
                yield frozenset(self._endpoint(e) for e in endpoints)


def make_discovery(cfg: DiscoveryConfig, *, resolver: Resolver | None = None,
                   api_client: Any = None) -> Discovery:
    """The discovery ``cfg.discovery`` names. ``resolver`` (DNS) and ``api_client`` (Kubernetes)
    replace the system resolver and the in-cluster / kubeconfig client, for tests."""
    discovery = DISCOVERIES[cfg.discovery](cfg, resolver=resolver, api_client=api_client)
    if cfg.discovery != "static" and cfg.engine_kind != "quire":
        discovery = EngineKindDiscovery(discovery, cfg.engine_kind, cfg.vllm_kv_events_port,
                                        cfg.vllm_kv_replay_port)
    return discovery
