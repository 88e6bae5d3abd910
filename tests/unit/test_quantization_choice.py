"""The ``quantization`` engine argument resolved against the checkpoint and the backend's
kernels (engine_worker/weights/quantization.py): a pure function, every branch."""

from __future__ import annotations

import pytest

from engine_worker.config import EngineArgs
from engine_worker.weights.quantization import choose_quantization

GGUF_KERNELS = frozenset({"Q4_0", "Q4_1", "Q8_0"})


def _choose(requested, fmt="gguf", native=GGUF_KERNELS, backend="cpu-avx2"):
    return choose_quantization(requested, checkpoint_format=fmt, backend=backend,
                               native_types=native)


def test_auto_runs_a_gguf_natively_where_the_kernels_have_it():
    choice = _choose("auto")
    assert (choice.method, choice.strict, choice.loud) == ("gguf", False, False)
    assert "natively" in choice.reason and "Q4_0, Q4_1, Q8_0" in choice.reason


def test_auto_without_kernels_dequantizes_and_says_so_loudly():
    choice = _choose("auto", native=frozenset(), backend="torch")
    assert (choice.method, choice.loud) == ("dequantize", True)
    assert "torch backend has no GGUF kernels" in choice.reason


def test_gguf_by_name_is_strict_and_refuses_a_backend_without_kernels():
    assert _choose("gguf").strict
    with pytest.raises(ValueError, match=r"^quantization: 'gguf' needs kernels .* the torch "
                                         r"backend has none"):
        _choose("gguf", native=frozenset(), backend="torch")


def test_dequantize_is_todays_path_and_a_float_checkpoint_has_nothing_to_do():
    assert _choose("dequantize").method == "dequantize"
    assert _choose("auto", fmt=None).method == "none"
    assert _choose("dequantize", fmt=None).method == "none"
    with pytest.raises(ValueError, match=r"^quantization: 'gguf' needs a \.gguf model"):
        _choose("gguf", fmt=None)


def test_an_unknown_value_names_the_field():
    with pytest.raises(ValueError, match=r"^quantization: must be one of \('auto', 'gguf', "
                                         r"'awq', 'gptq', 'dequantize'\), got 'fp8'"):
        EngineArgs(quantization="fp8").create_engine_config()
