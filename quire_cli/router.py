"""``quire router``: serve the router (gRPC + OpenAI HTTP) in front of engines.

Only the router and the shared contract are imported: a router-only install (no torch, the
router image) runs this command."""

from __future__ import annotations

import argparse


def _config_groups() -> tuple[tuple[type, str], ...]:
    """The router's config classes, with their titles on ``quire router --help``."""
    from router.config import DiscoveryConfig, EngineTLSConfig, PlacementConfig, RouterServerConfig
    from router.flow_config import FlowConfig

    return ((RouterServerConfig, "router"), (DiscoveryConfig, "discovery"),
            (PlacementConfig, "placement"), (EngineTLSConfig, "engine TLS"),
            (FlowConfig, "flow control"))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from quire.config_args import add_dataclass_args
    from router.config import HELP
    from router.flow_config import FLOW_HELP

    for cls, title in _config_groups():
        add_dataclass_args(parser, cls, title, HELP | FLOW_HELP)


def main(ns: argparse.Namespace) -> int:
    import asyncio

    from quire.config_args import dataclass_from_namespace
    from quire.ports import check_ports_free
    from router.app import serve

    configs = [dataclass_from_namespace(cls, ns) for cls, _ in _config_groups()]
    server = configs[0]
    check_ports_free([(server.host, server.port, "port"),
                      (server.host, server.http_port, "http_port")])
    asyncio.run(serve(*configs))
    return 0
