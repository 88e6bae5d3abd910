"""Which kernel variants a CPU runs, as a pure function of the flags it reports, and what
``load`` gives for a variant: its kernels as an object, or why not."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest
import torch

from engine_worker.ops import (VARIANTS, CpuKernels, Unavailable, available_isas,
                               cannot_run_reason, load)
from engine_worker.ops.cpu_isa import full_width_bf16, isa_for_flags, runnable_isas

ZEN3 = {"sse4_2", "avx", "avx2", "fma", "f16c", "bmi2"}  # AVX2 only (this project's Zen 3)
ZEN4 = ZEN3 | {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd", "avx512_bf16",
               "avx512_vnni"}
# the module (engine_worker.ops re-exports its function cpu_isa under the same name)
cpu_isa = importlib.import_module("engine_worker.ops.cpu_isa")
SKYLAKE_X = ZEN3 | {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd"}  # no BF16


@pytest.mark.parametrize("flags, best, runnable", [
    (ZEN4, "avx512", ("avx512", "avx2")),
    (ZEN3, "avx2", ("avx2",)),
    (SKYLAKE_X, "avx2", ("avx2",)),  # AVX-512 without BF16: the avx512 kernels need it
    (ZEN4 - {"avx512bw"}, "avx2", ("avx2",)),
    (ZEN3 - {"f16c"}, None, ()),  # Sandy Bridge-like: AVX2 kernels convert fp16 with F16C
    (ZEN3 - {"fma"}, None, ()),
    ({"fp", "asimd", "sve"}, None, ()),  # an Arm CPU
    (set(), None, ()),
])
def test_the_best_variant_the_flags_allow(flags, best, runnable):
    assert isa_for_flags(frozenset(flags)) == best
    assert runnable_isas(frozenset(flags)) == runnable


@pytest.mark.parametrize("vendor, family, flags, full", [
    ("AuthenticAMD", 26, ZEN4, True),  # Zen 5: one 512-bit bf16 dot product a cycle
    ("AuthenticAMD", 25, ZEN4, False),  # Zen 4 splits it in two 256-bit halves
    ("AuthenticAMD", 25, ZEN3, False),
    ("AuthenticAMD", 26, ZEN3, False),  # no AVX-512 BF16 reported (a VM may hide it)
    ("GenuineIntel", 6, ZEN4, False),  # Intel: AMX tiles decide (backends/cpu.amx_tiles)
    ("", -1, set(), False),
])
def test_full_width_bf16_is_amd_from_family_26_with_avx512_bf16(vendor, family, flags, full):
    assert full_width_bf16(vendor, family, frozenset(flags)) is full


def test_the_vendor_and_family_come_from_the_first_processor_in_cpuinfo(tmp_path, monkeypatch):
    info = tmp_path / "cpuinfo"
    processor = "processor\t: {n}\nvendor_id\t: AuthenticAMD\ncpu family\t: 26\nmodel\t\t: 2\n\n"
    info.write_text(processor.format(n=0) + processor.format(n=1))
    monkeypatch.setattr(cpu_isa, "CPUINFO", info)
    cpu_isa.cpuinfo_fields.cache_clear()
    try:
        assert cpu_isa.cpu_vendor_family() == ("AuthenticAMD", 26)
        info.write_text("processor\t: 0\nfeatures\t: fp asimd\n")  # an Arm CPU says neither
        cpu_isa.cpuinfo_fields.cache_clear()
        assert cpu_isa.cpu_vendor_family() == ("", -1)
        monkeypatch.setattr(cpu_isa, "CPUINFO", tmp_path / "absent")
        cpu_isa.cpuinfo_fields.cache_clear()
        assert cpu_isa.cpu_vendor_family() == ("", -1)
    finally:
        cpu_isa.cpuinfo_fields.cache_clear()


def test_a_variant_this_cpu_cannot_run_is_refused_with_the_missing_flags():
    unrunnable = [isa for isa in VARIANTS if isa not in available_isas()]
    if not unrunnable:
        pytest.skip("this CPU runs every variant")
    isa = unrunnable[0]
    loaded = load(isa)
    assert isinstance(loaded, Unavailable)
    assert loaded.reason.startswith(f"this CPU cannot run the {isa} kernels (missing ")
    assert cannot_run_reason(VARIANTS[isa]) == loaded.reason


def test_an_unknown_variant_is_refused():
    loaded = load("neon")
    assert isinstance(loaded, Unavailable)
    assert loaded.reason == "unknown CPU kernel variant 'neon' (known: avx512, avx2)"


def test_a_variant_loads_into_an_object_holding_its_own_namespace():
    """What the backends are made from: the variant's ops, in its own namespace, whatever
    other variant the process holds; loading again gives the same kernels (no rebuild)."""
    runnable = [isa for isa in available_isas() if not isinstance(load(isa), Unavailable)]
    if not runnable:
        pytest.skip("no CPU kernel variant runs here")
    for isa in runnable:
        kernels = load(isa)
        assert isinstance(kernels, CpuKernels) and kernels.isa == isa
        assert kernels.ops is getattr(torch.ops, f"quire_{isa}")
        assert kernels.has("rms_norm", "paged_attention", "llama_layers")
        assert not kernels.has("no_such_op")
        assert load(VARIANTS[isa]) is kernels


def test_no_module_state_chooses_kernels():
    """Which variant runs is the backend registry's choice, handed on as an object: nothing in
    the kernel or backend packages rebinds a module global at run time."""
    root = Path(__file__).resolve().parents[3] / "engine_worker"
    paths = [path for package in ("ops", "backends") for path in (root / package).glob("*.py")]
    rebinding = [f"{path.relative_to(root)}:{node.lineno}" for path in sorted(paths)
                 for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.Global)]
    assert rebinding == []
