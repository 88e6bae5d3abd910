"""The engines the router may place on, and the one owner of the routing state: follows
discovery, admits engines, keeps the exact (KV-event) and approximate (routing history) prefix
indexes, the engines' load and the router's in-flight work, and answers the balancer with
``candidates``: one ``EndpointSnapshot`` per engine.

Discovery yields the full set of endpoints whenever it changes; the pool starts a connection
of the endpoint's kind (``router.engine_kinds``) for each new one and closes those that left
(their routing state goes with them). The pool speaks only ``EngineConnection``
(``router.connection``), whatever the kind. Connections only *report* (``EngineReports``: KV
events, load, state); the pool applies the reports, so nothing else writes the indexes.
Membership and health are separate: a listed engine takes requests only while its own health
says SERVING.

The first engine admitted fixes the router's *model identity*: its block size, and (unless the
router was given a tokenizer) its tokenizer, fetched from it. Every later engine must match it
by its kind's rules (``EngineConnection.check_identity``), or it is refused with a log line
naming each difference. The hash algorithm and seed must always be the router's own
(``quire.block_hash``): it cannot hash any other way.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import AsyncIterator, Collection, Mapping, Sequence
from dataclasses import dataclass, field

from quire.block_hash import BLOCK_HASH_ALGORITHM, ROOT_HASH
from quire.kv_events import KVCacheSnapshot, KVEventBatch
from quire.tokenizer_digest import tokenizer_digest
from quire.v1 import engine_pb2 as pb
from router.balancer import AdapterState, EndpointSnapshot
from router.connection import (ClientOptions, ConnectionFactory, EngineConnection, LoRACapable,
                               EngineMismatchError, EngineState, ModelExpectation, ModelIdentity)
from router.endpoint import Discovery, Endpoint
from router.engine_adapters import EngineAdapters
from router.engine_kinds import ENGINE_KINDS
from router.engine_rates import EngineRates, prefill_rate
from router.prefix_index import ApproximateIndex, PrefixIndex
from quire.tokenizer import FastTokenizer

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class PromptHashes:
    """A prompt's full-block hashes at every block size the pool's engines use: engines of
    different kinds (a Quire engine's 16-token blocks, a vLLM CPU engine's 128) are matched
    each at its own block size."""

    by_block_size: Mapping[int, tuple[int, ...]]

    def at(self, block_size: int) -> tuple[int, ...]:
        return self.by_block_size.get(block_size, ())


@dataclass(slots=True)
class _Member:
    """One engine's routing state; only the pool writes it."""

    client: EngineConnection
    rates: EngineRates  # measured from the requests relayed to it
    load: pb.LoadReport | None = None  # None: the load feed is down (load unknown)
    kv_feed_alive: bool = False  # False: place it by the approximate index
    # The engine process last admitted at this address (None: never admitted; "": its kind
    # reports none, so every re-admission after a lost connection counts as a restart).
    incarnation_id: str | None = None
    adapters: EngineAdapters = field(default_factory=EngineAdapters)  # its LoRA adapters
    # this router's sequences there now (Generate's n each, Embed's one; sent, not ended)
    requests: int = 0


class EnginePool:
    """Start with ``await start()``; ``await stop()``. Lives on the router's event loop."""

    def __init__(self, discovery: Discovery, *, tokenizer: FastTokenizer | None = None,
                 options: ClientOptions = ClientOptions(),
                 approx_index_blocks: int = 65536,
                 kinds: Mapping[str, ConnectionFactory] = ENGINE_KINDS) -> None:
        """``kinds``: the engine kinds the pool can connect to, by ``Endpoint.kind``."""
        self.discovery = discovery
        self.kinds = kinds
        self.given_tokenizer = tokenizer
        self.options = options
        self._exact = PrefixIndex()
        self._approx = ApproximateIndex(approx_index_blocks)
        self._members: dict[str, _Member] = {}
        self.identity: ModelIdentity | None = None
        # the length limit of the engine admitted last (None: none yet); the router's own
        # answers (/tokenize, /v1/models) fall back on it while no engine serves
        self.last_max_model_len: int | None = None
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
        members, self._members = self._members, {}
        for engine_id in members:
            self._forget(engine_id)
        await asyncio.gather(*(m.client.close() for m in members.values()),
                             return_exceptions=True)

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
        gone = [m.client for eid, m in self._members.items()
                if eid not in wanted or wanted[eid].address != m.client.address]
        for client in gone:
            logger.info("engine %s at %s left the pool", client.engine_id, client.address)
            del self._members[client.engine_id]
            self._forget(client.engine_id)
            await client.close()
        for engine_id, endpoint in sorted(wanted.items()):
            if engine_id not in self._members:
                logger.info("engine %s at %s joined the pool", engine_id, endpoint.address)
                client = self.kinds[endpoint.kind](endpoint, self, self.options)
                self._members[engine_id] = _Member(
                    client, EngineRates.with_prior(self.options.prefill_tokens_per_s))
                client.start()
        self._notify()

    def _forget(self, engine_id: str) -> None:
        self._exact.remove_engine(engine_id)
        self._approx.remove_engine(engine_id)

    def _notify(self) -> None:
        self.changed.set()
        self.changed = asyncio.Event()

    # ------------------------------------------------------- reports (EngineReports)
    def _member(self, client: EngineConnection) -> _Member | None:
        """The client's member entry; None for a client the pool has already replaced."""
        member = self._members.get(client.engine_id)
        return member if member is not None and member.client is client else None

    def state_changed(self, client: EngineConnection) -> None:
        if self._member(client) is not None:
            self._notify()

    def kv_snapshot(self, client: EngineConnection, snapshot: KVCacheSnapshot) -> bool:
        """Start the engine's entry from ``snapshot``; False (ignored) when it comes from
        another engine process than the one admitted (restarted in between: the connection
        re-admits it and re-subscribes)."""
        if (member := self._member(client)) is None:
            return False
        if snapshot.incarnation_id and member.incarnation_id and \
                snapshot.incarnation_id != member.incarnation_id:
            logger.warning("engine %s: KV snapshot from incarnation %s, admitted %s; ignored",
                           client.engine_id, snapshot.incarnation_id[:8],
                           member.incarnation_id[:8])
            return False
        self._exact.reset_from_snapshot(client.engine_id, snapshot)
        member.kv_feed_alive = True
        return True

    def kv_batch(self, client: EngineConnection, batch: KVEventBatch) -> bool:
        if (member := self._member(client)) is None:
            return False
        member.adapters.stored(getattr(e, "lora_name", None) for e in batch.events)
        return self._exact.apply(client.engine_id, batch)

    def kv_feed_lost(self, client: EngineConnection) -> None:
        if (member := self._member(client)) is not None:
            member.kv_feed_alive = False
            self._exact.remove_engine(client.engine_id)

    def load_report(self, client: EngineConnection, report: pb.LoadReport | None) -> None:
        if (member := self._member(client)) is not None:
            member.load = report

    # ------------------------------------------------------------------ admission
    async def admit(self, client: EngineConnection, info: pb.ModelInfo) -> None:
        """Refuse (``EngineMismatchError``) an engine that hashes or tokenizes differently;
        the first engine admitted fixes the model identity."""
        router_hash = {"block_hash_algorithm": (BLOCK_HASH_ALGORITHM, info.block_hash_algorithm),
                       "block_hash_seed": (ROOT_HASH, info.block_hash_seed)}
        differences = {k: v for k, v in router_hash.items() if v[0] != v[1]}
        if differences:
            raise EngineMismatchError(client.engine_id, differences)
        async with self._identity_lock:
            if self.identity is None:
                self.identity = await self._establish(client, info)
        client.check_identity(self.identity, info)
        self.last_max_model_len = info.max_model_len
        if (member := self._member(client)) is not None:
            self._new_incarnation(member, info.incarnation_id)
        self._notify()

    def _new_incarnation(self, member: _Member, incarnation_id: str) -> None:
        """A restarted engine's cache is empty: drop every block the router believes it holds
        (precise, approximate and speculative), so no request is placed on a dead process's
        blocks. The same process re-admitted after a network blip keeps its entry."""
        previous, member.incarnation_id = member.incarnation_id, incarnation_id
        if previous is None or (incarnation_id and incarnation_id == previous):
            return
        client = member.client
        logger.warning("engine %s at %s restarted (incarnation %s -> %s): its index entry "
                       "starts empty", client.engine_id, client.address, previous[:8] or "?",
                       incarnation_id[:8] or "?")
        self._forget(client.engine_id)
        member.kv_feed_alive = False

    async def _establish(self, client: EngineConnection, info: pb.ModelInfo) -> ModelIdentity:
        tokenizer = self.given_tokenizer
        if tokenizer is None:
            answer = await client.fetch_tokenizer(timeout_s=self.options.connect_timeout_s)
            if answer is None:
                raise EngineMismatchError(client.engine_id, {"tokenizer": (
                    f"the router's --tokenizer (a {client.kind} engine serves no tokenizer "
                    "files)", None)})
            files = dict(answer.files)
            if tokenizer_digest(files.get("tokenizer.json", b"")) != info.tokenizer_digest:
                raise EngineMismatchError(client.engine_id, {"tokenizer_digest": (
                    "digest of the tokenizer.json it sent", info.tokenizer_digest)})
            tokenizer = await asyncio.to_thread(FastTokenizer.from_files, files)
            logger.info("tokenizer fetched from engine %s (%s)", client.engine_id,
                        info.tokenizer_digest[:12])
        expected = ModelExpectation(block_size=info.block_size,
                                    block_hash_algorithm=BLOCK_HASH_ALGORITHM,
                                    block_hash_seed=ROOT_HASH,
                                    tokenizer_digest=tokenizer.digest,
                                    quantization=info.quantization)
        logger.info("model identity fixed by engine %s: %s, block size %d", client.engine_id,
                    info.model_name, info.block_size)
        return ModelIdentity(tokenizer=tokenizer, expected=expected, model_name=info.model_name)

    # -------------------------------------------------------------------- queries
    @property
    def clients(self) -> Mapping[str, EngineConnection]:
        """The members' connections, by engine id (read only)."""
        return {engine_id: m.client for engine_id, m in self._members.items()}

    def serving(self) -> list[EngineConnection]:
        return [m.client for m in self._members.values() if m.client.healthy]

    def serving_loads(self) -> list[pb.LoadReport]:
        """The latest load report of every serving engine whose load feed is up."""
        return [m.load for m in self._members.values()
                if m.client.healthy and m.load is not None]

    def holding_adapter(self, lora_name: str) -> set[str]:
        """Serving engines whose LoRA adapters include ``lora_name``."""
        return {c.engine_id for c in self.serving()
                if c.info is not None and lora_name in c.info.lora_adapters}

    def lora_capable(self) -> set[str]:
        """Serving engines that load LoRA adapters at run time: LoRA on (in their model info,
        or, for vLLM servers, whose /v1/models says nothing of it until an adapter is
        loaded, step slots in their load reports)."""
        return {eid for eid, m in self._members.items()
                if m.client.healthy and isinstance(m.client, LoRACapable)
                and ((m.client.info is not None and m.client.info.enable_lora)
                     or (m.load is not None and m.load.max_loras > 0))}

    def adapters(self) -> dict[str, str]:
        """Every LoRA adapter the serving engines hold: name -> its path (as the first
        engine listing it reports it; empty for engines that report none)."""
        found: dict[str, str] = {}
        for client in self.serving():
            info = client.info
            if info is None:
                continue
            paths = list(info.lora_adapter_paths) + [""] * len(info.lora_adapters)
            for name, path in zip(info.lora_adapters, paths):
                found.setdefault(name, path)
        return found

    def refused(self) -> dict[str, EngineMismatchError]:
        return {eid: m.client.refusal for eid, m in self._members.items()
                if m.client.refusal is not None}

    def engine_states(self) -> dict[str, int]:
        """How many members are in each ``EngineState`` (every state named, zeros included)."""
        states = Counter(m.client.state for m in self._members.values())
        return {s.value: states.get(s, 0) for s in (EngineState.SERVING, EngineState.NOT_SERVING,
                                                    EngineState.UNREACHABLE, EngineState.REFUSED)}

    def cached_blocks(self) -> dict[str, frozenset[int]]:
        """Each engine's cached block hashes as its KV feed reports them (engines whose feed is
        down or stale are absent)."""
        return {engine_id: self._exact.block_hashes(engine_id)
                for engine_id in self._exact.engine_ids()}

    def unconfirmed_blocks(self) -> dict[str, frozenset[int]]:
        """Each engine's blocks claimed by placements that its KV feed has not confirmed yet
        (engines with none are absent)."""
        return {engine_id: blocks for engine_id in self._members
                if (blocks := self._exact.unconfirmed(engine_id))}

    def block_sizes(self) -> frozenset[int]:
        """The block sizes of the admitted engines (the identity's first)."""
        sizes = {m.client.info.block_size for m in self._members.values()
                 if m.client.info is not None and m.client.info.block_size}
        if self.identity is not None:
            sizes.add(self.identity.block_size)
        return frozenset(sizes)

    def candidates(self, block_hashes: PromptHashes | Sequence[int],
                   exclude: Collection[str] = (), lora_name: str | None = None
                   ) -> list[EndpointSnapshot]:
        """Every member not in ``exclude`` as the balancer sees it now, with the leading blocks
        of the prompt it holds (at its own block size; a plain sequence of hashes is taken as
        every engine's): from the engine's KV feed where it is alive, else from the router's
        own routing history (approximate); and, for a request under the LoRA adapter
        ``lora_name``, how that adapter stands there."""
        members = {eid: m for eid, m in self._members.items() if eid not in exclude}
        by_size: dict[int, list[str]] = {}
        for engine_id, member in members.items():
            by_size.setdefault(self._block_size(member), []).append(engine_id)
        matches: dict[str, int] = {}
        for block_size, engine_ids in by_size.items():
            hashes = (block_hashes.at(block_size) if isinstance(block_hashes, PromptHashes)
                      else block_hashes)
            found = self._match(hashes)
            matches.update({eid: found[eid] for eid in engine_ids if eid in found})
        now_s = time.monotonic()
        return [self._snapshot(member, matches.get(engine_id, 0), now_s, lora_name)
                for engine_id, member in members.items()]

    def _block_size(self, member: _Member) -> int:
        info = member.client.info
        return info.block_size if info is not None and info.block_size else (
            self.identity.block_size if self.identity is not None else 1)

    def _match(self, block_hashes: Sequence[int]) -> dict[str, int]:
        precise = self._exact.match(block_hashes, time.monotonic())
        blind = [eid for eid, m in self._members.items() if not m.kv_feed_alive]
        if blind:
            approx = self._approx.match(block_hashes)
            for engine_id in blind:
                if engine_id in approx:
                    precise[engine_id] = approx[engine_id]
        return precise

    def _prefill_rate(self, member: _Member, now_s: float) -> float:
        return prefill_rate(member.rates, [m.rates for m in self._members.values()
                                           if m is not member], now_s)

    def _request_s(self, member: _Member) -> float:
        """How long a request holds the engine: measured there, else its peers' mean."""
        if member.rates.request_s:
            return member.rates.request_s
        peers = [m.rates.request_s for m in self._members.values() if m.rates.request_s]
        return sum(peers) / len(peers) if peers else 0.0

    def _adapter(self, member: _Member, lora_name: str | None) -> AdapterState | None:
        if not lora_name:
            return None
        info = member.client.info
        return member.adapters.state(
            lora_name, member.load, max_loras=info.max_loras if info is not None else 0,
            load_s=self.options.lora_load_s, slot_wait_s=self._request_s(member))

    def _snapshot(self, member: _Member, cached_blocks: int, now_s: float,
                  lora_name: str | None = None) -> EndpointSnapshot:
        client = member.client
        load = member.load if member.load is not None else pb.LoadReport()
        return EndpointSnapshot(
            engine_id=client.engine_id, healthy=client.healthy, cached_blocks=cached_blocks,
            block_size=self._block_size(member),
            num_running=load.num_running, num_waiting=load.num_waiting,
            num_queued_tokens=load.num_queued_tokens,
            kv_cache_usage=min(max(load.kv_cache_usage, 0.0), 1.0),
            inflight_tokens=member.rates.pending_tokens,
            prefill_tokens_per_s=self._prefill_rate(member, now_s),
            decode_step_s=member.rates.decode_step_s, adapter=self._adapter(member, lora_name),
            adapter_bound=member.adapters.bound(
                member.load, client.info.max_loras if client.info is not None else 0),
            batch_full=load.batch_full if load.HasField("batch_full") else None,
            num_load_readers=load.num_load_readers, router_requests=member.requests)

    # ------------------------------------------------------------------- placement
    def record(self, engine_id: str, block_hashes: Sequence[int]) -> None:
        """Remember a placement: in the approximate index, and as unconfirmed blocks of the
        engine's precise entry (speculative: the next request of a burst finds them there
        before the engine's KV event confirms them)."""
        self._approx.record(engine_id, block_hashes)
        self._exact.claim(engine_id, block_hashes, time.monotonic())

    async def generate(self, engine_id: str, request: pb.GenerateRequest, *,
                       block_hashes: PromptHashes | Sequence[int], num_uncached_tokens: int,
                       timeout_s: float | None = None,
                       metadata: tuple[tuple[str, str], ...] = ()
                       ) -> AsyncIterator[pb.GenerateResponse]:
        """Send ``request`` to the member ``engine_id`` (which ``candidates`` just offered) and
        relay its stream; closing the iterator cancels the engine's request.

        The placement is recorded (approximate index), and ``num_uncached_tokens`` (the prefill
        the router expects it to cost) counts as the engine's in-flight work until the first
        message: the engine's load reports lag behind."""
        member = self._members[engine_id]
        hashes = (block_hashes.at(self._block_size(member))
                  if isinstance(block_hashes, PromptHashes) else block_hashes)
        self.record(engine_id, hashes)
        lora_name = getattr(request, "lora_name", "") or None
        member.adapters.sent(lora_name)
        sent = time.monotonic()
        member.rates.sent(sent, num_uncached_tokens)
        first_at = last_at = None
        num_later_tokens = 0
        stream = member.client.generate(request, timeout_s=timeout_s, metadata=metadata)
        sequences = max(request.sampling.n, 1)  # as the engine counts them: n > 1 runs n
        member.requests += sequences
        try:
            async for message in stream:
                if first_at is None:
                    first_at = time.monotonic()
                    member.adapters.started(lora_name)
                    # prefill done: the load report has it from here
                    member.rates.first_token(first_at, num_uncached_tokens)
                    if self._members.get(engine_id) is member:  # its KV event is one step away
                        self._exact.claim(engine_id, hashes, first_at)
                else:
                    last_at = time.monotonic()
                    outputs = message.outputs
                    if len(outputs) == 1:  # the common case, without a generator a token
                        num_later_tokens += len(outputs[0].token_ids)
                    elif outputs:  # per stream: n > 1 runs side by side
                        num_later_tokens += max(len(d.token_ids) for d in outputs)
                yield message
        finally:
            member.requests -= sequences
            if first_at is None:
                member.rates.dropped(time.monotonic(), num_uncached_tokens)
            member.adapters.ended(lora_name, started=first_at is not None)
            if last_at is not None:
                member.rates.observe_decode(num_later_tokens, last_at - first_at)
            if first_at is not None:
                member.rates.observe_request((last_at or first_at) - sent)
            await stream.aclose()

    async def embed(self, engine_id: str, request: pb.EmbedRequest, *,
                    block_hashes: PromptHashes | Sequence[int], num_uncached_tokens: int,
                    timeout_s: float | None = None,
                    metadata: tuple[tuple[str, str], ...] = ()) -> pb.EmbedResponse:
        """``generate``'s twin for an Embed request: recorded the same way (its prompt's
        blocks fill the engine's prefix cache), its prefill counted as in-flight work until
        the answer."""
        member = self._members[engine_id]
        self.record(engine_id, block_hashes.at(self._block_size(member))
                    if isinstance(block_hashes, PromptHashes) else block_hashes)
        member.rates.sent(time.monotonic(), num_uncached_tokens)
        answered = False
        member.requests += 1
        try:
            response = await member.client.embed(request, timeout_s=timeout_s,
                                                 metadata=metadata)
            answered = True
            return response
        finally:
            member.requests -= 1
            if answered:  # a prompt-only forward: its answer is its prefill's end
                member.rates.first_token(time.monotonic(), num_uncached_tokens)
            else:
                member.rates.dropped(time.monotonic(), num_uncached_tokens)

    def unable(self, task: str) -> frozenset[str]:
        """Members that cannot take ``task``: "generate" (an engine started with --runner
        pooling) or "embed" (an engine of a kind that serves no Embed)."""
        if task == "embed":
            return frozenset(eid for eid, m in self._members.items()
                             if not m.client.serves_embeddings)
        return frozenset(eid for eid, m in self._members.items()
                         if m.client.info is not None and m.client.info.runner == "pooling")

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
