"""The CPU backends: the compiled kernels of ``csrc/cpu``, one backend per instruction-set
variant (``cpu``: AVX-512, ``cpu-avx2``), all made by ``make_cpu_backend`` from the variant's
loaded kernels (``engine_worker.ops.load``). The variants run the same op wrappers; what
differs between their kernels is data here (``ISA_PROFILES``: vector width, linear layers).

Each op is called where its shape and dtype rules hold and falls back to the reference
(``backends.reference``) elsewhere; tests compare every kernel with its reference. Paged
attention is one varlen call per layer covering the step's decodes and prefill chunks
together, reading K/V in place through the block tables. On a loaded model whose weights and
shapes the kernels take, every decoder layer runs in one ``llama_layers`` call a step.
"""

from __future__ import annotations

import functools
import logging
import operator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from engine_worker.attention.metadata import AttentionMetadata
from engine_worker.backends.base import Backend, BackendEntry, LayersFn, SamplingKernels
from engine_worker.backends.cpu_linear import (FULL_WIDTH_TABLE_INT8_ROWS, GGUF_NATIVE_TYPES,
                                               K_QUANT_BLOCK_BYTES, PANEL_COLUMNS, PANELS_BF16,
                                               Q4_BLOCK_BYTES, SKINNY_BF16, SKINNY_MAX_ROWS,
                                               GgufBlocks, is_gguf_blocks)
from engine_worker.backends.reference import TorchAttentionBackend
from engine_worker.layers.activation import silu_and_mul
from engine_worker.layers.norm import rms_norm
from engine_worker.layers.rotary import apply_rope
from engine_worker.ops import CpuKernels, CpuVariant, Unavailable, cannot_run_reason, load
from engine_worker.ops.cpu_isa import cpu_flags, cpu_vendor_family, full_width_bf16
from engine_worker.platform import available_memory_bytes, to_huge_pages
from engine_worker.progress import progress

if TYPE_CHECKING:
    from engine_worker.lora.slots import LoRABatch
    from engine_worker.models.llama import LlamaStack

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class IsaProfile:
    """What the op wrappers need to know of one instruction set's kernels."""

    lanes: int  # fp32 lanes of a vector (csrc/cpu/<isa>/simd.h): rows are multiples of it
    linear: Any  # its linear layers (backends.cpu_linear)


ISA_PROFILES: dict[str, IsaProfile] = {"avx512": IsaProfile(16, SKINNY_BF16),
                                       "avx2": IsaProfile(8, PANELS_BF16)}


def kernel_supports(head_dim: int) -> bool:
    """Head sizes the paged-attention kernel takes."""
    return head_dim % 16 == 0 and head_dim <= 512


class CpuOps:
    """The op wrappers of a CPU backend over one variant's kernels: each calls the kernel where
    the kernel's shape rules (csrc/cpu/elementwise.cpp) hold, the reference elsewhere."""

    __slots__ = ("ops", "lanes", "tiles", "twins", "_linear", "_twin_bytes_left",
                 "_twins_said")

    def __init__(self, kernels: CpuKernels) -> None:
        profile = ISA_PROFILES[kernels.isa]
        self.ops = kernels.ops
        self.lanes = profile.lanes
        self._linear = profile.linear
        # where oneDNN's bf16 matmuls outrun the int8 kernel past the decode rows (AMX tiles,
        # a full-width AVX-512 BF16 datapath: bf16_twins_reason), quantized layer weights get
        # bf16 twins (cpu_linear.GgufBlocks) while they fit in a quarter of the memory
        # available at load; the KV cache is sized after
        self.tiles = amx_tiles(kernels)  # the start block names them (make_cpu_backend)
        self.twins = bf16_twins_reason(kernels, self.tiles)
        self._twin_bytes_left = available_memory_bytes(torch.device("cpu")) // 4 \
            if self.twins else 0
        self._twins_said = False

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
               packed: Any) -> torch.Tensor:
        if isinstance(packed, GgufBlocks):  # every set runs them (csrc/cpu/quant_linear.cpp)
            if packed.takes_dense(self.ops, x):
                if packed.tile_twin is not None:
                    return torch.ops.mkldnn._linear_pointwise(x, packed.tile_twin, bias,
                                                              "none", [], "")
                return self._linear.linear(self.ops, x, packed.dense_weight, bias, packed.dense)
            return self.ops.quant_linear(x, packed.blocks, bias)
        return self._linear.linear(self.ops, x, weight, bias, packed)

    def logits(self, x: torch.Tensor, weight: torch.Tensor, packed: Any) -> torch.Tensor | None:
        """fp32 logits [rows, vocab] of GGUF blocks for decode rows, else None (Backend.logits
        widens the linear's). Up to SKINNY_MAX_ROWS every type's int8 kernel takes the rows
        (and no dense twin does: its rows start past them); past them quant_linear would
        de-quantize in x's dtype, fp32 here. x is widened first (its int8 rounding per block
        of 32 is the same), the model's dtype kept as the numerics, so the logits are the bf16
        call's before its rounding, and no second pass widens them (SmolLM2's Q8_0 logits, one
        request on a Zen 4: 20-25 us a step, 1.009-1.019x tok/s, medians of 16 alternating
        generates)."""
        if isinstance(packed, GgufBlocks) and x.shape[0] <= SKINNY_MAX_ROWS:
            return self.ops.quant_linear(x.float(), packed.blocks, None, x.dtype)
        return None

    def pack_weight(self, weight: torch.Tensor, dense: torch.Tensor | None = None) -> Any:
        if is_gguf_blocks(weight):
            if dense is None and self._twin_bytes_left > 0 and self._twin_pays(weight) and \
                    self._linear.activation_dtype == torch.bfloat16:  # oneDNN's tile twins
                twin_bytes = _dense_numel(weight) * 2  # bf16
                if twin_bytes <= self._twin_bytes_left:
                    if not self._twins_said:
                        logger.info("%s: each quantized layer weight is also kept "
                                    "de-quantized in oneDNN's bf16 layout (2 bytes a weight, up "
                                    "to %.1f GiB: a quarter of available memory) for steps of "
                                    "more than 8 rows; up to 8 rows stream the blocks",
                                    self.twins, self._twin_bytes_left / 2 ** 30)
                        self._twins_said = True
                    self._twin_bytes_left -= twin_bytes
                    return GgufBlocks.with_tile_twin(self.ops, weight)
                logger.warning("%s: no room left for a bf16 twin of a %s weight (a quarter "
                               "of available memory is spent): it and the weights after it "
                               "take the int8 kernel, and de-quantize on every call past its "
                               "rows", self.twins, tuple(weight.shape[:2]))
                self._twin_bytes_left = 0
            # a tied embedding's table (dense): past the decode rows on AMX tiles, past 256
            # rows on a full-width AVX-512 BF16 datapath (FULL_WIDTH_TABLE_INT8_ROWS)
            twin_rows = None if not self.twins else SKINNY_MAX_ROWS if self.tiles else \
                FULL_WIDTH_TABLE_INT8_ROWS
            return GgufBlocks.of(self.ops, weight, dense, self._linear, twin_rows)
        return self._linear.pack(self.ops, weight)

    def _twin_pays(self, weight: torch.Tensor) -> bool:
        """Whether a quantized layer weight keeps a bf16 twin where twins are kept: always on
        AMX tiles; on a full-width AVX-512 BF16 datapath (Zen 5) all but Q4_0 / Q4_1, whose
        grouped int8 kernel (csrc/cpu/quant_linear.cpp, dot_group_pair) outruns oneDNN's bf16
        matmul on the twin at every row count there. Measured on a 2-core Zen 5 (f26 m2), 30
        layers of SmolLM2's four Q4_1 linears cycled from memory, medians of 7, int8 / twin:
        9 rows 3.5 / 7.7 ms, 16 rows 5.0 / 9.2, 32 rows 8.7 / 13.2, 64 rows 14.7 / 21.3, 128
        rows 25.1 / 33.9; one layer in cache (scripts/quant_linear_bench.py), 1.29-2.15x at 9
        to 1,024 rows (docs/benchmarks/q4-linears-zen5-s61-2026-12-07.json). When the twins
        went in (24th session) the kernel was slower: 64 rows 0.85 ms a layer against the
        twin's 0.56. Q8_0 keeps its twin, for prefill chunks: the tied logits table is faster
        on it from cache past 256 rows (FULL_WIDTH_TABLE_INT8_ROWS)."""
        return self.tiles or weight.shape[2] not in Q4_BLOCK_BYTES

    def _stack_weights(self, lin, dtype: torch.dtype, model_dtype: torch.dtype
                       ) -> tuple[torch.Tensor, torch.Tensor] | None:
        if isinstance(lin.packed, GgufBlocks):  # the blocks for few rows; the twin, or them
            blocks = lin.packed.blocks
            if lin.packed.tile_twin is not None and dtype == torch.bfloat16:
                return blocks, lin.packed.tile_twin
            if self._linear is PANELS_BF16 and model_dtype == torch.bfloat16:
                if int(self.ops.quant_int8_rows(blocks, model_dtype)) > SKINNY_MAX_ROWS:
                    # the int8 kernel at every row count (told the model's dtype:
                    # OneCallLayers), the types it groups (csrc/cpu/quant_linear.cpp)
                    return blocks, blocks
                return blocks, self._panel_twin(blocks)
            return blocks, blocks
        return self._linear.stack_weights(lin)

    def _panel_twin(self, blocks: torch.Tensor) -> torch.Tensor:
        """The AVX2 set's twin of a bf16 model's k-quant layer weights (the types the int8
        kernel does not group): the weight de-quantized once into bf16 panels (``pack_bf16w``),
        which the stack multiplies past 8 rows, as the ``dequantize`` path multiplies its
        weights, instead of de-quantizing it into fp32 on every such call (the blocks
        themselves when the panels do not divide it or the budget, a quarter of available
        memory, is spent). Measured with the AVX2 kernels on a 2-core Zen 5 (Q4_1, before it
        took the int8 kernel past 8 rows): the 64 long-tailed requests at 95 output tok/s
        native against 160 on the bf16 path (0.59x) before the twins."""
        rows = blocks.shape[0]
        twin_bytes = _dense_numel(blocks) * 2
        if rows % PANEL_COLUMNS or twin_bytes > self._twin_bytes_left:
            if self._twin_bytes_left and rows % PANEL_COLUMNS == 0:
                logger.warning("%s: no room left for a bf16 twin of a %s weight (a quarter of "
                               "available memory is spent): it and the weights after it "
                               "de-quantize on every call past 8 rows", self.twins,
                               (rows, _dense_numel(blocks) // rows))
                self._twin_bytes_left = 0
            return blocks
        if not self._twins_said:
            logger.info("%s: each quantized layer weight is also kept de-quantized as bf16 "
                        "panels (2 bytes a weight, up to %.1f GiB: a quarter of available "
                        "memory) for steps of more than 8 rows; up to 8 rows stream the blocks",
                        self.twins, self._twin_bytes_left / 2 ** 30)
            self._twins_said = True
        self._twin_bytes_left -= twin_bytes
        return to_huge_pages(self.ops.pack_bf16w(self.ops.dequantize_weight(blocks,
                                                                            torch.bfloat16)))

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if x.dim() == 2 and x.shape[-1] % self.lanes == 0 and x.stride(1) == 1 \
                and weight.dtype == x.dtype:
            return self.ops.rms_norm(x, weight, eps)
        return rms_norm(x, weight, eps)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2 and x.shape[-1] % (2 * self.lanes) == 0 and x.is_contiguous():
            return self.ops.silu_and_mul(x)
        return silu_and_mul(x)

    @staticmethod
    def _rows_kernel_takes(logits: torch.Tensor) -> bool:
        return logits.dim() == 2 and logits.dtype == torch.float32 and \
            logits.stride(1) == 1 and logits.shape[1] > 0

    def argmax(self, logits: torch.Tensor) -> torch.Tensor:
        # torch's CPU argmax reads a row a value at a time: ~3.5 ms for 64 x 49,152 logits
        if self._rows_kernel_takes(logits):
            return self.ops.argmax_rows(logits)
        return logits.argmax(dim=-1)

    def draw(self, logits: torch.Tensor, temperature: torch.Tensor,
             u: torch.Tensor) -> torch.Tensor | None:
        if self._rows_kernel_takes(logits) and temperature.dtype == torch.float32 and \
                u.dtype == torch.float64:
            return self.ops.draw_rows(logits, temperature.contiguous(), u)
        return None

    def draw_top_p(self, logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor,
                   u: torch.Tensor, rounds: int) -> torch.Tensor | None:
        # one row at a time, its weights kept in L2 across the rounds: the tensor ops read and
        # write [rows, vocab] a few times a round
        if self._rows_kernel_takes(logits) and temperature.dtype == torch.float32 and \
                top_p.dtype == torch.float32 and u.dtype == torch.float64:
            return self.ops.draw_top_p_rows(logits, temperature.contiguous(),
                                            top_p.contiguous(), u, rounds)
        return None

    def rope(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
             cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """In place on q and k (views into the step's fused QKV output)."""
        if q.shape[-1] % (2 * self.lanes) == 0 and cos.dtype == torch.float32:
            self.ops.rotary_embedding(q, k, positions, cos, sin)
            return q, k
        return apply_rope(positions, q, k, cos, sin)

    def fuse_llama(self, stack: LlamaStack) -> LayersFn | None:
        """A Llama-layout stack as one ``llama_layers`` call a step: per layer, the fused
        halves (norm + QKV + RoPE; o_proj + residual + norm + SwiGLU MLP + residual) and the
        paged-attention kernel, with no Python between layers (about 2 ms of a 13 ms
        single-request decode step here), activations in the dtype the set's linear kernels
        take (bf16 for AVX-512, fp32 for AVX2: a bf16 model's rows are widened on the way in
        and rounded on the way out, its norms and biases widened once, here). Bit for bit the
        layers run one by one through these ops where the dtypes agree (tests/unit/ops). None
        where a layer needs the per-layer path: a head size or width the kernels do not take,
        a weight not in a layout the set's stack takes, a tensor-parallel shard whose group
        has no shared memory to sum in (its all-reduces then run between Python layers).
        Under tensor parallelism the op sums o_proj's and down's partial outputs in the
        group's shared memory itself (csrc/cpu/shm_all_reduce.cpp). The weight lists are
        built once."""
        width = 2 * self.lanes
        if not kernel_supports(stack.head_dim) or stack.head_dim % width \
                or stack.hidden_size % width:
            return None
        if stack.tensor_parallel and stack.tp_all_reduce is None:
            return None
        dtype = self._linear.activation_dtype
        model_dtype = stack.layers[0].input_norm.dtype if stack.layers else dtype
        if dtype != torch.float32 and model_dtype != dtype:
            # the stack writes K/V in its activation dtype: a wider KV cache (an fp32 model
            # on the AVX-512 set, with GGUF blocks as weights) takes the per-layer path
            return None
        weights: list[torch.Tensor] = []
        biases: list[torch.Tensor | None] = []
        for layer in stack.layers:
            pairs = [self._stack_weights(lin, dtype, model_dtype) for lin in layer.linears]
            if any(pair is None for pair in pairs):
                return None
            (qkv_few, qkv_many), (o_few, o_many), (gate_up_few, gate_up_many), \
                (down_few, down_many) = pairs
            # ten tensors a layer (csrc/cpu/llama_block.cpp): each linear's "up to 8 rows"
            # and "more rows" weights
            weights += [layer.input_norm.detach().to(dtype), qkv_few, qkv_many, o_few, o_many,
                        layer.post_attention_norm.detach().to(dtype), gate_up_few,
                        gate_up_many, down_few, down_many]
            biases += [None if lin.bias is None else lin.bias.detach().to(dtype)
                       for lin in layer.linears]
        return _one_call_layers(self.ops, stack, weights, biases, dtype, model_dtype)


# the per-layer LoRA stacks llama_layers takes, in its order (csrc/cpu/llama_block.cpp)
LORA_PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


def _one_call_layers(ops: Any, stack: LlamaStack, weights: list[torch.Tensor],
                     biases: list[torch.Tensor | None], activation_dtype: torch.dtype,
                     model_dtype: torch.dtype) -> LayersFn:
    held = getattr(torch.classes, ops.name).LlamaStackWeights(weights, biases)
    # the op's C++ entry, without torch.ops' Python-side search of every argument for a fake
    # script object (done for an op that takes a class, as this one: 20 us a call, 70 where
    # the caches are cold); nothing here runs under torch.compile or export, which need it
    return OneCallLayers(ops.llama_layers.default._op, stack, held, activation_dtype,
                         stack.rope_cos.float(), stack.rope_sin.float(), model_dtype)


@dataclass(frozen=True, slots=True)
class OneCallLayers:
    """The decoder layers as one ``ops.llama_layers`` call a step over ``weights`` (the ops'
    ``LlamaStackWeights``: ten tensors and four biases a layer, handed to C++ once), the
    residual stream in ``activation_dtype``, the model's own dtype on the way in and out
    (``model_dtype``: a bf16 model's quantized linears take the int8 kernel past the decode
    rows even where the activations are fp32, the AVX2 set's stack;
    csrc/cpu/quant_linear.cpp). It runs LoRA steps too (``takes_lora``), the adapters'
    deltas applied inside the call after each linear, from slots in ``activation_dtype`` in
    the CPU kernels' layout (``lora_dtype``: what the engine allocates them in)."""

    llama_layers: Any  # ops.llama_layers' C++ entry
    stack: LlamaStack
    weights: Any
    activation_dtype: torch.dtype
    cos: torch.Tensor
    sin: torch.Tensor
    model_dtype: torch.dtype
    # the KV caches handed to ``weights`` (its set_kv_caches), which a call then leaves out:
    # a list of 30 tensors in every call's arguments cost about 15 us a decode step in the
    # dispatcher, on cold caches (Zen 4: 91 -> 76 us between Python and the op's C++)
    held_caches: list[torch.Tensor] = field(default_factory=list)

    @property
    def lora_dtype(self) -> torch.dtype:
        return self.activation_dtype

    def takes_lora(self, lora: LoRABatch) -> bool:
        return lora.ops.b_rank_major and lora.dtype == self.activation_dtype \
            and len(lora.a) == len(self.stack.layers)

    # the step's ends run inside the call where the model hands them over (``ends``)
    folds_ends = True

    def __call__(self, x: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                 meta: AttentionMetadata, attention_ns: torch.Tensor | None = None,
                 lora: LoRABatch | None = None,
                 ends: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """``ends``: (embedding table, final norm weight), in the model's dtype: ``x`` is then
        the step's token ids, looked up in the table inside the call, and the output is the
        final norm's (what ``LlamaModel.forward`` would compute around the call, the same
        bits, without two ops' dispatch from Python a step)."""
        # attention_ns (int64 [1]): the op adds its cache-write and attention time to it
        stack = self.stack
        lora_weights: list[torch.Tensor] = []
        lora_slots = None
        if lora is not None:
            lora_weights = [w for a, b in zip(lora.a, lora.b) for p in LORA_PROJECTIONS
                            for w in (a[p], b[p])]
            lora_slots = lora.groups.token_slots
        tp = stack.tp_all_reduce
        ids = table = norm = None
        if ends is not None:  # x is the step's token ids; the call returns the final norm's
            ids, (table, norm) = x, ends
            dtype = norm.dtype
        else:
            dtype = x.dtype  # (a dtype test costs less than a no-op .to() where caches are cold)
            if dtype != self.activation_dtype or not x.is_contiguous():
                x = x.to(self.activation_dtype).contiguous()
        held = self.held_caches
        if len(held) != len(kv_caches) or not all(map(operator.is_, held, kv_caches)):
            self.weights.set_kv_caches(kv_caches)
            held[:] = kv_caches
        out = self.llama_layers(
            x, positions, self.cos, self.sin, self.weights, [], meta.slot_mapping,
            meta.block_tables, meta.query_start_loc, meta.seq_lens, stack.rms_norm_eps,
            stack.attention_scale, stack.num_heads, stack.num_kv_heads, lora_weights,
            lora_slots, attention_ns, None if tp is None else tp.segment,
            None if tp is None else tp.state, self.model_dtype, ids, table, norm)
        return out if out.dtype == dtype else out.to(dtype)


class CpuPagedAttentionBackend:
    """Stateless; one instance serves every layer. Head sizes the kernel does not take go to
    the reference. Under fp32 queries the kernels also read bf16 / fp16 caches."""

    def __init__(self, name: str, ops: Any) -> None:
        self.name = name
        self._ops = ops
        self._reference = TorchAttentionBackend()

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float) -> torch.Tensor:
        # q: [num_tokens, num_heads, head_dim]; k, v: [num_tokens, num_kv_heads, head_dim]
        if not kernel_supports(q.shape[-1]):
            return self._reference.forward(q, k, v, kv_cache, meta, scale)
        self._ops.write_kv(kv_cache, k, v, meta.slot_mapping)
        q = q.contiguous()
        out = torch.empty_like(q)
        self._ops.paged_attention(out, q, kv_cache, meta.block_tables, meta.query_start_loc,
                                  meta.seq_lens, scale)
        return out


def _dense_numel(blocks: torch.Tensor) -> int:
    """Weights in a GGUF weight [N, K / block values, block bytes] (256 values a k-quant
    super-block, 32 a legacy block): what a de-quantized twin holds."""
    return blocks.shape[0] * blocks.shape[1] * \
        (256 if blocks.shape[2] in K_QUANT_BLOCK_BYTES else 32)


def amx_tiles(kernels: CpuKernels) -> bool:
    """Whether this set's matmuls run on AMX tiles here: oneDNN's bf16 ones, so only a set
    whose activations are bf16 (AVX-512), on a CPU with the tiles (the kernels' CPUID check)."""
    return ISA_PROFILES[kernels.isa].linear.activation_dtype == torch.bfloat16 and \
        kernels.has("amx_tiles") and bool(kernels.ops.amx_tiles())


def bf16_twins_reason(kernels: CpuKernels, tiles: bool) -> str | None:
    """Why this set's quantized layer weights keep bf16 twins for many-row steps, or None: a
    set whose activations are bf16 (AVX-512), on a CPU whose oneDNN bf16 matmuls outrun the
    int8 kernel there (AMX tiles: ``tiles``, amx_tiles' answer; a full-width AVX-512 BF16
    datapath, cpu_isa.full_width_bf16)."""
    if tiles:
        return "AMX tiles"
    if ISA_PROFILES[kernels.isa].linear.activation_dtype == torch.bfloat16 and \
            full_width_bf16(*cpu_vendor_family(), cpu_flags()):
        return "Full-width AVX-512 BF16"
    if ISA_PROFILES[kernels.isa].linear is PANELS_BF16 and kernels.has("pack_bf16w"):
        # AVX2: many rows of fp32 x multiply bf16 panels (what the dequantize path runs) far
        # faster than a weight de-quantized into fp32 on every call; a bf16 model's k-quant
        # layers (the fused stack) keep them (CpuOps._panel_twin); its Q4_0 / Q4_1 / Q8_0
        # layers take the int8 kernel, faster still
        return "AVX2 bf16 panels"
    return None


def make_cpu_backend(kernels: CpuKernels, name: str, description: str) -> Backend:
    """The backend that runs ``kernels`` (one variant's, loaded)."""
    ops = CpuOps(kernels)
    if ops.tiles:
        # oneDNN's many-row bf16 matmuls run on the tiles; quantized layers keep bf16 tile
        # twins for them (cpu_linear.GgufBlocks) or meet them sooner (int8_rows_limit); bf16
        # prefill attention and decode scores run on them too (csrc/cpu/avx512/prefill_amx.h,
        # decode_amx.h)
        description += ", AMX tiles for many-row matmuls"
        if kernels.has("quant_tiles") and kernels.ops.quant_tiles():
            # Q4_0 / Q4_1 calls of up to 128 rows take the blocks instead of the twin: the
            # int8 kernel to 24 rows, then de-quantized into tiles (csrc/cpu/avx512/quant_amx.h)
            description += " (Q4 weights' rows up to 128 from their 4-bit blocks)"
        if kernels.has("attention_tiles") and kernels.ops.attention_tiles():
            description += " and bf16 attention (prefill; decode scores)"
    elif ops.twins == "AVX2 bf16 panels":
        description += ", int8 dot products for a bf16 model's Q4_0 / Q4_1 / Q8_0 weights, " \
            "bf16 panel twins of its k-quants for many-row matmuls"
    elif ops.twins:
        # oneDNN's bf16 matmul on a full 512-bit datapath: quantized layers but Q4_0 / Q4_1
        # keep bf16 twins (CpuOps._twin_pays)
        description += ", int8 dot products for Q4_0 / Q4_1 weights, bf16 twins of other " \
            "quantized weights for many-row matmuls (full-width AVX-512 BF16)"
    return Backend(name=name, description=description, linear=ops.linear,
                   pack_weight=ops.pack_weight, rms_norm=ops.rms_norm,
                   silu_and_mul=ops.silu_and_mul, rope=ops.rope,
                   attention=CpuPagedAttentionBackend(name, kernels.ops),
                   fused_stacks={"llama": ops.fuse_llama},
                   quantized_types=GGUF_NATIVE_TYPES if kernels.has("quant_linear")
                   else frozenset(),
                   sampling=SamplingKernels(argmax=ops.argmax, draw=ops.draw,
                                            draw_top_p=ops.draw_top_p),
                   fp32_logits=ops.logits)


def cpu_backend_entry(name: str, description: str, variant: CpuVariant) -> BackendEntry:
    """The registry entry of the backend over ``variant``'s kernels."""
    return BackendEntry(name, description,
                        functools.partial(_resolve, name, description, variant))


def _resolve(name: str, description: str, variant: CpuVariant,
             device: torch.device) -> Backend | Unavailable:
    if device.type != "cpu":
        return Unavailable(f"the compiled CPU kernels run on the CPU only, the device is {device}")
    reason = cannot_run_reason(variant)
    if reason is not None:  # nothing to build or wait for: say only why
        return Unavailable(reason)
    # the first start compiles csrc/cpu into the cache; later ones load that build in ms
    with progress(logger, f"Loading the {variant.name} CPU kernels",
                  expect="compiled on first start only: 20 s to a few minutes"):
        kernels = load(variant)
    if isinstance(kernels, Unavailable):
        return kernels
    return make_cpu_backend(kernels, name, description)
