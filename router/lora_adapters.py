"""LoRA adapters across the pool: load or unload one on every serving engine at once, and
load one on demand where a request is placed.

vLLM's /v1/load_lora_adapter loads into one server; in front of a pool the router loads it
on every serving engine (the engines check the path against their own adapter directories and
the adapter against their model), so any of them can then take the adapter's requests. An
engine's refusal (a bad adapter, a path outside its directories) is the answer, with its own
status; engines that loaded it keep it, as a retry with a fixed path reloads nothing twice.

On demand (``AdapterSources``): the router remembers the path of every adapter loaded through
it, and with a resolver directory (vLLM's filesystem LoRA resolver, ``<dir>/<name>``) it can
name a path for any adapter. Such an adapter is placed like one an engine holds but has not
read (a read priced in): where no engine holds it, on the engine where it costs least; a hot
one spreads to another engine once its queue costs more than a read there. The router loads it
on the chosen engine before sending the request, once however many requests wait for it, and
an engine that restarted gets it back the same way.
"""

from __future__ import annotations

import asyncio
import posixpath
import re

import grpc

from quire.errors import FieldError, NotFoundError
from quire.limits import MAX_LORA_NAME_CHARS
from router.balancer import NoEndpointError
from router.connection import EngineConnection, LoRACapable
from router.pool import EnginePool

# A name the resolver turns into a path: one path component, as a model name may be.
_RESOLVABLE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,254}")


def _check_name(value, field: str) -> str:
    if not isinstance(value, str) or not value or len(value) > MAX_LORA_NAME_CHARS:
        raise FieldError(field, f"must be a non-empty string of at most {MAX_LORA_NAME_CHARS} "
                         "characters")
    if "\x00" in value:
        raise FieldError(field, "must not contain a NUL character")
    return value


class AdapterSources:
    """Where the router can load each LoRA adapter from: a path on the engines."""

    def __init__(self, resolver_dir: str = "") -> None:
        self.resolver_dir = resolver_dir
        self._paths: dict[str, str] = {}  # loaded through the router's own API
        self._loading: dict[tuple[str, str], asyncio.Task] = {}  # (engine id, name)

    def remember(self, lora_name: str, lora_path: str) -> None:
        self._paths[lora_name] = lora_path

    def forget(self, lora_name: str) -> None:
        self._paths.pop(lora_name, None)

    def path_for(self, lora_name: str) -> str | None:
        """The path an engine loads ``lora_name`` from (None: the router knows none)."""
        if lora_name in self._paths:
            return self._paths[lora_name]
        if self.resolver_dir and _RESOLVABLE.fullmatch(lora_name):
            return posixpath.join(self.resolver_dir, lora_name)
        return None

    async def ensure(self, client: EngineConnection, lora_name: str,
                     timeout_s: float | None = None) -> None:
        """Load ``lora_name`` on ``client``'s engine (which must be LoRACapable): one load per
        engine and adapter however many requests wait for it. Raises the engine's status
        (NOT_FOUND: no adapter at the path)."""
        key = (client.engine_id, lora_name)
        task = self._loading.get(key)
        if task is None:
            path = self.path_for(lora_name)
            if path is None:
                raise NotFoundError("lora_name", f"the LoRA adapter {lora_name!r} is not loaded "
                                    "on any engine")
            task = asyncio.create_task(client.load_lora_adapter(lora_name, path, timeout_s))
            self._loading[key] = task
            task.add_done_callback(lambda _: self._loading.pop(key, None))
        # shielded: a waiter that goes away does not cancel the load the others wait for
        await asyncio.shield(task)


async def load_everywhere(pool: EnginePool, lora_name, lora_path,
                          timeout_s: float | None = None,
                          sources: AdapterSources | None = None) -> int:
    """Load on every serving engine; how many newly loaded it (0: all held it already).
    ``sources`` remembers the path once every engine has loaded it (for engines that join
    later, and restarted ones)."""
    name, path = _check_name(lora_name, "lora_name"), _check_name(lora_path, "lora_path")
    clients = [c for c in pool.serving() if isinstance(c, LoRACapable)]
    if not clients:
        raise NoEndpointError("no serving engine loads LoRA adapters")
    results = await asyncio.gather(*(c.load_lora_adapter(name, path, timeout_s)
                                     for c in clients), return_exceptions=True)
    _raise_first(results)
    if sources is not None:
        sources.remember(name, path)
    return sum(bool(r) for r in results)


async def unload_everywhere(pool: EnginePool, lora_name, timeout_s: float | None = None,
                            sources: AdapterSources | None = None) -> int:
    """Unload from every serving engine holding it; NotFoundError when none does.
    ``sources`` forgets its path: requests naming it are not loaded again on demand (unless
    the resolver directory names it)."""
    name = _check_name(lora_name, "lora_name")
    if sources is not None:
        sources.forget(name)
    holding = [c for c in pool.serving() if c.engine_id in pool.holding_adapter(name)
               and isinstance(c, LoRACapable)]
    if not holding:
        raise NotFoundError("lora_name", f"the LoRA adapter {name!r} is not loaded on any "
                            "engine")
    results = await asyncio.gather(*(c.unload_lora_adapter(name, timeout_s) for c in holding),
                                   return_exceptions=True)
    _raise_first([r for r in results
                  if not (isinstance(r, grpc.aio.AioRpcError)
                          and r.code() == grpc.StatusCode.NOT_FOUND)])
    return len(holding)


def _raise_first(results) -> None:
    for result in results:
        if isinstance(result, BaseException):
            raise result
