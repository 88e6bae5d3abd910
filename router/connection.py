"""The router's connection to one engine, whatever kind of engine it is: the protocol every
engine kind implements (``EngineConnection``), what a connection reports to its pool
(``EngineReports``), and the types both sides of that seam share.

The pool, the balancer and both fronts speak only this protocol; each kind's module owns
everything that is particular to it (its transport, its health and load feeds, its KV events,
its admission rules):

- ``router.engine_client``: a Quire engine (``quire.v1`` gRPC);
- ``router.vllm_client``: a vLLM server (its OpenAI HTTP API, its ZMQ KV events).

A third kind (SGLang's server, say) is one new module with a class implementing
``EngineConnection`` plus one entry in ``router.engine_kinds.ENGINE_KINDS``; nothing in the pool,
the servicer or discovery changes.

Lifecycle of every connection, as its pool sees it::

    UNREACHABLE --info fetched, admitted--> (health watch) SERVING <--> NOT_SERVING
         ^                 |                                     |
         |                 +--refused--> REFUSED (re-checked every refused_recheck_s)
         +-------------- health feed broke (engine gone, restarting) ---+
"""

from __future__ import annotations

import enum
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, Protocol, runtime_checkable

import grpc

from quire.kv_events import KVCacheSnapshot, KVEventBatch
from quire.v1 import engine_pb2 as pb

if TYPE_CHECKING:
    from router.endpoint import Endpoint
    from quire.tokenizer import FastTokenizer


class EngineState(enum.Enum):
    UNREACHABLE = "unreachable"
    REFUSED = "refused"
    NOT_SERVING = "not_serving"
    SERVING = "serving"


class EngineMismatchError(RuntimeError):
    """The engine hashes, tokenizes or serves differently from the router; it is refused."""

    def __init__(self, engine_id: str, differences: dict[str, tuple[object, object]]) -> None:
        self.engine_id = engine_id
        self.differences = differences  # field -> (router expects, engine reports)
        detail = ", ".join(f"{name}: router expects {want!r}, engine reports {got!r}"
                           for name, (want, got) in differences.items())
        super().__init__(f"engine {engine_id} refused: {detail}")


@dataclass(frozen=True, slots=True)
class ModelExpectation:
    """What the router hashes with; an engine must report exactly these in its model info."""

    block_size: int
    block_hash_algorithm: str
    block_hash_seed: int
    tokenizer_digest: str
    # how the weights are held (ModelInfo.quantization: "gguf", "awq", "gptq", "dequantize",
    # "none"; "" from engines that do not say): 4-bit and 16-bit engines compute different K/V
    # for one prefix, so they never share a prefix domain
    quantization: str = ""

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")


@dataclass(frozen=True, slots=True)
class ModelIdentity:
    """What every engine behind this router shares, fixed by the first one admitted."""

    tokenizer: FastTokenizer
    expected: ModelExpectation
    model_name: str

    @property
    def block_size(self) -> int:
        return self.expected.block_size


@dataclass(frozen=True, slots=True)
class ClientOptions:
    """How the router connects to engines (every kind reads the fields it needs)."""

    load_interval_ms: int = 100
    connect_timeout_s: float = 10.0
    min_backoff_s: float = 0.1
    max_backoff_s: float = 5.0
    refused_recheck_s: float = 30.0
    prefill_tokens_per_s: float = 2000.0  # assumed prefill rate, for placement estimates
    lora_load_s: float = 0.05  # the least a LoRA adapter read is priced at, for placement
    max_message_bytes: int = 64 << 20  # GetTokenizer answers can be tens of MB
    credentials: grpc.ChannelCredentials | None = None  # None: plaintext
    server_name: str | None = None  # TLS: name to check in the engine's certificate
    # The KV block size of engines whose API does not report one (vLLM's default is 16, its
    # CPU build's 128); a kind that reports its block size ignores it.
    assumed_block_size: int = 16


@runtime_checkable
class EngineConnection(Protocol):
    """The router's connection to one engine. The pool ``start()``s it when discovery lists the
    engine and ``await close()``s it when the engine leaves; in between the connection
    supervises the engine on its own and tells the pool what it learns (``EngineReports``)."""

    kind: ClassVar[str]  # the engine kind's name, its key in router.engine_kinds.ENGINE_KINDS
    serves_embeddings: bool  # whether ``embed`` works (a vLLM server: if it has /v1/embeddings)
    engine_id: str  # stable id (discovery's)
    address: str  # "host:port"
    state: EngineState
    info: pb.ModelInfo | None  # the engine's model info, once admitted
    refusal: EngineMismatchError | None  # why it is refused (None: it is not)

    @property
    def healthy(self) -> bool:
        """True while the engine takes requests (SERVING, and not closed)."""
        ...

    def start(self) -> None:
        """Start supervising the engine (on the running event loop)."""
        ...

    async def close(self) -> None:
        """Stop supervising and release the transport; the pool forgets the engine's state."""
        ...

    def generate(self, request: pb.GenerateRequest, *, timeout_s: float | None = None,
                 metadata: tuple[tuple[str, str], ...] = ()
                 ) -> AsyncIterator[pb.GenerateResponse]:
        """The engine's stream for ``request`` (token ids) as ``quire.v1`` messages. Closing
        the iterator aborts the request on the engine. Upstream failures raise
        ``grpc.aio.AioRpcError`` with the code a Quire engine would give (UNAVAILABLE before
        the first message is retried on another engine)."""
        ...

    async def embed(self, request: pb.EmbedRequest, *, timeout_s: float | None = None,
                    metadata: tuple[tuple[str, str], ...] = ()) -> pb.EmbedResponse:
        """The engine's pooled vector for ``request`` (token ids); failures raise
        ``grpc.aio.AioRpcError`` as ``generate``'s do."""
        ...

    async def fetch_tokenizer(self, timeout_s: float | None = None) -> pb.TokenizerFiles | None:
        """The engine's tokenizer files; None when this kind serves none (the router then
        needs its own ``--tokenizer``)."""
        ...

    def check_identity(self, identity: ModelIdentity, info: pb.ModelInfo) -> None:
        """This kind's admission rules: raise ``EngineMismatchError`` naming every difference
        between the engine's ``info`` and the pool's ``identity``. (The block-hash algorithm
        and seed are checked by the pool for every kind.)"""
        ...


@runtime_checkable
class LoRACapable(Protocol):
    """What an engine kind that loads LoRA adapters at run time adds to its connection (the
    router's /v1/load_lora_adapter reaches only such engines)."""

    async def load_lora_adapter(self, lora_name: str, lora_path: str,
                                timeout_s: float | None = None) -> bool:
        """Load a LoRA adapter on the engine (a path on the engine); False when it held that
        one already. ``info.lora_adapters`` lists it afterwards. Failures raise
        ``grpc.aio.AioRpcError`` with the engine's code (INVALID_ARGUMENT for a bad one)."""
        ...

    async def unload_lora_adapter(self, lora_name: str, timeout_s: float | None = None) -> None:
        """Unload a LoRA adapter (NOT_FOUND when the engine holds none by that name)."""
        ...


class EngineReports(Protocol):
    """What a connection tells its pool; the pool applies it to the routing state it owns.
    Every call names the reporting connection, so a pool can ignore one it has replaced."""

    async def admit(self, client: EngineConnection, info: pb.ModelInfo) -> None:
        """Called on every (re)connect; raises ``EngineMismatchError`` to refuse the engine."""
        ...

    def state_changed(self, client: EngineConnection) -> None: ...

    def kv_snapshot(self, client: EngineConnection, snapshot: KVCacheSnapshot) -> bool:
        """Start the engine's index entry from ``snapshot``; False when it comes from another
        engine process than the one admitted (the connection then re-subscribes)."""
        ...

    def kv_batch(self, client: EngineConnection, batch: KVEventBatch) -> bool:
        """Apply the next batch; False on a gap (the connection then re-subscribes)."""
        ...

    def kv_feed_lost(self, client: EngineConnection) -> None: ...

    def load_report(self, client: EngineConnection, report: pb.LoadReport | None) -> None:
        """The engine's latest load; None while the load feed is down."""
        ...


# endpoint, the pool it reports to, the connection options -> a connection (not started)
ConnectionFactory = Callable[["Endpoint", EngineReports, ClientOptions], EngineConnection]


def change_state(client: EngineConnection, reports: EngineReports, state: EngineState,
                 what: str, log: logging.Logger) -> None:
    """Move ``client`` to ``state``, log it (on its kind's logger), report it to its pool."""
    if state is not client.state:
        reason = f": {client.refusal}" if state is EngineState.REFUSED and client.refusal else ""
        log.log(logging.INFO if state is EngineState.SERVING else logging.WARNING,
                "%s %s at %s: %s -> %s%s", what, client.engine_id, client.address,
                client.state.value, state.value, reason)
        client.state = state
        reports.state_changed(client)


def refuse(client: EngineConnection, reports: EngineReports, error: EngineMismatchError,
           what: str, log: logging.Logger) -> None:
    """Refuse ``client`` for ``error``. The reason is logged once per change (with the state
    change, or when a re-check finds another reason), never on every re-check."""
    if client.state is EngineState.REFUSED and client.refusal is not None and \
            str(client.refusal) != str(error):
        log.warning("%s %s at %s: still refused, now: %s", what, client.engine_id,
                    client.address, error)
    client.refusal = error
    change_state(client, reports, EngineState.REFUSED, what, log)
