"""AWQ / GPTQ layers (``Int4Groups``) in the layouts the backends multiply natively, made once
at load; the backend's ``quantized_types`` says which it takes.

- ``gguf-blocks`` (the CPU sets: csrc/cpu/quant_linear.cpp's Q4_0 / Q4_1 kernels). A group of
  G input columns is G / 32 GGUF blocks, each with the group's scale and offset:
  Q4_0 ``d * (q - 8)`` where every zero point of the checkpoint is 8 (symmetric GPTQ): exact;
  Q4_1 ``d * q + m`` with ``m = -d * z`` otherwise. Q4_1 stores m as fp16, and d * z (an fp16
  scale times a 4-bit integer) needs up to 15 significant bits: m is rounded to fp16, an error of
  at most 2^-11 |d z| <= 0.008 d per weight, constant over the block (against the 0.5 d of the
  4-bit rounding itself). An exact layout needs a block type whose offset is the integer zero
  point (``d * (q - z)``, z a nibble a block; the Q4_0 kernel's ``-8 d`` term with z for 8) or
  an fp32 m; neither is a GGUF type, so the kernels do not have it yet.
- ``int4-groups`` (the Triton kernel, ``backends/triton_int4_kernel.py``): int32
  [N, G, group_size / 8 + 1]: for output row n and group g, the group's codes packed eight a
  word in input order (code i of a word at bits 4i, GPTQ's order along K), then one header
  word: the fp16 scale's bits (low 16) and the zero point (bits 16..23). One tensor a layer, so
  it stands in for the weight parameter as GGUF blocks do; the kernel multiplies the integer
  codes minus zero by x and scales each group's partial sum once: the weights are exact.
"""

from __future__ import annotations

import torch

from engine_worker.weights.int4_checkpoint import Int4Groups

LAYOUT_GGUF_BLOCKS = "gguf-blocks"
LAYOUT_INT4_GROUPS = "int4-groups"
INT4_GROUPS_TYPE = "INT4_GROUPS"  # in a backend's quantized_types: it takes LAYOUT_INT4_GROUPS
_GGUF_4BIT = frozenset({"Q4_0", "Q4_1"})
GGUF_BLOCK = 32
SYMMETRIC_ZERO = 8  # Q4_0's fixed offset


def int4_layout(quantized_types: frozenset[str]) -> str | None:
    """The layout a backend taking ``quantized_types`` multiplies AWQ / GPTQ weights in."""
    if INT4_GROUPS_TYPE in quantized_types:
        return LAYOUT_INT4_GROUPS
    if _GGUF_4BIT <= quantized_types:
        return LAYOUT_GGUF_BLOCKS
    return None


def _fp16_bytes(values: torch.Tensor) -> torch.Tensor:
    """fp16 [..] -> uint8 [.., 2] (little-endian, as GGUF stores it)."""
    return values.to(torch.float16).contiguous().view(torch.uint8).view(*values.shape, 2)


def to_gguf_blocks(layer: Int4Groups, symmetric: bool) -> torch.Tensor:
    """uint8 [N, K / 32, 18 (Q4_0) or 20 (Q4_1)], each block as ggml lays it out (the loader's
    form of GGUF weights). ``symmetric``: every zero point of the checkpoint is 8 (Q4_0)."""
    n, k = layer.codes.shape
    blocks_per_group = layer.group_size // GGUF_BLOCK
    # the group's scale (and offset) repeated for each of its blocks: [N, K / 32]
    scales = layer.scales.to(torch.float16).repeat_interleave(blocks_per_group, dim=1)
    codes = layer.codes.view(n, k // GGUF_BLOCK, 2, 16)
    quants = codes[:, :, 0] | (codes[:, :, 1] << 4)  # byte j: weight j low, weight j + 16 high
    if symmetric:
        return torch.cat([_fp16_bytes(scales), quants], dim=2).contiguous()
    zeros = layer.zeros.repeat_interleave(blocks_per_group, dim=1).float()
    mins = -(scales.float() * zeros)  # rounded to fp16 by _fp16_bytes: see the module doc
    return torch.cat([_fp16_bytes(scales), _fp16_bytes(mins), quants], dim=2).contiguous()


def to_int4_groups(layer: Int4Groups) -> torch.Tensor:
    """int32 [N, G, group_size / 8 + 1]: the Triton kernel's layout (module doc)."""
    n, k = layer.codes.shape
    groups = layer.zeros.shape[1]
    codes = layer.codes.to(torch.int32).view(n, groups, layer.group_size // 8, 8)
    shifts = torch.arange(0, 32, 4, dtype=torch.int32)
    words = (codes << shifts).sum(dim=-1, dtype=torch.int64)  # disjoint bits: sum == or
    words = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    scale_bits = layer.scales.to(torch.float16).contiguous().view(torch.int16).to(torch.int32)
    header = (scale_bits & 0xFFFF) | (layer.zeros.to(torch.int32) << 16)
    return torch.cat([words, header[:, :, None]], dim=2).contiguous()


def dequantize_int4_groups(packed: torch.Tensor,
                           dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``to_int4_groups``'s layout back to values [N, K] (the tests' and the reference's)."""
    n, groups, width = packed.shape
    words, header = packed[:, :, :-1], packed[:, :, -1]
    shifts = torch.arange(0, 32, 4, dtype=torch.int32)
    codes = ((words[..., None] >> shifts) & 0xF).reshape(n, groups, -1).float()
    scales = (header & 0xFFFF).to(torch.int16).view(torch.float16).float()
    zeros = ((header >> 16) & 0xFF).float()
    return ((codes - zeros[..., None]) * scales[..., None]).reshape(n, -1).to(dtype)


def is_int4_groups(weight: torch.Tensor) -> bool:
    return weight.dtype == torch.int32 and weight.dim() == 3


def pack_layers(layers: dict[str, Int4Groups], layout: str | None,
                dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Each layer's ``<prefix>.weight`` in ``layout``, or de-quantized to ``dtype`` (None)."""
    if layout is None:
        return {f"{p}.weight": layer.dequantize(dtype) for p, layer in layers.items()}
    if layout == LAYOUT_INT4_GROUPS:
        return {f"{p}.weight": to_int4_groups(layer) for p, layer in layers.items()}
    symmetric = all(bool((layer.zeros == SYMMETRIC_ZERO).all()) for layer in layers.values())
    return {f"{p}.weight": to_gguf_blocks(layer, symmetric) for p, layer in layers.items()}
