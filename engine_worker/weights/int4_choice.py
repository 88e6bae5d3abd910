"""The ``quantization`` choice where an AWQ or GPTQ checkpoint, or ``awq`` / ``gptq`` by name,
is involved (``weights.quantization.choose_quantization`` hands these cases here).

Native where the backend multiplies a 4-bit layout (``weights.int4_layouts.int4_layout``: the
CPU sets through their GGUF Q4_0 / Q4_1 kernels, Triton through its int4 group kernel); under
``auto`` a backend without one de-quantizes, loudly; ``awq`` / ``gptq`` by name never do.
"""

from __future__ import annotations

import json
from pathlib import Path

from engine_worker.weights.int4_checkpoint import parse_int4_config
from engine_worker.weights.int4_layouts import LAYOUT_GGUF_BLOCKS, int4_layout
from engine_worker.weights.quantization import METHOD_DEQUANTIZE, QuantizationChoice
from engine_worker.weights.resolve import gguf_path_of

_ARTICLE = {"awq": "an", "gptq": "a"}
_HOW = {LAYOUT_GGUF_BLOCKS: "repacked at load into GGUF Q4_0/Q4_1 blocks for the CPU kernels",
        "int4-groups": "multiplied by the Triton int4 kernel"}


def _what(checkpoint_format: str | None) -> str:
    if checkpoint_format is None:
        return "this checkpoint is not quantized"
    return f"this checkpoint is {checkpoint_format.upper()}"


def choose_int4(requested: str, *, checkpoint_format: str | None, backend: str,
                native_types: frozenset[str]) -> QuantizationChoice:
    """``checkpoint_format`` is "awq" / "gptq" / "gguf" / None; ``requested`` was checked to be
    a ``quantization`` name. Raises ValueError naming ``quantization``."""
    if requested in ("awq", "gptq") and checkpoint_format != requested:
        raise ValueError(
            f"quantization: {requested!r} needs {_ARTICLE[requested]} {requested.upper()} "
            f"checkpoint (config.json "
            f"with quantization_config.quant_method {requested!r}); {_what(checkpoint_format)}")
    if requested == "gguf":
        raise ValueError("quantization: 'gguf' needs a .gguf model; "
                         f"{_what(checkpoint_format)} (use auto or {checkpoint_format!r})")
    if requested == "dequantize":
        return QuantizationChoice(METHOD_DEQUANTIZE, "requested (quantization=dequantize): "
                                  "weights widened to dtype at load")
    layout = int4_layout(native_types)
    if layout is not None:
        how = (f"requested (quantization={requested})" if requested != "auto"
               else "the checkpoint's own format runs natively")
        return QuantizationChoice(checkpoint_format, f"{how}; 4-bit weights {_HOW[layout]}",
                                  strict=requested != "auto")
    if requested != "auto":
        raise ValueError(f"quantization: {requested!r} needs 4-bit kernels (kernels=cpu, "
                         f"cpu-avx2 or triton); the {backend} backend has none")
    return QuantizationChoice(METHOD_DEQUANTIZE, f"the {backend} backend has no 4-bit kernels: "
                              "weights widened to dtype at load", loud=True)


def checkpoint_format_of(model: str | None) -> str | None:
    """"gguf" for a GGUF model, "awq" / "gptq" for a local checkpoint whose config.json says so
    (its ``quantization_config`` checked here, before anything loads), else None."""
    if gguf_path_of(model) is not None:
        return "gguf"
    config = Path(model).expanduser() / "config.json" if model else None
    if config is None or not config.is_file():
        return None
    try:
        hf_config = json.loads(config.read_text())
    except (OSError, ValueError):
        return None  # the loader reports a config it cannot read
    cfg = parse_int4_config(hf_config)
    return None if cfg is None else cfg.method
