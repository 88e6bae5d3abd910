"""The engines the router may place on: follows discovery, admits engines, answers "who holds
how much of this prompt".

Discovery yields the full set of endpoints whenever it changes; the pool starts an
``EngineClient`` for each new one and closes those that left (their index entries go with
them). Membership and health are separate: a listed engine takes requests only while its own
health says SERVING (see ``engine_client``).

The first engine admitted fixes the router's *model identity*: its block size, and (unless the
router was given a tokenizer) its tokenizer, fetched with ``GetTokenizer``. Every later engine
must match it, or it is refused with a log line naming each difference. The hash algorithm and
seed must always be the router's own (``quire.block_hash``): it cannot hash any other way.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

from quire.block_hash import BLOCK_HASH_ALGORITHM, ROOT_HASH
from quire.tokenizer_digest import tokenizer_digest
from quire.v1 import engine_pb2 as pb
from router.discovery import Discovery, Endpoint
from router.engine_client import (ClientOptions, EngineClient, EngineMismatchError,
                                  ModelExpectation, compare_model_info)
from router.prefix_index import ApproximateIndex, PrefixIndex
from router.tokenizer import RouterTokenizer

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ModelIdentity:
    """What every engine behind this router shares, fixed by the first one admitted."""

    tokenizer: RouterTokenizer
    expected: ModelExpectation
    model_name: str

    @property
    def block_size(self) -> int:
        return self.expected.block_size


class EnginePool:
    """Start with ``await start()``; ``await stop()``. Lives on the router's event loop."""

    def __init__(self, discovery: Discovery, *, tokenizer: RouterTokenizer | None = None,
                 options: ClientOptions = ClientOptions(),
                 approx_index_blocks: int = 65536) -> None:
        self.discovery = discovery
        self.given_tokenizer = tokenizer
        self.options = options
        self.index = PrefixIndex()
        self.approx = ApproximateIndex(approx_index_blocks)
        self.clients: dict[str, EngineClient] = {}
        self.identity: ModelIdentity | None = None
        self.identity_ready = asyncio.Event()
        self._identity_lock = asyncio.Lock()
        self._follower: asyncio.Task | None = None
        self.changed = asyncio.Event()  # set whenever membership or an engine's state changes

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        self._follower = asyncio.create_task(self._follow_discovery(), name="discovery")

    async def stop(self) -> None:
        if self._follower is not None:
            self._follower.cancel()
            await asyncio.gather(self._follower, return_exceptions=True)
        await asyncio.gather(*(c.close() for c in self.clients.values()),
                             return_exceptions=True)
        self.clients = {}

    async def _follow_discovery(self) -> None:
        try:
            async for endpoints in self.discovery.updates():
                await self.reconcile(endpoints)
        except asyncio.CancelledError:
            raise
        except Exception:  # noqa: BLE001 - a broken discovery must be loud, not silent
            logger.exception("engine discovery (%s) failed; the pool stays as it is",
                             self.discovery.name)

    async def reconcile(self, endpoints: frozenset[Endpoint]) -> None:
        """Make the pool's members exactly ``endpoints``."""
        wanted = {e.engine_id: e for e in endpoints}
        gone = [c for eid, c in self.clients.items()
                if eid not in wanted or wanted[eid].address != c.address]
        for client in gone:
            logger.info("engine %s at %s left the pool", client.engine_id, client.address)
            del self.clients[client.engine_id]
            self.approx.remove_engine(client.engine_id)
            await client.close()
        for engine_id, endpoint in sorted(wanted.items()):
            if engine_id not in self.clients:
                logger.info("engine %s at %s joined the pool", engine_id, endpoint.address)
                client = EngineClient(engine_id, endpoint.address, index=self.index,
                                      admit=self._admit, options=self.options,
                                      on_change=self._notify)
                self.clients[engine_id] = client
                client.start()
        self._notify()

    def _notify(self) -> None:
        self.changed.set()
        self.changed = asyncio.Event()

    # ------------------------------------------------------------------ admission
    async def _admit(self, client: EngineClient, info: pb.ModelInfo) -> None:
        router_hash = {"block_hash_algorithm": (BLOCK_HASH_ALGORITHM, info.block_hash_algorithm),
                       "block_hash_seed": (ROOT_HASH, info.block_hash_seed)}
        differences = {k: v for k, v in router_hash.items() if v[0] != v[1]}
        if differences:
            raise EngineMismatchError(client.engine_id, differences)
        async with self._identity_lock:
            if self.identity is None:
                self.identity = await self._establish(client, info)
                self.identity_ready.set()
        compare_model_info(client.engine_id, self.identity.expected, info)
        self._notify()

    async def _establish(self, client: EngineClient, info: pb.ModelInfo) -> ModelIdentity:
        tokenizer = self.given_tokenizer
        if tokenizer is None:
            answer = await client.stub.GetTokenizer(pb.GetTokenizerRequest(),
                                                    timeout=self.options.connect_timeout_s)
            files = dict(answer.files)
            if tokenizer_digest(files.get("tokenizer.json", b"")) != info.tokenizer_digest:
                raise EngineMismatchError(client.engine_id, {"tokenizer_digest": (
                    "digest of the tokenizer.json it sent", info.tokenizer_digest)})
            tokenizer = await asyncio.to_thread(RouterTokenizer.from_files, files)
            logger.info("tokenizer fetched from engine %s (%s)", client.engine_id,
                        info.tokenizer_digest[:12])
        expected = ModelExpectation(block_size=info.block_size,
                                    block_hash_algorithm=BLOCK_HASH_ALGORITHM,
                                    block_hash_seed=ROOT_HASH,
                                    tokenizer_digest=tokenizer.digest)
        logger.info("model identity fixed by engine %s: %s, block size %d", client.engine_id,
                    info.model_name, info.block_size)
        return ModelIdentity(tokenizer=tokenizer, expected=expected, model_name=info.model_name)

    # -------------------------------------------------------------------- queries
    def serving(self) -> list[EngineClient]:
        return [c for c in self.clients.values() if c.healthy]

    def refused(self) -> dict[str, EngineMismatchError]:
        return {eid: c.refusal for eid, c in self.clients.items() if c.refusal is not None}

    def match(self, block_hashes: Sequence[int]) -> dict[str, int]:
        """Leading blocks of the prompt cached on each engine: from the engine's KV feed where
        it is alive, else from the router's own routing history (approximate)."""
        precise = self.index.match(block_hashes)
        blind = [c.engine_id for c in self.clients.values() if not c.kv_feed_alive]
        if blind:
            approx = self.approx.match(block_hashes)
            for engine_id in blind:
                if engine_id in approx:
                    precise[engine_id] = approx[engine_id]
        return precise

    def record(self, engine_id: str, block_hashes: Sequence[int]) -> None:
        """Remember a placement, for the approximate index."""
        self.approx.record(engine_id, block_hashes)

    async def wait_serving(self, count: int = 1, timeout_s: float | None = None) -> bool:
        """Wait until at least ``count`` engines serve (False on timeout)."""
        async def wait() -> None:
            while len(self.serving()) < count:
                await self.changed.wait()
        try:
            await asyncio.wait_for(wait(), timeout_s)
            return True
        except asyncio.TimeoutError:
            return False

    async def changes(self) -> AsyncIterator[None]:
        """Yields at once, then after every change of membership or of an engine's state."""
        while True:
            changed = self.changed
            yield
            await changed.wait()
