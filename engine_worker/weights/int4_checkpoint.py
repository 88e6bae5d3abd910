"""AWQ and GPTQ 4-bit safetensors checkpoints as transformers writes them: the
``quantization_config`` of config.json read and checked, and each quantized linear layer's
``qweight`` / ``qzeros`` / ``scales`` (/ ``g_idx``) unpacked into one neutral form, ``Int4Groups``
(codes, zero points and scales per group of input columns), from which the backends' layouts
(``weights.int4_layouts``) and the fp32 reference de-quantization are made.

The two packings (K = in_features, N = out_features, G = K / group_size groups; eight 4-bit
codes an int32, code i at bits 4i..4i+3):

- AWQ, GEMM version (AutoAWQ's ``WQLinear_GEMM``): ``qweight`` int32 [K, N / 8] and ``qzeros``
  int32 [G, N / 8] packed along the *output* columns in AutoAWQ's interleaved order: code i of
  word c is column ``8c + (0, 2, 4, 6, 1, 3, 5, 7)[i]`` (unpacked, column j of the eight is code
  ``(0, 4, 1, 5, 2, 6, 3, 7)[j]``: AutoAWQ's ``AWQ_REVERSE_ORDER``); ``scales`` fp16 [G, N].
  w[n, k] = (q - z) * s with q, z, s of k's group.
- GPTQ (AutoGPTQ / optimum / GPTQModel): ``qweight`` int32 [K / 8, N] packed along the *input*
  rows in order (row 8r + i is code i of word r), ``qzeros`` int32 [G, N / 8] packed along the
  output columns in order, ``scales`` fp16 [G, N], ``g_idx`` int32 [K] (k's group). The
  original format (``checkpoint_format`` "gptq", the default) stores each zero point minus one
  and adds the one back when unpacking (so a stored 15 reads as 16); "gptq_v2" stores it as is.
  Symmetric checkpoints have every zero point 8. w[n, k] = (q - z) * s.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

# AutoAWQ's packing order: code i of a word holds column AWQ_ORDER[i] of its eight
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
AWQ_REVERSE_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)  # column j of the eight is code AWQ_REVERSE_ORDER[j]
INT4_METHODS = ("awq", "gptq")
SUPPORTED_BITS = (4,)
GROUP_MULTIPLE = 32  # a group splits into the CPU kernels' blocks of 32
GPTQ_FORMATS = ("gptq", "gptq_v2")
_SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)  # code i of a word at bits 4i..4i+3


@dataclass(frozen=True, slots=True)
class Int4Config:
    """A checkpoint's ``quantization_config``, checked: what every layer's tensors mean."""

    method: str  # "awq" | "gptq"
    bits: int
    group_size: int  # input columns a scale and zero point cover; -1: all of them
    zero_point_offset: int  # added to a stored zero point (1 for the original GPTQ format)

    def groups(self, in_features: int) -> int:
        return 1 if self.group_size == -1 else in_features // self.group_size

    def describe(self) -> str:
        group = "per channel" if self.group_size == -1 else f"group size {self.group_size}"
        return f"{self.method.upper()} {self.bits}-bit, {group}"


def _field_error(field: str, value: Any, supported: str) -> ValueError:
    return ValueError(f"quantization_config.{field}: {value!r} is not supported "
                      f"(supported: {supported})")


def checkpoint_int4_method(hf_config: dict[str, Any]) -> str | None:
    """"awq" or "gptq" where config.json's ``quantization_config`` names one, else None."""
    qc = hf_config.get("quantization_config")
    if not isinstance(qc, dict):
        return None
    method = str(qc.get("quant_method", "")).lower()
    return method if method in INT4_METHODS else None


def parse_int4_config(hf_config: dict[str, Any]) -> Int4Config | None:
    """The checked ``quantization_config`` of an AWQ or GPTQ checkpoint (None for any other);
    a value we cannot run raises ValueError naming the field and what is supported."""
    method = checkpoint_int4_method(hf_config)
    if method is None:
        return None
    qc = hf_config["quantization_config"]
    bits = int(qc.get("bits", qc.get("w_bit", 4)))
    if bits not in SUPPORTED_BITS:
        raise _field_error("bits", bits, "4")
    group_size = int(qc.get("group_size", qc.get("q_group_size", 128)))
    if group_size != -1 and (group_size <= 0 or group_size % GROUP_MULTIPLE):
        raise _field_error("group_size", group_size,
                           f"a positive multiple of {GROUP_MULTIPLE} such as 128, or -1")
    offset = 0
    if method == "awq":
        version = str(qc.get("version", "gemm")).lower()
        if version != "gemm":
            raise _field_error("version", qc.get("version"), "'gemm'")
        if not qc.get("zero_point", True):
            raise _field_error("zero_point", qc.get("zero_point"), "true")
    else:
        if qc.get("desc_act", False):
            raise _field_error("desc_act", qc.get("desc_act"),
                               "false (act-order reorders input columns per group)")
        fmt = str(qc.get("checkpoint_format", "gptq")).lower()
        if fmt not in GPTQ_FORMATS:
            raise _field_error("checkpoint_format", qc.get("checkpoint_format"),
                               ", ".join(GPTQ_FORMATS))
        offset = 1 if fmt == "gptq" else 0
    return Int4Config(method, bits, group_size, offset)


@dataclass(frozen=True, slots=True)
class Int4Groups:
    """One linear layer's weight in neutral form: w[n, k] = (codes - zeros[g]) * scales[g] for
    g = k // group_size (rows n = output features, as nn.Linear's weight)."""

    codes: torch.Tensor  # uint8 [N, K], 0..15
    zeros: torch.Tensor  # uint8 [N, G], 0..16 (16: the original GPTQ format's stored 15)
    scales: torch.Tensor  # the checkpoint's dtype (fp16) [N, G]

    @property
    def group_size(self) -> int:
        return self.codes.shape[1] // self.zeros.shape[1]

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The reference: [N, K] in ``dtype``, computed in fp32."""
        g = self.group_size
        codes = self.codes.float().view(self.codes.shape[0], -1, g)
        w = (codes - self.zeros.float()[:, :, None]) * self.scales.float()[:, :, None]
        return w.reshape(self.codes.shape).to(dtype)


def _unpack_codes(words: torch.Tensor) -> torch.Tensor:
    """int32 [..., W] -> uint8 [..., W, 8]: code i of each word in place i."""
    return ((words.to(torch.int32)[..., None] >> _SHIFTS) & 0xF).to(torch.uint8)


def _check_shape(name: str, tensor: torch.Tensor, shape: tuple[int, ...]) -> None:
    if tuple(tensor.shape) != shape:
        raise ValueError(f"model: quantized tensor {name} has shape {tuple(tensor.shape)}, "
                         f"expected {shape} from the quantization_config and its qweight")


def unpack_awq(prefix: str, tensors: dict[str, torch.Tensor], cfg: Int4Config) -> Int4Groups:
    """``prefix``.qweight / qzeros / scales (AutoAWQ GEMM packing) as ``Int4Groups``."""
    qweight, qzeros, scales = (tensors[f"{prefix}.{p}"] for p in ("qweight", "qzeros", "scales"))
    in_features, out_features = qweight.shape[0], qweight.shape[1] * 8
    groups = cfg.groups(in_features)
    _check_shape(f"{prefix}.qzeros", qzeros, (groups, out_features // 8))
    _check_shape(f"{prefix}.scales", scales, (groups, out_features))
    order = torch.tensor(AWQ_REVERSE_ORDER)
    # [K, N / 8, 8] codes in packing order -> column order -> [N, K]
    codes = _unpack_codes(qweight)[..., order].reshape(in_features, out_features).t()
    zeros = _unpack_codes(qzeros)[..., order].reshape(groups, out_features).t()
    return Int4Groups(codes.contiguous(), zeros.contiguous(), scales.t().contiguous())


def unpack_gptq(prefix: str, tensors: dict[str, torch.Tensor], cfg: Int4Config) -> Int4Groups:
    """``prefix``.qweight / qzeros / scales / g_idx (GPTQ packing) as ``Int4Groups``; a
    ``g_idx`` other than k // group_size (act-order) is refused."""
    qweight, qzeros, scales = (tensors[f"{prefix}.{p}"] for p in ("qweight", "qzeros", "scales"))
    in_features, out_features = qweight.shape[0] * 8, qweight.shape[1]
    groups = cfg.groups(in_features)
    _check_shape(f"{prefix}.qzeros", qzeros, (groups, out_features // 8))
    _check_shape(f"{prefix}.scales", scales, (groups, out_features))
    g_idx = tensors.get(f"{prefix}.g_idx")
    if g_idx is not None:
        group = in_features if cfg.group_size == -1 else cfg.group_size
        expected = torch.arange(in_features) // group
        if not torch.equal(g_idx.to(torch.int64), expected):
            raise ValueError(f"model: {prefix}.g_idx is not k // group_size: the checkpoint "
                             "reorders input columns (desc_act true), which is not supported")
    # [K / 8, 8, N]: row 8r + i is code i of word r
    codes = _unpack_codes(qweight.t()).reshape(out_features, in_features)
    zeros = _unpack_codes(qzeros).reshape(groups, out_features).t()
    zeros = zeros + cfg.zero_point_offset  # the original format's zero - 1 (15 reads as 16)
    return Int4Groups(codes.contiguous(), zeros.contiguous(), scales.t().contiguous())


UNPACK = {"awq": unpack_awq, "gptq": unpack_gptq}
QUANTIZED_PARTS = ("qweight", "qzeros", "scales", "g_idx")


def int4_layers(tensors: dict[str, torch.Tensor], cfg: Int4Config) -> dict[str, Int4Groups]:
    """Every quantized layer of a checkpoint's tensors (names as read, ``model.`` stripped), by
    its prefix; the layer's packed tensors are removed from ``tensors``."""
    prefixes = [name.removesuffix(".qweight") for name in tensors if name.endswith(".qweight")]
    layers = {}
    for prefix in prefixes:
        missing = [p for p in ("qzeros", "scales") if f"{prefix}.{p}" not in tensors]
        if missing:
            raise ValueError(f"model: quantized layer {prefix} lacks {', '.join(missing)}")
        layers[prefix] = UNPACK[cfg.method](prefix, tensors, cfg)
        for part in QUANTIZED_PARTS:
            tensors.pop(f"{prefix}.{part}", None)
    return layers
