"""Kernel backends, looked up by name, and the one choice an engine makes at start.

``torch`` is the pure-PyTorch reference every other backend is tested against; ``cpu`` and
``cpu-avx2`` are the compiled sets of ``csrc/cpu`` (one kernel variant each, loaded when the
entry is resolved and handed to the backend as an object); ``triton`` is Triton's paged
attention. ``auto`` takes the first backend of the device type's preference list that can
run here, and says why when that is not the first: a fallback costs 5 to 10x and must be loud.

A new backend (an instruction set, a GPU kernel library) is a ``BackendEntry`` in
``BACKENDS`` and a place in ``PREFERENCE``; its ``Backend`` is handed weights as data
(``backends.base``) and tested against the reference.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine_worker.backends.base import Backend, BackendEntry
from engine_worker.backends.cpu import cpu_backend_entry
from engine_worker.backends.reference import REFERENCE
from engine_worker.backends.triton import (DESCRIPTION as TRITON_DESCRIPTION, resolve_triton,
                                           triton_unavailable_reason, with_attention)
from engine_worker.ops import VARIANTS, Unavailable

BACKENDS: dict[str, BackendEntry] = {
    "torch": BackendEntry("torch", REFERENCE.description, lambda device: REFERENCE),
    # the AVX-512 build: its bf16 path streams layouts only AVX-512 BF16 multiplies; CPUs
    # without it get cpu-avx2
    "cpu": cpu_backend_entry("cpu", "compiled CPU kernels, AVX-512", VARIANTS["avx512"]),
    "cpu-avx2": cpu_backend_entry("cpu-avx2", "compiled CPU kernels, AVX2", VARIANTS["avx2"]),
    "triton": BackendEntry("triton", TRITON_DESCRIPTION, resolve_triton),
}

# ``auto``: the backends to try on a device type, fastest first. ``cpu`` is the AVX-512 set
# (bf16 dot products); ``cpu-avx2`` serves x86 CPUs without AVX-512, as fast as they allow.
PREFERENCE: dict[str, tuple[str, ...]] = {"cpu": ("cpu", "cpu-avx2", "torch"),
                                          "cuda": ("triton", "torch")}

FALLBACK_COST = "about 5-10x slower"


@dataclass(frozen=True, slots=True)
class BackendChoice:
    """The backend an engine runs and why: ``reason`` is the requested name, or why every
    faster backend for the device was passed over (``fallback``)."""

    backend: Backend
    reason: str
    fallback: bool = False

    @property
    def name(self) -> str:
        return self.backend.name

    def describe(self) -> str:
        """One line for the log: ``torch (reference ops, about 5-10x slower): <why>``."""
        what = self.backend.description + (f", {FALLBACK_COST}" if self.fallback else "")
        return f"{self.name} ({what}): {self.reason}"


def select_backend(name: str, device: torch.device,
                   attention_backend: str = "auto") -> BackendChoice:
    """``name`` is a registry key or ``auto``; a named backend that cannot run here raises
    ValueError (``kernels: ...``), ``auto`` falls back and keeps the reason.
    ``attention_backend`` (``torch`` or ``triton``) swaps the chosen backend's attention."""
    choice = _select(name, device)
    if attention_backend == "auto" or attention_backend == choice.backend.attention.name:
        return choice
    if attention_backend == "triton":
        reason = triton_unavailable_reason(device)
        if reason is not None:
            raise ValueError(f"attention_backend: 'triton' requested but unavailable: {reason}")
    return BackendChoice(with_attention(choice.backend, attention_backend),
                         f"{choice.reason}; attention: {attention_backend} (requested)",
                         choice.fallback)


def _select(name: str, device: torch.device) -> BackendChoice:
    if name != "auto":
        backend = BACKENDS[name].resolve(device)
        if isinstance(backend, Unavailable):
            raise ValueError(f"kernels: {name!r} requested but unavailable: {backend.reason}")
        return BackendChoice(backend, f"requested (kernels={name})")
    passed_over: list[str] = []
    for candidate in PREFERENCE.get(device.type, ("torch",)):
        entry = BACKENDS[candidate]
        backend = entry.resolve(device)
        if isinstance(backend, Unavailable):
            passed_over.append(f"{entry.description} unavailable: {backend.reason}")
            continue
        if passed_over:
            # a costly fallback only when it ends on the reference: passing over the AVX-512
            # set for the AVX2 one on a CPU without AVX-512 is the right choice
            return BackendChoice(backend, "; ".join(passed_over),
                                 fallback=backend is REFERENCE)
        return BackendChoice(backend, f"the fastest backend that runs on {device.type}")
    raise AssertionError(f"no backend runs on {device}")  # the reference runs everywhere


__all__ = ["BACKENDS", "Backend", "BackendChoice", "BackendEntry", "PREFERENCE",
           "select_backend"]
