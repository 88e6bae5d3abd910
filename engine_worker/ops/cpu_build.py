"""The CPU kernels (``csrc/cpu``), one library per instruction-set variant, built on first use.

Each variant is compiled from the one set of kernel sources (``csrc/cpu/*.cpp``) and that
instruction set's own (``csrc/cpu/<isa>/``: its vector type, its linear layers, its attention
dot products), told which by ``-DQUIRE_ISA_<ISA>``, with explicit instruction-set flags (not
``-march=native``), so a library built on one node runs on any CPU with those flags. It
registers its ops in its own namespace (``torch.ops.quire_avx512``, ``torch.ops.quire_avx2``)
so one process can hold both: the kernel tests run every variant the CPU runs. The engine uses
the best variant the CPU runs (``cpu_isa``) that builds; ``cpu_ops()`` is the namespace the
Python callers use. Building is atomic, locked and remembered on failure (``ops.build``);
where no variant can run, the reason is kept and callers use the PyTorch reference ops.

``python -m engine_worker.ops`` builds every variant the compiler can build (for an
image that may run on other CPUs); ``--retry-failed`` retries remembered failures.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from engine_worker.config import quire_cache_dir
from engine_worker.ops.build import BuildFailed, BuildOptions, LibrarySpec, build_library
from engine_worker.ops.cpu_isa import (ISA_REQUIRED_FLAGS, available_isas, cpu_flags,
                                       missing_flags, no_isa_reason)

logger = logging.getLogger(__name__)

CSRC_DIR = Path(__file__).resolve().parents[2] / "csrc" / "cpu"
COMMON_CFLAGS = ("-O3", "-fopenmp", "-std=c++17", "-fPIC")


@dataclass(frozen=True, slots=True)
class CpuVariant:
    """One instruction-set variant: the shared sources in ``source_dir``, its own in
    ``source_dir / isa``, and the flags they are compiled with."""

    isa: str
    source_dir: Path
    isa_flags: tuple[str, ...]
    # an emulated variant (tests only): its name, and the header passed with -include that
    # maps the isa's intrinsics onto the host's (EMULATED_VARIANTS)
    emulated_name: str | None = None
    prelude: Path | None = None

    @property
    def name(self) -> str:
        return self.emulated_name or self.isa

    @property
    def namespace(self) -> str:
        return f"quire_{self.name}"

    @property
    def cflags(self) -> tuple[str, ...]:
        """The instruction-set flags and the define that selects the set's own code."""
        flags = (*self.isa_flags, f"-DQUIRE_ISA_{self.isa.upper()}")
        if self.prelude is not None:
            flags += (f"-I{_simde_include()}", "-include", str(self.prelude))
        return flags

    def _files(self, pattern: str) -> tuple[Path, ...]:
        dirs = (self.source_dir, self.source_dir / self.isa)
        return tuple(sorted(path for d in dirs for path in d.glob(pattern)))

    def sources(self) -> tuple[Path, ...]:
        return self._files("*.cpp")

    def headers(self) -> tuple[Path, ...]:
        """What the sources include from csrc: part of the digest, not compiled."""
        return self._files("*.h") + ((self.prelude,) if self.prelude is not None else ())


VARIANTS: dict[str, CpuVariant] = {
    # _mm512_dpbf16_ps and the bf16 conversions need AVX512_BF16; the exponent decode needs BW
    "avx512": CpuVariant("avx512", CSRC_DIR, ("-mavx512f", "-mavx512bw", "-mavx512vl",
                                              "-mavx512dq", "-mavx512bf16", "-mavx2", "-mfma",
                                              "-mf16c")),
    "avx2": CpuVariant("avx2", CSRC_DIR, ("-mavx2", "-mfma", "-mf16c")),
}
assert VARIANTS.keys() == ISA_REQUIRED_FLAGS.keys()

# For tests only, never chosen by the engine: the avx512 sources compiled for an AVX2 CPU with
# SIMDe's portable AVX-512 intrinsics (csrc/cpu/emulated/avx512_on_avx2.h), so the kernel tests
# check the AVX-512 set's numerics on a machine without AVX-512 too. Name -> (variant, the real
# variant whose flags the host CPU needs).
EMULATED_VARIANTS: dict[str, tuple[CpuVariant, str]] = {
    "avx512_emulated": (CpuVariant("avx512", CSRC_DIR, VARIANTS["avx2"].isa_flags,
                                   "avx512_emulated",
                                   CSRC_DIR / "emulated" / "avx512_on_avx2.h"), "avx2"),
}


def _simde_include() -> str:
    try:
        import simde_py
    except ImportError as exc:
        raise BuildFailed("the emulated kernels need SIMDe's headers: pip install simde-py "
                          "(part of the dev extra)") from exc
    return simde_py.get_include()


def _variant(name: str) -> tuple[CpuVariant, str] | None:
    """The variant called ``name`` and the real variant whose flags the CPU needs to run it."""
    if name in EMULATED_VARIANTS:
        return EMULATED_VARIANTS[name]
    return (VARIANTS[name], name) if name in VARIANTS else None


def kernel_code(name: str) -> str | None:
    """The instruction set whose code the variant ``name`` runs (an emulated variant: the one
    it emulates)."""
    found = _variant(name)
    return found[0].isa if found is not None else None


def _compiler() -> str:
    # the build tool's convention, as torch's own extension builder reads it
    return os.environ.get("CXX", "c++")


def torch_library_spec(name: str, sources: tuple[Path, ...], namespace: str,
                       isa_flags: tuple[str, ...] = (),
                       headers: tuple[Path, ...] | None = None) -> LibrarySpec:
    """A library of torch ops registered in ``namespace`` (``-DQUIRE_NS``), linked against
    this torch; ``headers`` (default: every header under csrc/cpu) are part of its digest."""
    from torch.utils.cpp_extension import include_paths, library_paths

    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    includes = [f"-I{CSRC_DIR}"] + [f for p in include_paths() for f in ("-isystem", p)]
    cflags = (*COMMON_CFLAGS, *isa_flags, f"-DQUIRE_NS={namespace}",
              f"-D_GLIBCXX_USE_CXX11_ABI={abi}", *includes)
    # -Bsymbolic-functions: each variant calls its own C++ kernels (the variants share C++
    # names), whichever library the process loaded first
    ldflags = ("-shared", "-fopenmp", "-Wl,-Bsymbolic-functions",
               *(f"-L{p}" for p in library_paths()), "-lc10", "-ltorch_cpu", "-ltorch")
    if headers is None:
        headers = tuple(sorted(CSRC_DIR.rglob("*.h")))
    return LibrarySpec(name, sources, headers, cflags, ldflags,
                       key_extra=f"torch {torch.__version__}")


def cpu_key() -> str:
    return hashlib.sha256(" ".join(sorted(cpu_flags())).encode()).hexdigest()[:8]


def build_variant(variant: str | CpuVariant, *, retry_failed: bool = False,
                  cache_root: Path | None = None) -> Path:
    """Build (or find in the cache) one variant's library, whether or not this CPU runs it;
    raises ``BuildFailed`` with the reason."""
    if isinstance(variant, str):
        variant = _variant(variant)[0]
    sources = variant.sources()
    if not sources:
        raise BuildFailed(f"{variant.isa} kernels not present (no *.cpp in "
                          f"{variant.source_dir} or {variant.source_dir / variant.isa})")
    opts = BuildOptions(compiler=_compiler(), retry_failed=retry_failed, cpu_key=cpu_key())
    root = cache_root if cache_root is not None else quire_cache_dir() / "kernels"
    spec = torch_library_spec(variant.namespace, sources, variant.namespace, variant.cflags,
                              variant.headers())
    return build_library(spec, root, opts)


@functools.cache
def _load(isa: str) -> tuple[object | None, str | None]:
    """(the op namespace, None) once loaded, else (None, why not). Once per process."""
    found = _variant(isa)
    if found is None:
        known = ", ".join((*VARIANTS, *EMULATED_VARIANTS))
        return None, f"unknown CPU kernel variant {isa!r} (known: {known})"
    variant, host = found
    flags = cpu_flags()
    if not ISA_REQUIRED_FLAGS[host] <= flags:
        return None, (f"this CPU cannot run the {isa} kernels (missing "
                      f"{', '.join(missing_flags(host, flags))})")
    try:
        library = build_variant(variant)
        torch.ops.load_library(str(library))
    except BuildFailed as exc:
        reason = str(exc)
        return None, reason if reason.startswith(isa) else f"building the {isa} kernels: {reason}"
    except OSError as exc:  # a library that does not load (a torch built differently)
        return None, f"{isa} kernels do not load: {exc}"
    return getattr(torch.ops, variant.namespace), None


_active_isa: str | None = None  # the variant cpu_ops() returns; set once per process


def _default_isa() -> str | None:
    """The best variant this CPU runs that loads: an AVX-512 CPU whose compiler cannot build
    the avx512 kernels still gets the avx2 ones."""
    return next((isa for isa in available_isas() if _load(isa)[0] is not None), None)


def _resolve(isa: str | None) -> str | None:
    return isa or _active_isa or _default_isa()


def _no_default_reason() -> str:
    runnable = available_isas()
    if not runnable:
        return no_isa_reason()
    return "; ".join(_load(isa)[1] for isa in runnable)


def cpu_ops_unavailable_reason(isa: str | None = None) -> str | None:
    """None once the kernels of ``isa`` (default: the variant in use, else the best this CPU
    runs that builds) are loaded; otherwise why they are not."""
    if isa is not None and _active_isa is not None and kernel_code(_active_isa) == isa:
        isa = _active_isa  # a test runs the emulated build of isa (use_cpu_isa)
    resolved = _resolve(isa)
    if resolved is None:
        return _no_default_reason()
    return _load(resolved)[1]


@functools.cache
def _warn_once(reason: str) -> None:
    logger.warning("CPU kernels unavailable, using the PyTorch reference ops: %s", reason)


def load_cpu_ops(isa: str | None = None):
    """Build (first time) and load a variant's kernels; returns its op namespace
    (``torch.ops.quire_avx2`` ...), or None with a warning saying why, once. With no ``isa``:
    the variant in use, else the best this CPU runs that builds, which becomes the one in
    use."""
    global _active_isa
    resolved = _resolve(isa)
    if resolved is None:
        _warn_once(_no_default_reason())
        return None
    ops, reason = _load(resolved)
    if ops is None:
        _warn_once(reason)
        return None
    if isa is None and _active_isa is None:
        _active_isa = resolved
        logger.info("CPU kernels: the %s variant (torch.ops.%s)", resolved,
                    _variant(resolved)[0].namespace)
    return ops


@dataclass(frozen=True, slots=True)
class CpuKernelChoice:
    """What the engine reports at start: the variant in use, or why none is."""

    isa: str | None
    reason: str | None


def cpu_kernel_choice() -> CpuKernelChoice:
    """The variant this process uses (loading it first), or None and the reason."""
    ops = load_cpu_ops()
    return CpuKernelChoice(_active_isa, None) if ops is not None else \
        CpuKernelChoice(None, cpu_ops_unavailable_reason())


def cpu_ops():
    """The op namespace of the variant in use: what the Python kernels call. Raises
    RuntimeError where no variant loads (callers check ``load_cpu_ops()`` first)."""
    if _active_isa is not None:
        return _load(_active_isa)[0]
    ops = load_cpu_ops()
    if ops is None:
        raise RuntimeError(f"CPU kernels unavailable: {cpu_ops_unavailable_reason()}")
    return ops


@contextlib.contextmanager
def use_cpu_isa(isa: str) -> Iterator[object]:
    """Within the block, ``cpu_ops()`` (and engines built there) use ``isa``: how the tests
    run every variant the CPU runs. Raises RuntimeError where it does not load."""
    global _active_isa
    ops = load_cpu_ops(isa)
    if ops is None:
        raise RuntimeError(cpu_ops_unavailable_reason(isa))
    saved, _active_isa = _active_isa, isa
    try:
        yield ops
    finally:
        _active_isa = saved
