"""The engine kinds the router can place on, by name: each a ``ConnectionFactory``
(``router.connection``). Discovery tags every endpoint with its kind (``Endpoint.kind``, a
static ``vllm://`` URL or ``engine_kind``); the pool looks the factory up here. A new kind is
one module implementing ``EngineConnection`` and one entry below.

Each kind's module is imported when its first engine joins: a router of Quire engines never
imports the vLLM client, and this module stays cheap for config checking.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from router.connection import (ClientOptions, ConnectionFactory, EngineConnection,
                                   EngineReports)
    from router.endpoint import Endpoint


def _quire(endpoint: Endpoint, reports: EngineReports,
           options: ClientOptions) -> EngineConnection:
    from router.engine_client import EngineClient

    return EngineClient.connect(endpoint, reports, options)


def _vllm(endpoint: Endpoint, reports: EngineReports,
          options: ClientOptions) -> EngineConnection:
    from router.vllm_client import VllmEngineClient

    return VllmEngineClient.connect(endpoint, reports, options)


ENGINE_KINDS: dict[str, ConnectionFactory] = {
    "quire": _quire,  # a Quire engine: quire.v1 gRPC
    "vllm": _vllm,  # vLLM's OpenAI HTTP server, its KV events over ZMQ
}
