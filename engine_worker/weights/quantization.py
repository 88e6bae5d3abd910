"""How a quantized checkpoint runs: the ``quantization`` engine argument (vLLM's name) resolved
against the checkpoint's format and the kernels the backend has, once at start.

- ``auto`` (default): the checkpoint's own format runs natively where the backend has kernels
  for it; else its weights are de-quantized at load, and the start block says why.
- ``gguf``: a GGUF checkpoint's block-quantized linear weights run natively, or the engine
  does not start (the error names what is missing).
- ``awq`` / ``gptq``: a 4-bit AWQ or GPTQ safetensors checkpoint's linear weights run natively
  (``weights.int4_choice``), or the engine does not start.
- ``dequantize``: every weight is widened to ``dtype`` at load (the path before native kernels;
  kept for comparison and for formats without a kernel).

The method is part of the engine's cache identity (``GetModelInfo.quantization``): a 4-bit and
a bf16 engine of one model compute different K/V, so a router never shares prefixes between them.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine_worker.config import QUANTIZATION_NAMES as QUANTIZATION_CHOICES
from engine_worker.weights.int4_checkpoint import INT4_METHODS

# What ``QuantizationChoice.method`` can be: the three ways the weights can be held.
METHOD_GGUF = "gguf"  # GGUF blocks kept as stored, multiplied natively
METHOD_DEQUANTIZE = "dequantize"  # a quantized checkpoint widened to dtype at load
METHOD_NONE = "none"  # a float checkpoint: nothing to de-quantize
# (and "awq" / "gptq": a 4-bit safetensors checkpoint's packed weights multiplied natively)


@dataclass(frozen=True, slots=True)
class QuantizationChoice:
    """What runs (``method``), why (``reason``), and whether a tensor type without a kernel
    must stop the start (``strict``: ``gguf`` was asked for by name) or be de-quantized."""

    method: str
    reason: str
    strict: bool = False
    loud: bool = False  # a native format that could not run natively: said as a warning

    @property
    def native(self) -> bool:
        return self.method == METHOD_GGUF

    def describe(self) -> str:
        return f"{self.method}: {self.reason}"


def choose_quantization(requested: str, *, checkpoint_format: str | None,
                        backend: str, native_types: frozenset[str]) -> QuantizationChoice:
    """``requested``: one of ``QUANTIZATION_CHOICES``; ``checkpoint_format``: ``"gguf"`` for a
    GGUF file, ``"awq"`` / ``"gptq"`` for those checkpoints, None for a float checkpoint;
    ``native_types``: the GGUF types ``backend`` (its registry name) multiplies natively.
    Raises ValueError naming ``quantization``."""
    if requested not in QUANTIZATION_CHOICES:
        raise ValueError(f"quantization: must be one of {QUANTIZATION_CHOICES}, "
                         f"got {requested!r}")
    if checkpoint_format in INT4_METHODS or requested in INT4_METHODS:
        from engine_worker.weights.int4_choice import choose_int4  # it builds our choice type

        return choose_int4(requested, checkpoint_format=checkpoint_format, backend=backend,
                           native_types=native_types)
    if checkpoint_format is None:
        if requested == "gguf":
            raise ValueError("quantization: 'gguf' needs a .gguf model (the embedded model or "
                             "a path to a .gguf file); this checkpoint is not quantized")
        return QuantizationChoice(METHOD_NONE, "the checkpoint is not quantized")
    if requested == "dequantize":
        return QuantizationChoice(METHOD_DEQUANTIZE, "requested (quantization=dequantize): "
                                  "weights widened to dtype at load")
    if native_types:
        types = ", ".join(sorted(native_types))
        how = "requested (quantization=gguf)" if requested == "gguf" else \
            "the checkpoint's own format runs natively"
        return QuantizationChoice(METHOD_GGUF, f"{how}; {backend} kernels for {types}",
                                  strict=requested == "gguf")
    if requested == "gguf":
        raise ValueError(f"quantization: 'gguf' needs kernels that multiply GGUF blocks "
                         f"natively (kernels=cpu or cpu-avx2); the {backend} backend has none")
    return QuantizationChoice(METHOD_DEQUANTIZE, f"the {backend} backend has no GGUF kernels: "
                              "weights widened to dtype at load", loud=True)
