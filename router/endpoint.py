"""What discovery yields: ``Endpoint`` (an engine's stable id and address) and the ``Discovery``
protocol every discovery kind implements (``router.discovery``, ``router.discovery_k8s``).
Both discovery modules import this one and never each other at import time."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True, slots=True, order=True)
class Endpoint:
    engine_id: str  # stable id: with Kubernetes the targetRef (pod) name, else the address
    address: str  # "host:port" ("[v6addr]:port" for IPv6)


class Discovery(Protocol):
    name: str

    def updates(self) -> AsyncIterator[frozenset[Endpoint]]:
        """The full set of usable endpoints, first at once, then each time it changes (never
        the same set twice in a row). Runs until the consumer stops iterating (close it with
        ``contextlib.aclosing``) or the task is cancelled."""
        ...


def join_host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
