"""The backend registry and the one choice an engine makes at start.

Which backend ``auto`` picks depends on this machine (the CPU kernels build only where the
compiler and CPU allow), so each test reads the real reason and checks the choice follows it.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine_worker.backends import BACKENDS, PREFERENCE, select_backend
from engine_worker.config import KERNEL_CHOICES
from engine_worker.ops.cpu_isa import cpu_vendor_family, full_width_bf16
from tests.conftest import cpu_kernels_unavailable_reason

CPU = torch.device("cpu")
CUDA = torch.device("cuda")  # only a name here: nothing runs on it


def test_every_kernels_choice_is_a_registered_backend():
    assert set(KERNEL_CHOICES) == set(BACKENDS) | {"auto"}
    assert all(name in BACKENDS for names in PREFERENCE.values() for name in names)
    assert {name: entry.name for name, entry in BACKENDS.items()} == \
        {name: name for name in BACKENDS}


def test_auto_on_the_cpu_takes_the_kernels_where_they_build_and_says_why_not():
    """The AVX-512 set where it runs, else the AVX2 set (no costly fallback: it is the right
    set for such a CPU, and the reason says why AVX-512 was passed over), else the reference,
    loudly."""
    avx512 = cpu_kernels_unavailable_reason("avx512")
    avx2 = cpu_kernels_unavailable_reason("avx2")
    choice = select_backend("auto", CPU)
    if avx512 is None:
        assert (choice.name, choice.fallback) == ("cpu", False)
        # where oneDNN has AMX tiles (Intel Sapphire Rapids and later) the line says so, and
        # where it has a full-width AVX-512 BF16 datapath (AMD Zen 5) the line names the twins
        flags = set(Path("/proc/cpuinfo").read_text().split())
        amx = ", AMX tiles for many-row matmuls (Q4 weights' rows up to 128 from their " \
            "4-bit blocks) and bf16 attention (prefill; decode scores)" \
            if {"amx_tile", "amx_bf16", "amx_int8"} <= flags else \
            ", int8 dot products for Q4_0 / Q4_1 weights, bf16 twins of other quantized " \
            "weights for many-row matmuls (full-width AVX-512 BF16)" \
            if full_width_bf16(*cpu_vendor_family(), frozenset(flags)) else ""
        assert choice.describe() == (f"cpu (compiled CPU kernels, AVX-512{amx}): the fastest "
                                     "backend that runs on cpu")
    elif avx2 is None:
        assert (choice.name, choice.fallback) == ("cpu-avx2", False)
        assert choice.reason == f"compiled CPU kernels, AVX-512 unavailable: {avx512}"
        assert choice.describe().startswith(
            "cpu-avx2 (compiled CPU kernels, AVX2, int8 dot products for a bf16 model's Q4_0 / "
            "Q4_1 / Q8_0 weights, bf16 panel twins of its k-quants for many-row matmuls): ")
    else:
        assert (choice.name, choice.fallback) == ("torch", True)
        assert choice.reason == (f"compiled CPU kernels, AVX-512 unavailable: {avx512}; "
                                 f"compiled CPU kernels, AVX2 unavailable: {avx2}")
        assert choice.describe().startswith("torch (reference ops, about 5-10x slower): ")


def test_a_requested_backend_is_no_fallback_or_an_error_naming_the_field():
    choice = select_backend("torch", CPU)
    assert (choice.name, choice.fallback, choice.reason) == ("torch", False,
                                                             "requested (kernels=torch)")
    with pytest.raises(ValueError, match=r"^kernels: 'cpu' requested but unavailable: the "
                                         r"compiled CPU kernels run on the CPU only"):
        select_backend("cpu", CUDA)
    for name, isa in (("cpu", "avx512"), ("cpu-avx2", "avx2")):
        if cpu_kernels_unavailable_reason(isa) is None:
            assert select_backend(name, CPU).name == name
        else:
            with pytest.raises(ValueError, match=f"^kernels: '{name}' requested but "
                                                 "unavailable: "):
                select_backend(name, CPU)


def test_auto_on_cuda_is_triton_where_it_is_installed():
    choice = select_backend("auto", CUDA)
    try:
        import triton  # noqa: F401
    except ImportError:
        assert (choice.name, choice.fallback) == ("torch", True)
        assert "triton is not installed" in choice.reason
    else:
        assert (choice.name, choice.fallback) == ("triton", False)


def test_attention_backend_swaps_only_the_attention():
    pytest.importorskip("triton")
    choice = select_backend("torch", CPU, attention_backend="triton")  # interpreter here
    assert choice.backend.attention.name == "triton"
    assert choice.backend.linear is select_backend("torch", CPU).backend.linear
    assert "attention: triton" in choice.reason
    assert select_backend("torch", CPU, attention_backend="torch").backend.attention.name == \
        "torch"


def test_a_cpu_entry_makes_its_backend_from_the_variant_it_names(monkeypatch):
    """The registry resolves an entry's kernel variant once and makes the backend from those
    kernels: swapping the entry's variant (as the kernel tests do) swaps what runs."""
    from tests.conftest import use_cpu_variant

    kernels = use_cpu_variant(monkeypatch, "avx512_emulated")
    choice = select_backend("cpu", CPU)
    assert choice.backend.description == "compiled CPU kernels, AVX-512 (avx512_emulated)"
    x = torch.randn(3, 64)
    weight = torch.randn(64)
    assert torch.equal(choice.backend.rms_norm(x, weight, 1e-5),
                       kernels.ops.rms_norm(x, weight, 1e-5))
    monkeypatch.undo()
    assert BACKENDS["cpu"].description == "compiled CPU kernels, AVX-512"


def test_fused_stacks_are_keyed_by_the_models_stack_kind():
    from engine_worker.models.llama import LlamaStack

    assert LlamaStack.kind == "llama"
    assert select_backend("torch", CPU).backend.fused_stacks == {}
    for name, isa in (("cpu", "avx512"), ("cpu-avx2", "avx2")):
        if cpu_kernels_unavailable_reason(isa) is None:
            backend = select_backend(name, CPU).backend
            assert set(backend.fused_stacks) == {LlamaStack.kind}
            # another attention implementation runs outside the fused stack: none then
            assert select_backend(name, CPU, attention_backend="torch").backend.fused_stacks \
                == {}
