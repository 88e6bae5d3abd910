"""What discovery yields: ``Endpoint`` (an engine's stable id and address) and the ``Discovery``
protocol every discovery kind implements (``router.discovery``, ``router.discovery_k8s``).
Both discovery modules import this one and never each other at import time."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Protocol

from router.engine_kinds import ENGINE_KINDS as _FACTORIES  # imports no kind module


@dataclass(frozen=True, slots=True, order=True)
class Endpoint:
    engine_id: str  # stable id: with Kubernetes the targetRef (pod) name, else the address
    address: str  # "host:port" ("[v6addr]:port" for IPv6)
    kind: str = "quire"  # a key of router.engine_kinds.ENGINE_KINDS ("quire", "vllm")
    kv_events: str | None = None  # vllm: its KV-event ZMQ PUB endpoint (None: events off)
    kv_replay: str | None = None  # vllm: its replay (ROUTER) endpoint


ENGINE_KIND_NAMES = tuple(_FACTORIES)  # router.engine_kinds.ENGINE_KINDS, by name


def parse_engine(spec: str) -> Endpoint:
    """One static engine: ``host:port`` (a Quire engine) or
    ``vllm://host:port?kv_events=tcp://host:5557&kv_replay=tcp://host:5558``."""
    from urllib.parse import parse_qs, urlsplit

    spec = spec.strip()
    if "://" not in spec:
        return Endpoint(spec, spec)
    url = urlsplit(spec)
    if url.scheme not in ENGINE_KIND_NAMES:
        raise ValueError(f"engines: {spec!r}: the kind must be one of {ENGINE_KIND_NAMES}")
    query = {k: v[-1] for k, v in parse_qs(url.query).items()}
    unknown = set(query) - {"kv_events", "kv_replay"}
    if unknown:
        raise ValueError(f"engines: {spec!r}: unknown option(s) {sorted(unknown)} (known: "
                         "kv_events, kv_replay)")
    if not url.netloc:
        raise ValueError(f"engines: {spec!r} names no host:port")
    return Endpoint(url.netloc, url.netloc, url.scheme, query.get("kv_events"),
                    query.get("kv_replay"))


class Discovery(Protocol):
    name: str

    def updates(self) -> AsyncIterator[frozenset[Endpoint]]:
        """The full set of usable endpoints, first at once, then each time it changes (never
        the same set twice in a row). Runs until the consumer stops iterating (close it with
        ``contextlib.aclosing``) or the task is cancelled."""
        ...


def join_host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
