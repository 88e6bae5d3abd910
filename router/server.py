"""The router pod: serves the engine's own Generate API and places each request on an engine.

Per request: tokenize once (token-id prompts pass through), hash the prompt's full blocks
exactly as the engines do (cache salt included), ask the prefix index how much of the prompt
each engine holds, let the balancer pick, then forward the request *as token ids* and relay the
stream. An engine that fails before its first message is retried on another one (bounded);
once a message was relayed the request is never replayed, since the client already has tokens.
Cancelling the client call cancels the upstream call, which aborts the request on the engine.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc

from quire.block_hash import BLOCK_HASH_ALGORITHM, ROOT_HASH
from quire.v1 import engine_pb2 as pb
from quire.v1 import engine_pb2_grpc
from router.balancer import Decision, NoEndpointError, Policy, RoutingRequest, choose, make_policy
from router.engine_client import EngineClient, EngineMismatchError, ModelExpectation
from router.errors import RETRYABLE_CODES, abort_with
from router.prefix_index import PrefixIndex
from router.tokenizer import RouterTokenizer

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class RoutedPrompt:
    token_ids: tuple[int, ...]
    block_hashes: tuple[int, ...]


class RouterServicer(engine_pb2_grpc.EngineServiceServicer):
    """quire.v1.EngineService in front of several engines (Generate and GetModelInfo)."""

    def __init__(self, clients: Sequence[EngineClient], *, tokenizer: RouterTokenizer,
                 index: PrefixIndex, policy: Policy, block_size: int,
                 max_attempts: int = 2) -> None:
        if max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, got {max_attempts}")
        self.clients = {client.engine_id: client for client in clients}
        self.tokenizer = tokenizer
        self.index = index
        self.policy = policy
        self.block_size = block_size
        self.max_attempts = max_attempts

    def prepare(self, request: pb.GenerateRequest) -> RoutedPrompt:
        """Token ids and block hashes of the request's prompt. Raises ValueError on a bad prompt."""
        kind = request.WhichOneof("prompt")
        if kind == "text":
            if not request.text:
                raise ValueError("text: the prompt must not be empty")
            token_ids = tuple(self.tokenizer.encode(request.text))
        elif kind == "token_ids":
            token_ids = tuple(request.token_ids.ids)
        else:
            raise ValueError("prompt: set either text or token_ids")
        hashes = self.tokenizer.block_hashes(token_ids, self.block_size,
                                             cache_salt=request.cache_salt or None)
        return RoutedPrompt(token_ids=token_ids, block_hashes=tuple(hashes))

    def place(self, prompt: RoutedPrompt, exclude: set[str]) -> tuple[EngineClient, Decision]:
        """The engine for ``prompt`` among those not in ``exclude`` (NoEndpointError if none)."""
        matches = self.index.match(prompt.block_hashes)
        snapshots = [client.snapshot(matches.get(engine_id, 0))
                     for engine_id, client in self.clients.items() if engine_id not in exclude]
        decision = choose(RoutingRequest(block_hashes=prompt.block_hashes,
                                         num_prompt_tokens=len(prompt.token_ids)),
                          snapshots, self.policy)
        return self.clients[decision.engine_id], decision

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext):
        try:
            prompt = self.prepare(request)
        except ValueError as e:
            await abort_with(context, e)
            return
        forward = pb.GenerateRequest()
        forward.CopyFrom(request)
        forward.token_ids.ids[:] = prompt.token_ids  # sets the oneof: the engine skips tokenizing
        tried: set[str] = set()
        last_error: BaseException | None = None
        for attempt in range(1, self.max_attempts + 1):
            try:
                client, decision = self.place(prompt, tried)
            except NoEndpointError as e:
                await abort_with(context, last_error or e)
                return
            tried.add(client.engine_id)
            logger.info("request %r -> engine %s (attempt %d, policy %s, score %.4f, "
                        "predicted cached tokens %d of %d)", request.request_id,
                        decision.engine_id, attempt, decision.policy,
                        decision.scores[decision.engine_id], decision.predicted_cached_tokens,
                        len(prompt.token_ids))
            stream = client.generate(forward, timeout_s=context.time_remaining())
            relayed = False
            try:
                async for message in stream:
                    relayed = True
                    yield message
                return
            except grpc.aio.AioRpcError as e:
                if relayed or e.code() not in RETRYABLE_CODES:
                    await abort_with(context, e)
                    return
                logger.warning("request %r: engine %s failed before its first message (%s); "
                               "trying another", request.request_id, client.engine_id,
                               e.code().name)
                last_error = e
            finally:
                await stream.aclose()
        await abort_with(context, last_error)

    async def GetModelInfo(self, request, context) -> pb.ModelInfo:
        infos = [c.info for c in self.clients.values() if c.info is not None]
        if not infos:
            await abort_with(context, NoEndpointError("no engine connected"))
        first = infos[0]
        # Hashing fields are equal on every engine (connect checked them); capacity adds up and
        # the length limit is the smallest, so any engine can take what the router accepts.
        return pb.ModelInfo(
            model_name=first.model_name, max_model_len=min(i.max_model_len for i in infos),
            block_size=first.block_size, block_hash_algorithm=first.block_hash_algorithm,
            block_hash_seed=first.block_hash_seed, tokenizer_digest=first.tokenizer_digest,
            vocab_size=first.vocab_size,
            enable_prefix_caching=all(i.enable_prefix_caching for i in infos),
            num_kv_blocks=sum(i.num_kv_blocks for i in infos))


class RouterServer:
    """Start with ``await start()`` (returns the port); ``await stop()``.

    Engines come from a static address list; each is its own engine id. Engines whose model
    identity differs from ``expected`` are refused (logged, listed in ``refused``).
    """

    def __init__(self, static_addresses: Sequence[str], tokenizer_dir: str | Path,
                 policy: str = "prefix_aware", host: str = "127.0.0.1", port: int = 0, *,
                 block_size: int = 16, expected: ModelExpectation | None = None,
                 max_attempts: int = 2) -> None:
        if not static_addresses:
            raise ValueError("static_addresses: at least one engine address is required")
        self.static_addresses = tuple(static_addresses)
        self.tokenizer_dir = Path(tokenizer_dir)
        self.policy = make_policy(policy)
        self.host = host
        self.port = port
        self.block_size = expected.block_size if expected else block_size
        self.expected = expected
        self.max_attempts = max_attempts
        self.index = PrefixIndex()
        self.clients: list[EngineClient] = []
        self.refused: dict[str, EngineMismatchError] = {}
        self.servicer: RouterServicer | None = None
        self.server: grpc.aio.Server | None = None

    async def start(self) -> int:
        tokenizer = await asyncio.to_thread(RouterTokenizer.from_dir, self.tokenizer_dir)
        expected = self.expected or ModelExpectation(
            block_size=self.block_size, block_hash_algorithm=BLOCK_HASH_ALGORITHM,
            block_hash_seed=ROOT_HASH, tokenizer_digest=tokenizer.digest)
        candidates = [EngineClient(address, address, index=self.index, expected=expected)
                      for address in self.static_addresses]
        results = await asyncio.gather(*(c.connect() for c in candidates),
                                       return_exceptions=True)
        for client, result in zip(candidates, results):
            if isinstance(result, EngineMismatchError):
                self.refused[client.engine_id] = result
            elif isinstance(result, BaseException):
                await self._close_clients()
                raise result
            else:
                self.clients.append(client)
        if not self.clients:
            raise RuntimeError(f"no usable engine: {len(self.refused)} refused "
                               f"({'; '.join(map(str, self.refused.values()))})")
        self.servicer = RouterServicer(self.clients, tokenizer=tokenizer, index=self.index,
                                       policy=self.policy, block_size=expected.block_size,
                                       max_attempts=self.max_attempts)
        self.server = grpc.aio.server()
        engine_pb2_grpc.add_EngineServiceServicer_to_server(self.servicer, self.server)
        self.port = self.server.add_insecure_port(f"{self.host}:{self.port}")
        await self.server.start()
        logger.info("router serving on %s:%d over %d engine(s), policy %s", self.host,
                    self.port, len(self.clients), self.policy.name)
        return self.port

    async def stop(self, grace_s: float | None = None) -> None:
        if self.server is not None:
            await self.server.stop(grace_s)
        await self._close_clients()

    async def _close_clients(self) -> None:
        await asyncio.gather(*(c.close() for c in self.clients), return_exceptions=True)
        self.clients = []
