"""The CPU kernels (``csrc/cpu``), one library per instruction-set variant, built on first use
and loaded into an object (``load``): the one way to get a variant's ops.

Each variant is compiled from the one set of kernel sources (``csrc/cpu/*.cpp``) and that
instruction set's own (``csrc/cpu/<isa>/``: its vector type, its linear layers, its attention
dot products), told which by ``-DQUIRE_ISA_<ISA>``, with explicit instruction-set flags (not
``-march=native``), so a library built on one node runs on any CPU with those flags. It
registers its ops in its own namespace (``torch.ops.quire_avx512``, ``torch.ops.quire_avx2``)
so one process can hold several: the kernel tests run every variant the CPU runs. Which
variant an engine runs is the backend registry's choice (``engine_worker.backends``), not
this module's: ``load`` only says what a variant gives here, or why it gives nothing.
Building is atomic, locked and remembered on failure (``ops.build``).

``python -m engine_worker.ops`` builds every variant the compiler can build (for an
image that may run on other CPUs); ``--retry-failed`` retries remembered failures.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from engine_worker.config import quire_cache_dir
from engine_worker.ops.build import BuildFailed, BuildOptions, LibrarySpec, build_library
from engine_worker.ops.cpu_isa import ISA_REQUIRED_FLAGS, cpu_flags, missing_flags

logger = logging.getLogger(__name__)

CSRC_DIR = Path(__file__).resolve().parents[2] / "csrc" / "cpu"
COMMON_CFLAGS = ("-O3", "-fopenmp", "-std=c++17", "-fPIC")


@dataclass(frozen=True, slots=True)
class CpuVariant:
    """One build of the kernels: the shared sources in ``source_dir`` and the instruction set
    ``isa``'s own in ``source_dir / isa``, compiled with ``isa_flags``. ``host_isa``: the set
    whose flags the CPU needs to run the library, where that is not ``isa`` (a build of one
    set's code for another's instructions, e.g. through a header forced in with
    ``extra_cflags``, as the tests build the AVX-512 code for an AVX2 CPU)."""

    name: str  # the namespace's suffix (torch.ops.quire_<name>) and what logs call it
    isa: str  # whose code: csrc/cpu/<isa>/ and -DQUIRE_ISA_<ISA>
    isa_flags: tuple[str, ...]
    source_dir: Path = CSRC_DIR
    host_isa: str | None = None
    extra_cflags: tuple[str, ...] = ()
    extra_headers: tuple[Path, ...] = ()  # inputs of extra_cflags: part of the digest

    @property
    def runs_on(self) -> str:
        """The ``ISA_REQUIRED_FLAGS`` entry a CPU must have to run this build."""
        return self.host_isa or self.isa

    @property
    def namespace(self) -> str:
        return f"quire_{self.name}"

    @property
    def cflags(self) -> tuple[str, ...]:
        """The instruction-set flags and the define that selects the set's own code."""
        return (*self.isa_flags, f"-DQUIRE_ISA_{self.isa.upper()}", *self.extra_cflags)

    def _files(self, pattern: str) -> tuple[Path, ...]:
        dirs = (self.source_dir, self.source_dir / self.isa)
        return tuple(sorted(path for d in dirs for path in d.glob(pattern)))

    def sources(self) -> tuple[Path, ...]:
        return self._files("*.cpp")

    def headers(self) -> tuple[Path, ...]:
        """What the sources include from csrc: part of the digest, not compiled."""
        return self._files("*.h") + self.extra_headers


VARIANTS: dict[str, CpuVariant] = {
    # _mm512_dpbf16_ps and the bf16 conversions need AVX512_BF16; the exponent decode needs BW;
    # the 4-bit kernels' integer dot products VNNI (every AVX512_BF16 CPU has it)
    "avx512": CpuVariant("avx512", "avx512", ("-mavx512f", "-mavx512bw", "-mavx512vl",
                                              "-mavx512dq", "-mavx512bf16", "-mavx512vnni",
                                              "-mavx2", "-mfma", "-mf16c")),
    "avx2": CpuVariant("avx2", "avx2", ("-mavx2", "-mfma", "-mf16c")),
}
assert VARIANTS.keys() == ISA_REQUIRED_FLAGS.keys()


@dataclass(frozen=True, slots=True)
class CpuKernels:
    """One variant's kernels, loaded: what a CPU backend is made from
    (``backends.cpu.make_cpu_backend``). ``ops`` is the variant's op namespace."""

    variant: CpuVariant
    ops: Any  # torch.ops.quire_<variant name>

    @property
    def isa(self) -> str:
        """Whose code runs (what the op wrappers' shape rules follow)."""
        return self.variant.isa

    def has(self, *names: str) -> bool:
        return all(hasattr(self.ops, name) for name in names)


@dataclass(frozen=True, slots=True)
class Unavailable:
    """Why something (a kernel variant, a backend) cannot run here; one line, for logs."""

    reason: str


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
        variant = VARIANTS[variant]
    sources = variant.sources()
    if not sources:
        raise BuildFailed(f"{variant.isa} kernels not present (no *.cpp in "
                          f"{variant.source_dir} or {variant.source_dir / variant.isa})")
    opts = BuildOptions(compiler=_compiler(), retry_failed=retry_failed, cpu_key=cpu_key())
    root = cache_root if cache_root is not None else quire_cache_dir() / "kernels"
    spec = torch_library_spec(variant.namespace, sources, variant.namespace, variant.cflags,
                              variant.headers())
    return build_library(spec, root, opts)


def cannot_run_reason(variant: CpuVariant) -> str | None:
    """Why this CPU cannot run ``variant``'s code (the flags it lacks), or None: a pure check,
    nothing built or loaded."""
    flags = cpu_flags()
    if ISA_REQUIRED_FLAGS[variant.runs_on] <= flags:
        return None
    return (f"this CPU cannot run the {variant.name} kernels (missing "
            f"{', '.join(missing_flags(variant.runs_on, flags))})")


def load(variant: str | CpuVariant) -> CpuKernels | Unavailable:
    """``variant``'s kernels (a ``VARIANTS`` name or a variant), built on first use and
    loaded, or why they cannot run here (the CPU's missing flags, the build's error)."""
    if isinstance(variant, str):
        if variant not in VARIANTS:
            return Unavailable(f"unknown CPU kernel variant {variant!r} "
                               f"(known: {', '.join(VARIANTS)})")
        variant = VARIANTS[variant]
    return _load(variant)


# Keyed by the variant (a value): a library once loaded stays loaded in the process
# (torch.ops.load_library cannot unload it), and a failed build or load is not retried within
# it. A record of what happened, not a choice: which variant runs is the caller's.
@functools.cache
def _load(variant: CpuVariant) -> CpuKernels | Unavailable:
    reason = cannot_run_reason(variant)
    if reason is not None:
        return Unavailable(reason)
    name = variant.name
    try:
        library = build_variant(variant)
        torch.ops.load_library(str(library))
    except BuildFailed as exc:
        reason = str(exc)
        return Unavailable(reason if reason.startswith(variant.isa)
                           else f"building the {name} kernels: {reason}")
    except OSError as exc:  # a library that does not load (a torch built differently)
        return Unavailable(f"{name} kernels do not load: {exc}")
    logger.info("CPU kernels: the %s variant loaded (torch.ops.%s)", name, variant.namespace)
    return CpuKernels(variant, getattr(torch.ops, variant.namespace))
