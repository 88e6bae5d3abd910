"""LoRA adapters across the pool: load or unload one on every serving engine at once.

vLLM's /v1/load_lora_adapter loads into one server; in front of a pool the router loads it
on every serving engine (the engines check the path against their own adapter directories and
the adapter against their model), so any of them can then take the adapter's requests. An
engine's refusal (a bad adapter, a path outside its directories) is the answer, with its own
status; engines that loaded it keep it, as a retry with a fixed path reloads nothing twice.
"""

from __future__ import annotations

import asyncio

import grpc

from quire.errors import FieldError, NotFoundError
from router.balancer import NoEndpointError
from router.connection import LoRACapable
from router.pool import EnginePool


def _check_name(value, field: str) -> str:
    if not isinstance(value, str) or not value or len(value) > 1024:
        raise FieldError(field, "must be a non-empty string of at most 1024 characters")
    return value


async def load_everywhere(pool: EnginePool, lora_name, lora_path,
                          timeout_s: float | None = None) -> int:
    """Load on every serving engine; how many newly loaded it (0: all held it already)."""
    name, path = _check_name(lora_name, "lora_name"), _check_name(lora_path, "lora_path")
    clients = [c for c in pool.serving() if isinstance(c, LoRACapable)]
    if not clients:
        raise NoEndpointError("no serving engine loads LoRA adapters")
    results = await asyncio.gather(*(c.load_lora_adapter(name, path, timeout_s)
                                     for c in clients), return_exceptions=True)
    _raise_first(results)
    return sum(bool(r) for r in results)


async def unload_everywhere(pool: EnginePool, lora_name, timeout_s: float | None = None
                            ) -> int:
    """Unload from every serving engine holding it; NotFoundError when none does."""
    name = _check_name(lora_name, "lora_name")
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
