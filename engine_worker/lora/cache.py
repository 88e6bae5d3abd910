"""Registered adapters and the LRU of those loaded in host memory (``max_cpu_loras``).

Registering (``add``) loads and checks an adapter at once, so a bad one is refused then and
never reaches a step. An adapter pushed out of host memory stays registered: the next step
that needs it reads it again from its path, as vLLM's worker does.
"""

from __future__ import annotations

import itertools
import time
from collections import OrderedDict
from collections.abc import Collection

from engine_worker.lora.adapter import LoRAAdapter, LoRAModelSpec, load_adapter
from engine_worker.lora.request import LoRARequest
from quire.errors import FieldError, NotFoundError


class UnknownLoRAError(NotFoundError):
    """A request named an adapter this engine has not registered (gRPC NOT_FOUND, HTTP
    404); a ``FieldError`` naming ``lora_name``."""

    def __init__(self, name: str, detail: str = "is not loaded on this engine") -> None:
        super().__init__("lora_name", f"the LoRA adapter {name!r} {detail}")
        self.lora_name = name


class LoRAAdapterCache:
    def __init__(self, spec: LoRAModelSpec, max_lora_rank: int, max_cpu_loras: int) -> None:
        self.spec = spec
        self.max_lora_rank = max_lora_rank
        self.max_cpu_loras = max_cpu_loras
        self.registered: dict[str, LoRARequest] = {}
        self._loaded: OrderedDict[str, LoRAAdapter] = OrderedDict()
        self._ids = itertools.count(1)
        self.version = 0  # counts changes to ``registered``
        self.num_loads = 0  # adapters read from their path (registering included)
        self.load_s = 0.0  # the time those reads took, in all

    def request_for(self, name: str, path: str) -> LoRARequest:
        """A LoRARequest with an id no registered adapter uses."""
        used = {r.lora_int_id for r in self.registered.values()}
        return LoRARequest(name, next(i for i in self._ids if i not in used), path)

    def add(self, request: LoRARequest) -> bool:
        """Load, check and register; False when this exact adapter is registered already."""
        known = self.registered.get(request.lora_name)
        if known is not None:
            if known.lora_path == request.lora_path:
                return False
            raise FieldError("lora_name", f"an adapter named {request.lora_name!r} is "
                             f"already loaded (from {known.lora_path}); unload it first")
        adapter = self._read(request.lora_name, request.lora_path)
        self.registered[request.lora_name] = request
        self.version += 1
        self._remember(adapter, keep=())
        return True

    def remove(self, name: str) -> bool:
        self._loaded.pop(name, None)
        self.version += 1
        return self.registered.pop(name, None) is not None

    def check(self, name: str) -> None:
        if name not in self.registered:
            raise UnknownLoRAError(name)

    def get(self, name: str, keep: Collection[str] = ()) -> LoRAAdapter:
        """The loaded adapter (read again from its path if it was pushed out); ``keep``:
        adapters not to push out for it."""
        adapter = self._loaded.get(name)
        if adapter is not None:
            self._loaded.move_to_end(name)
            return adapter
        adapter = self._read(name, self.registered[name].lora_path)
        self._remember(adapter, keep)
        return adapter

    def _read(self, name: str, path: str) -> LoRAAdapter:
        """``load_adapter``, counted and timed (a router prices a load by what it took)."""
        started = time.perf_counter()
        adapter = load_adapter(name, path, self.spec, self.max_lora_rank)
        self.num_loads += 1
        self.load_s += time.perf_counter() - started
        return adapter

    def _remember(self, adapter: LoRAAdapter, keep: Collection[str]) -> None:
        self._loaded[adapter.name] = adapter
        for name in list(self._loaded):
            if len(self._loaded) <= self.max_cpu_loras:
                break
            if name not in keep and name != adapter.name:
                del self._loaded[name]

    @property
    def loaded_names(self) -> list[str]:
        return list(self._loaded)
