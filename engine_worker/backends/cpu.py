"""The ``cpu`` backend: the AVX-512 build of the compiled kernels of ``csrc/cpu``
(``torch.ops.quire_avx512``, OpenMP), and what the CPU backends share (the attention backend,
the one-call layer stack, the kernels' availability).

Each op is called where its shape and dtype rules hold and falls back to the reference
(``backends.reference``) elsewhere; tests compare every kernel with its reference. Paged
attention is one varlen call per layer covering the step's decodes and prefill chunks
together, reading K/V in place through the block tables. On a loaded bf16 model whose shapes
the kernels take, every decoder layer runs in one ``quire.llama_layers`` call a step.
Needs ``engine_worker.ops.cpu_ops_unavailable_reason()`` to be None (the kernels built).
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine_worker.attention.metadata import AttentionMetadata
from engine_worker.backends.base import Backend, LayersFn, LinearWeights, LlamaStack
from engine_worker.backends.reference import TorchAttentionBackend
from engine_worker.layers.activation import silu_and_mul
from engine_worker.layers.norm import rms_norm
from engine_worker.layers.rotary import apply_rope
from engine_worker.platform import to_huge_pages
from engine_worker.progress import progress

logger = logging.getLogger(__name__)

SKINNY_MAX_ROWS = 8  # up to here a linear layer is a weight stream: the bf16 kernel wins


def _ops():
    """The compiled ops' namespace (the instruction-set variant in use, ``engine_worker.ops``):
    the one place this backend names it."""
    from engine_worker.ops import cpu_ops

    return cpu_ops()


@dataclass(frozen=True, slots=True)
class CpuPackedWeight:
    """A bf16 weight in the two layouts the CPU path streams: oneDNN's blocked one for many
    rows, and for the skinny kernel (up to 8 rows) row groups interleaved per 32-wide slice,
    one sequential stream per thread (~28 GB/s here against ~18 for the plain layout). The
    skinny layout is exponent-coded where every row uses at most 16 exponents (12 bits a
    weight, decoded losslessly in the kernel: a quarter fewer bytes a decode step; see
    csrc/cpu/avx512/linear.cpp), else plain bf16."""

    onednn: torch.Tensor | None
    skinny: torch.Tensor | None


def cpu_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
               packed: CpuPackedWeight | None) -> torch.Tensor:
    # x: [num_tokens, in_features]; more rows go to oneDNN, which reuses each weight load
    if x.shape[0] <= SKINNY_MAX_ROWS and x.dtype == torch.bfloat16 and x.shape[1] % 32 == 0:
        if packed is not None and packed.skinny is not None:
            return _ops().skinny_linear_packed(x, packed.skinny, bias)
        return _ops().skinny_linear(x, weight, bias)
    if packed is not None and packed.onednn is not None:
        return torch.ops.mkldnn._linear_pointwise(x, packed.onednn, bias, "none", [], "")
    return F.linear(x, weight, bias)


def cpu_pack_weight(weight: torch.Tensor) -> CpuPackedWeight | None:
    """Once per weight at load. oneDNN's layout: F.linear would re-lay the plain weight out on
    every call (10-45 % of a decode-sized matmul here)."""
    if weight.dtype != torch.bfloat16:
        return None
    # oneDNN's bf16 needs AVX-512 BW/VL/DQ (or AVX-NE-CONVERT) in the CPU itself; without it
    # (the emulated AVX-512 kernels in the tests) more rows go through F.linear
    onednn_bf16 = torch.backends.mkldnn.is_available() and \
        torch.ops.mkldnn._is_mkldnn_bf16_supported()
    onednn = torch.ops.mkldnn._reorder_linear_weight(weight, None) if onednn_bf16 else None
    out_features, in_features = weight.shape
    skinny = None
    if out_features % 4 == 0 and in_features % 32 == 0:
        skinny = _ops().pack_coded(weight)
        if skinny.numel() == 0:  # a row with more than 16 exponents
            skinny = _ops().pack_skinny(weight)
        # what decode streams every step: on huge pages (platform.py)
        skinny = to_huge_pages(skinny)
    return CpuPackedWeight(onednn, skinny)


def cpu_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if x.shape[-1] % 16 == 0 and x.dim() == 2 and x.stride(1) == 1:
        return _ops().rms_norm(x, weight, eps)
    return rms_norm(x, weight, eps)


def cpu_silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    if x.shape[-1] % 32 == 0 and x.dim() == 2 and x.is_contiguous():
        return _ops().silu_and_mul(x)
    return silu_and_mul(x)


def cpu_rope(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
             sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """In place on q and k (views into the step's fused QKV output)."""
    if q.shape[-1] % 32 == 0:
        _ops().rotary_embedding(q, k, positions, cos, sin)
        return q, k
    return apply_rope(positions, q, k, cos, sin)


def kernel_supports(head_dim: int) -> bool:
    """Head sizes the paged-attention kernel takes."""
    return head_dim % 16 == 0 and head_dim <= 512


class CpuPagedAttentionBackend:
    """Stateless; one instance serves every layer. Head sizes the kernel does not take go to
    the reference. ``ops`` gives the namespace whose ``write_kv`` / ``paged_attention`` it
    calls (the AVX-512 set's by default; ``cpu-avx2`` passes its own)."""

    def __init__(self, name: str = "cpu", ops=None) -> None:
        self.name = name
        self._ops = ops or _ops
        self._reference = TorchAttentionBackend()

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float) -> torch.Tensor:
        # q: [num_tokens, num_heads, head_dim]; k, v: [num_tokens, num_kv_heads, head_dim]
        if not kernel_supports(q.shape[-1]):
            return self._reference.forward(q, k, v, kv_cache, meta, scale)
        ops = self._ops()
        ops.write_kv(kv_cache, k, v, meta.slot_mapping)
        q = q.contiguous()
        out = torch.empty_like(q)
        ops.paged_attention(out, q, kv_cache, meta.block_tables, meta.query_start_loc,
                            meta.seq_lens, scale)
        return out


def _packed_both(lin: LinearWeights) -> bool:
    """Packed in both CPU layouts (bf16, shapes the skinny kernel takes)."""
    return lin.packed is not None and lin.packed.skinny is not None \
        and lin.packed.onednn is not None


def cpu_llama_layers(stack: LlamaStack) -> LayersFn | None:
    """A Llama's decoder layers as one ``quire.llama_layers`` call a step: per layer, the fused
    halves (norm + QKV + RoPE; o_proj + residual + norm + SwiGLU MLP + residual) and the
    paged-attention kernel, with no Python between layers (about 2 ms of a 13 ms
    single-request decode step here). Bit for bit the layers run one by one through this
    backend's ops (tests/unit/ops). None where a layer needs that per-layer path: a head size
    the kernels do not take, a weight not packed for both CPU layouts (not bf16). The weight
    lists are built once, here."""
    if (not kernel_supports(stack.head_dim) or stack.head_dim % 32
            or stack.hidden_size % 32):
        return None
    weights: list[torch.Tensor] = []
    biases: list[torch.Tensor | None] = []
    for layer in stack.layers:
        if not all(_packed_both(lin) for lin in layer.linears):
            return None
        qkv, o, gate_up, down = layer.linears
        weights += [layer.input_norm, qkv.packed.skinny, qkv.packed.onednn,
                    o.packed.skinny, o.packed.onednn,
                    layer.post_attention_norm, gate_up.packed.skinny, gate_up.packed.onednn,
                    down.packed.skinny, down.packed.onednn]
        biases += [lin.bias for lin in layer.linears]

    return one_call_layers(_ops(), stack, weights, biases, torch.bfloat16)


def one_call_layers(ops, stack: LlamaStack, weights: list[torch.Tensor],
                    biases: list[torch.Tensor | None], activation_dtype: torch.dtype) -> LayersFn:
    """The decoder layers as one ``ops.llama_layers`` call a step over these weight lists (ten
    tensors and four biases a layer, csrc/cpu/llama_block.cpp), the residual stream in
    ``activation_dtype`` (the dtype the variant's linear kernels take), the model's own
    dtype on the way in and out."""
    cos, sin = stack.rope_cos.float(), stack.rope_sin.float()

    def run(x: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
            meta: AttentionMetadata, attention_ns: torch.Tensor | None = None) -> torch.Tensor:
        # attention_ns (int64 [1]): the op adds its cache-write and attention time to it
        out = ops.llama_layers(
            x.to(activation_dtype).contiguous(), positions, cos, sin, weights, biases,
            kv_caches, meta.slot_mapping, meta.block_tables, meta.query_start_loc,
            meta.seq_lens, stack.rms_norm_eps, stack.attention_scale, stack.num_heads,
            stack.num_kv_heads, attention_ns)
        return out.to(x.dtype)

    return run


def kernels_unavailable_reason(isa: str, device: torch.device) -> str | None:
    """Why the ``isa`` build of the kernels cannot run here, or None once it is loaded. The
    first call compiles csrc/cpu into the cache; later ones load that build in ms."""
    if device.type != "cpu":
        return f"the compiled CPU kernels run on the CPU only, the device is {device}"
    from engine_worker.ops import cpu_flags, cpu_ops_unavailable_reason
    from engine_worker.ops.cpu_isa import ISA_REQUIRED_FLAGS

    if not ISA_REQUIRED_FLAGS[isa] <= cpu_flags():
        return cpu_ops_unavailable_reason(isa)  # nothing to build or wait for: say only why
    with progress(logger, f"Loading the {isa} CPU kernels", expect="compiled on first start "
                  "only, one to two minutes"):
        return cpu_ops_unavailable_reason(isa)


CPU = Backend(
    name="cpu", description="compiled CPU kernels, AVX-512", linear=cpu_linear,
    pack_weight=cpu_pack_weight, rms_norm=cpu_rms_norm, silu_and_mul=cpu_silu_and_mul,
    rope=cpu_rope, attention=CpuPagedAttentionBackend(), llama_layers=cpu_llama_layers,
    # the AVX-512 build: its bf16 path streams layouts only AVX-512 BF16 multiplies; CPUs
    # without it get cpu-avx2
    unavailable_reason=functools.partial(kernels_unavailable_reason, "avx512"))
