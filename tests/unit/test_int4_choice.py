"""The ``quantization`` choice for AWQ / GPTQ checkpoints (engine_worker/weights/int4_choice.py,
reached through ``choose_quantization``): every branch, and the checkpoint's format read from
its config.json before anything loads."""

from __future__ import annotations

import json

import pytest

from engine_worker.weights.int4_choice import checkpoint_format_of
from engine_worker.weights.quantization import choose_quantization

CPU = frozenset({"Q4_0", "Q4_1", "Q8_0"})
TRITON = frozenset({"INT4_GROUPS"})


def _choose(requested, fmt="awq", native=CPU, backend="cpu-avx2"):
    return choose_quantization(requested, checkpoint_format=fmt, backend=backend,
                               native_types=native)


@pytest.mark.parametrize("fmt", ["awq", "gptq"])
def test_auto_and_by_name_run_natively_on_the_cpu_sets_and_triton(fmt):
    auto = _choose("auto", fmt)
    assert (auto.method, auto.strict, auto.loud) == (fmt, False, False)
    assert "GGUF Q4_0/Q4_1 blocks" in auto.reason
    named = _choose(fmt, fmt, native=TRITON, backend="triton")
    assert (named.method, named.strict) == (fmt, True)
    assert "Triton int4 kernel" in named.reason


def test_auto_without_4bit_kernels_dequantizes_loudly_and_by_name_refuses():
    choice = _choose("auto", "gptq", native=frozenset(), backend="torch")
    assert (choice.method, choice.loud) == ("dequantize", True)
    with pytest.raises(ValueError, match=r"^quantization: 'gptq' needs 4-bit kernels .*torch "
                                         r"backend has none"):
        _choose("gptq", "gptq", native=frozenset(), backend="torch")
    assert _choose("dequantize", "awq").method == "dequantize"


@pytest.mark.parametrize("requested, fmt, message", [
    ("awq", "gptq", r"'awq' needs an AWQ checkpoint .*this checkpoint is GPTQ"),
    ("gptq", None, r"'gptq' needs a GPTQ checkpoint .*this checkpoint is not quantized"),
    ("awq", "gguf", r"'awq' needs an AWQ checkpoint .*this checkpoint is GGUF"),
    ("gguf", "awq", r"'gguf' needs a \.gguf model; this checkpoint is AWQ"),
])
def test_a_method_that_is_not_the_checkpoints_names_both(requested, fmt, message):
    with pytest.raises(ValueError, match=rf"^quantization: {message}"):
        _choose(requested, fmt)


def test_the_format_comes_from_config_json_checked_up_front(tmp_path):
    assert checkpoint_format_of(str(tmp_path)) is None  # no config.json
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    assert checkpoint_format_of(str(tmp_path)) is None
    qc = {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False}
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": qc}))
    assert checkpoint_format_of(str(tmp_path)) == "gptq"
    qc["desc_act"] = True
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": qc}))
    with pytest.raises(ValueError, match=r"^quantization_config\.desc_act: True is not "
                                         r"supported \(supported: false"):
        checkpoint_format_of(str(tmp_path))
