"""How each instruction set's kernels run a linear layer: the weight layout packed once at load,
the call a step, and what the one-call decoder stack takes for the layer. The variants share
every other op (``backends.cpu``); their linear layers are each set's own (``csrc/cpu/<isa>/``).

- ``SKINNY_BF16`` (AVX-512 BF16): up to 8 rows through the skinny kernel, which streams a bf16
  weight in row groups (exponent-coded where it can be, a quarter fewer bytes), more rows
  through oneDNN's blocked bf16 layout; the stack's activations are bf16.
- ``PANELS_BF16`` (AVX2): CPUs without bf16 arithmetic, where torch's bf16 matmul is emulated
  and unusably slow, never call it: a bf16 weight is packed in panels of 16 output columns and
  multiplied in fp32 by ``linear_bf16w`` (half the bytes of an fp32 weight, which is what a
  decode step's time is made of); an fp32 weight stays with torch's fp32 matmul; the stack's
  activations are fp32 whatever the weights (a bf16 model keeps its residual stream in fp32
  there and its KV cache in bf16).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from engine_worker.backends.base import LinearWeights
from engine_worker.platform import to_huge_pages

# GGUF block types csrc/cpu/quant_linear.cpp multiplies as stored, by their block bytes
GGUF_BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34,
                    "Q4_K": 144, "Q5_K": 176, "Q6_K": 210}  # the k-quants: 256 weights a block
GGUF_NATIVE_TYPES = frozenset(GGUF_BLOCK_BYTES)
K_QUANT_BLOCK_BYTES = frozenset({144, 176, 210})  # the file's k-quant blocks: 256 weights each
Q4_BLOCK_BYTES = frozenset({18, 20})  # Q4_0, Q4_1: the grouped int8 kernel's 4-bit types

SKINNY_MAX_ROWS = 8  # up to here a linear layer is a weight stream: the bf16 kernel wins
NO_ROW_LIMIT = 2 ** 62  # quant_int8_rows from here: the int8 kernel takes every row count
# A tied Q8_0 table's rows on the int8 kernel before its bf16 twin takes over, on a full-width
# AVX-512 BF16 datapath (AMD Zen 5). SmolLM2's 49152 x 576 table from memory (four copies
# cycled, medians of 7, 2 threads, Zen 5 f26 m2), int8 / twin: 9 rows 0.83 / 1.65 ms, 16 rows
# 1.14 / 1.99, 32 rows 2.15 / 2.84, 64 rows 4.05 / 4.63, 128 rows 7.78 / 8.15, 256 rows 15.81
# / 15.80, 512 rows 44.3 / 44.9; from cache the twin is ahead from 512 rows (30.7 against 43.4
# ms; docs/benchmarks/q4-linears-zen5-s61-2026-12-07.json, `after_prefetch`).
FULL_WIDTH_TABLE_INT8_ROWS = 256
SKINNY_SLICE = 32  # the skinny kernel's input columns a step: in_features a multiple of this
PANEL_COLUMNS = 16  # pack_bf16w's panels: output columns in multiples of this


@dataclass(frozen=True, slots=True)
class CpuPackedWeight:
    """A bf16 weight in the two layouts the AVX-512 path streams: oneDNN's blocked one for many
    rows, and for the skinny kernel (up to 8 rows) row groups interleaved per 32-wide slice,
    one sequential stream per thread (~28 GB/s here against ~18 for the plain layout). The
    skinny layout is exponent-coded where every row uses at most 16 exponents (12 bits a
    weight, decoded losslessly in the kernel: a quarter fewer bytes a decode step; see
    csrc/cpu/avx512/linear.cpp), else plain bf16."""

    onednn: torch.Tensor | None
    skinny: torch.Tensor | None


@dataclass(frozen=True, slots=True)
class PanelPackedWeight:
    """A bf16 weight as ``linear_bf16w`` streams it: bf16 [out / 16, in, 16]."""

    panels: torch.Tensor


def is_gguf_blocks(weight: torch.Tensor) -> bool:
    """A GGUF block-quantized weight as the loader keeps it: uint8 [N, K / 32, block bytes]."""
    return weight.dtype == torch.uint8 and weight.dim() == 3 and \
        weight.shape[2] in GGUF_BLOCK_BYTES.values()


@dataclass(frozen=True, slots=True)
class GgufBlocks:
    """A GGUF block-quantized weight as every CPU set's ``quant_linear`` streams it: the file's
    bytes (4.5 to 8.5 bits a weight) regrouped row by row, scales before quants
    (``repack_gguf``, csrc/cpu/quant_linear.cpp), on huge pages."""

    blocks: torch.Tensor  # int8 [out_features, in_features / 32, block bytes], repacked
    # Where the model holds the weight's exact de-quantized values anyway (a tied embedding
    # table: SmolLM2's logits are its Q8_0 embedding, 49152 x 576): calls with more rows of x
    # than ``int8_rows`` (of ``int8_dtype``) multiply those, in the set's packed layout
    # (``dense``), instead of de-quantizing 28M weights every batched step. ``int8_rows`` is
    # the blocks' own limit (``quant_int8_rows``), or fewer where the caller says (``of``'s
    # ``twin_rows``: SKINNY_MAX_ROWS on AMX tiles, FULL_WIDTH_TABLE_INT8_ROWS on a Zen 5).
    # Without twins and with VNNI (Zen 4) the int8 kernel
    # wins at every size (the table 49152 x 576, 2 threads: 64 to 4096 rows 1.23-1.41x
    # oneDNN on the packed table; csrc/cpu/quant_linear.cpp, kVnniRows).
    dense_weight: torch.Tensor | None = None
    dense: Any = None
    int8_rows: int = 0
    int8_dtype: torch.dtype | None = None
    # On a CPU whose oneDNN runs on AMX tiles: the weight de-quantized once at load into oneDNN's
    # bf16 layout (``tile_twin``), which bf16 calls of more than SKINNY_MAX_ROWS rows multiply (the
    # fused stack too) while up to that many rows stream the blocks; a Q4_0 / Q4_1 weight's blocks
    # serve up to ``quant_tile_rows`` (128) rows there (the int8 kernel, then de-quantized into
    # tiles: csrc/cpu/avx512/quant_amx.h), the twin only past them. Measured on a 2-core Xeon with
    # AMX, SmolLM2's four linears of a layer in Q4_1, 2 threads: 16 rows 0.57 ms on the int8 kernel
    # against 0.49 on the tiles, 64 rows 2.3 against 0.9, 512 rows 18.5 against 6.7 (de-quantizing
    # every call instead costs 1.8 ms more a layer). On a full-width AVX-512 BF16 datapath (AMD
    # Zen 5) every type but Q4_0 / Q4_1 keeps one (backends/cpu.CpuOps._twin_pays).
    tile_twin: torch.Tensor | None = None

    @staticmethod
    def repacked(ops: Any, weight: torch.Tensor) -> torch.Tensor:
        """The file's blocks as the kernels stream them (``repack_gguf``), on huge pages."""
        return to_huge_pages(ops.repack_gguf(weight.detach().contiguous()))

    @staticmethod
    def of(ops: Any, weight: torch.Tensor, dense: torch.Tensor | None = None,
           linear: Any = None, twin_rows: int | None = None) -> GgufBlocks:
        blocks = GgufBlocks.repacked(ops, weight)
        # the twin is the same matrix (the loader reads both from one tensor): its rows
        if dense is None or linear is None or dense.dim() != 2 or dense.shape[0] != weight.shape[0]:
            return GgufBlocks(blocks)
        dtype = linear.activation_dtype
        rows = int(ops.quant_int8_rows(blocks, dtype))
        rows = rows if twin_rows is None else min(twin_rows, rows)
        if rows >= NO_ROW_LIMIT and dense.dtype == dtype:
            # the blocks take every row count of x in the table's dtype, the model's (VNNI
            # without twins); an fp32 model's x has the decode rows' limit and keeps its twin
            return GgufBlocks(blocks)
        return GgufBlocks(blocks, dense.detach(), linear.pack_twin(ops, dense.detach()), rows,
                          dtype)

    @staticmethod
    def with_tile_twin(ops: Any, weight: torch.Tensor) -> GgufBlocks:
        """The blocks and their bf16 tile twin (``tile_twin``): oneDNN's packed layout of the
        exact de-quantized values, made from the repacked blocks and kept alone."""
        blocks = GgufBlocks.repacked(ops, weight)
        twin = torch.ops.mkldnn._reorder_linear_weight(
            ops.dequantize_weight(blocks, torch.bfloat16), None)
        return GgufBlocks(blocks, tile_twin=twin)

    def takes_dense(self, ops: Any, x: torch.Tensor) -> bool:
        """Whether this call multiplies the dense twin: more rows than the blocks' int8 path
        takes, and on AMX tiles more bf16 rows than a Q4_0 / Q4_1 weight's blocks serve there
        (``quant_tile_rows``; 0 elsewhere)."""
        if (self.tile_twin is None and self.dense_weight is None) or \
                x.shape[0] <= SKINNY_MAX_ROWS:  # (no op call on a decode's path)
            return False
        if x.dtype == torch.bfloat16 and x.shape[0] <= int(ops.quant_tile_rows(self.blocks)):
            return False
        if self.tile_twin is not None:
            return x.dtype == torch.bfloat16
        rows = self.int8_rows if x.dtype == self.int8_dtype else \
            int(ops.quant_int8_rows(self.blocks, x.dtype))
        return x.shape[0] > rows


class SkinnyBf16Linear:
    """The AVX-512 set's linear layers (``skinny_linear_packed``, oneDNN)."""

    activation_dtype = torch.bfloat16

    @staticmethod
    def pack(ops: Any, weight: torch.Tensor, skinny: bool = True) -> CpuPackedWeight | None:
        """Once per weight at load. oneDNN's layout: F.linear would re-lay the plain weight out
        on every call (10-45 % of a decode-sized matmul here). ``skinny``: the skinny kernel's
        layout too (pack_twin leaves it out)."""
        if weight.dtype != torch.bfloat16:
            return None
        # oneDNN's bf16 needs AVX-512 BW/VL/DQ (or AVX-NE-CONVERT) in the CPU itself; without
        # it (the emulated AVX-512 kernels in the tests) more rows go through F.linear
        onednn_bf16 = torch.backends.mkldnn.is_available() and \
            torch.ops.mkldnn._is_mkldnn_bf16_supported()
        onednn = torch.ops.mkldnn._reorder_linear_weight(weight, None) if onednn_bf16 else None
        out_features, in_features = weight.shape
        few = None
        if skinny and out_features % 4 == 0 and in_features % SKINNY_SLICE == 0:
            few = ops.pack_coded(weight)
            if few.numel() == 0:  # a row with more than 16 exponents
                few = ops.pack_skinny(weight)
            # what decode streams every step: on huge pages (platform.py)
            few = to_huge_pages(few)
        return CpuPackedWeight(onednn, few)

    @staticmethod
    def pack_twin(ops: Any, weight: torch.Tensor) -> CpuPackedWeight | None:
        """A GGUF weight's de-quantized twin (GgufBlocks.of): only oneDNN's layout, as the
        twin takes only rows past the blocks' int8 rows (at least SKINNY_MAX_ROWS), never the
        skinny kernel's (SmolLM2's tied table: 42 MB less)."""
        return SkinnyBf16Linear.pack(ops, weight, skinny=False)

    @staticmethod
    def linear(ops: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
               packed: CpuPackedWeight | None) -> torch.Tensor:
        # x: [num_tokens, in_features]; more rows go to oneDNN, which reuses each weight load
        if x.shape[0] <= SKINNY_MAX_ROWS and x.dtype == torch.bfloat16 \
                and x.shape[1] % SKINNY_SLICE == 0:
            if packed is not None and packed.skinny is not None:
                return ops.skinny_linear_packed(x, packed.skinny, bias)
            return ops.skinny_linear(x, weight, bias)
        if packed is not None and packed.onednn is not None:
            return torch.ops.mkldnn._linear_pointwise(x, packed.onednn, bias, "none", [], "")
        return F.linear(x, weight, bias)

    @staticmethod
    def stack_weights(lin: LinearWeights) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The layer's weights for up to 8 rows and for more: both packed layouts, or None (not
        bf16, or a shape the skinny kernel does not take)."""
        packed = lin.packed
        if packed is None or packed.skinny is None or packed.onednn is None:
            return None
        return packed.skinny, packed.onednn


class PanelBf16Linear:
    """The AVX2 set's linear layers (``linear_bf16w`` on bf16 panels; fp32 through torch)."""

    activation_dtype = torch.float32

    @staticmethod
    def pack(ops: Any, weight: torch.Tensor) -> PanelPackedWeight | None:
        """Once per weight at load: bf16 weights whose output size the panels divide."""
        if weight.dtype != torch.bfloat16 or weight.shape[0] % PANEL_COLUMNS:
            return None
        return PanelPackedWeight(to_huge_pages(ops.pack_bf16w(weight.detach())))

    # a GGUF weight's de-quantized twin (GgufBlocks.of): the panels, which every row count
    # multiplies
    pack_twin = pack

    @staticmethod
    def linear(ops: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
               packed: PanelPackedWeight | None) -> torch.Tensor:
        # x: [num_tokens, in_features] -> [num_tokens, out_features] in x's dtype
        if packed is None:
            return F.linear(x, weight, bias)
        out = ops.linear_bf16w(x.float(), packed.panels, None if bias is None else bias.float())
        return out.to(x.dtype)

    @staticmethod
    def stack_weights(lin: LinearWeights) -> tuple[torch.Tensor, torch.Tensor] | None:
        """One tensor serves both row counts: the panels, or an fp32 weight; else None."""
        if lin.packed is not None:
            return lin.packed.panels, lin.packed.panels
        if lin.weight.dtype == torch.float32:
            return lin.weight.detach(), lin.weight.detach()
        return None


SKINNY_BF16 = SkinnyBf16Linear()
PANELS_BF16 = PanelBf16Linear()
