"""What a kernel backend is, and the data a model hands it.

A backend is a bundle of functions over tensors: the per-op kernels the model's modules call
(linear, RMSNorm, SwiGLU, RoPE, paged attention) and, where it has them, fused implementations
of whole decoder stacks, keyed by the kind of stack a model exports (``LlamaStack.kind`` in
``models/llama.py``: the model module describes its own stack as data). It is given weights as
data (``LinearWeights``, and the stack, exported by the model once after loading) and never
walks the model's modules. A model family with another layer layout adds its stack kind and
the backends that can fuse it add an entry; ``Backend`` gets no new field.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from engine_worker.attention.metadata import AttentionMetadata
from engine_worker.ops.cpu_build import Unavailable

# (x, weight, bias, packed weight or None) -> x @ weight.T + bias
LinearFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None, Any], torch.Tensor]
# (hidden rows, the logits' weight, its packed form) -> fp32 logits [rows, vocab], or None
# where the backend has no faster way than its linear (Backend.logits then widens that)
LogitsFn = Callable[[torch.Tensor, torch.Tensor, Any], torch.Tensor | None]
# a loaded linear weight -> the backend's own layout of it (what LinearFn takes as ``packed``).
# ``dense=``: the same weight's exact de-quantized values, where the model holds them anyway (a
# tied embedding table beside its GGUF blocks); a backend may multiply many rows on those
# instead of de-quantizing the blocks every call, or ignore them.
PackFn = Callable[..., Any]
# (x, weight, eps) -> RMSNorm(x)
NormFn = Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]
# (positions, q, k, cos, sin) -> (q, k) rotated
RopeFn = Callable[..., tuple[torch.Tensor, torch.Tensor]]


def torch_argmax(logits: torch.Tensor) -> torch.Tensor:
    return logits.argmax(dim=-1)


@dataclass(frozen=True, slots=True)
class SamplingKernels:
    """What the sampler (engine_worker/sampler.py) asks of a backend, where it has faster
    versions than the sampler's own tensor ops.

    ``argmax``: logits [rows, vocab] -> int64 [rows], each row's first largest value
    (``torch.argmax(dim=-1)``), for greedy rows. ``draw``: (logits [rows, vocab], temperature
    fp32 [rows], u float64 [rows]) -> int64 [rows], one token per row with temperature > 0
    from ``softmax(logits / temperature)`` by inverse CDF with the row's uniform (the same draw
    as ``sampling_draw.draw_tokens`` without truncation), or None where it cannot take these
    logits; rows with top-k, top-p or min-p never go to it. ``draw_top_p``: (logits, temperature
    fp32 [rows] (0: skip the row), top_p fp32 [rows], uniforms float64 [rows, rounds + 1],
    rounds) -> int64 [rows], the same draw as ``draw_tokens`` with top-p alone (its pivot rounds,
    then its sorted floor), or None where it cannot take these logits; rows with top-k or min-p
    never go to it. None: the sampler's own draw."""

    argmax: Callable[[torch.Tensor], torch.Tensor] = torch_argmax
    draw: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor | None] | None = None
    draw_top_p: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int],
                         torch.Tensor | None] | None = None


class AttentionBackend(Protocol):
    """Writes the step's new K/V into the paged cache and attends over it."""

    name: str

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float) -> torch.Tensor:
        # q: [num_tokens, num_heads, head_dim]; k, v: [num_tokens, num_kv_heads, head_dim]
        # -> [num_tokens, num_heads, head_dim]
        ...


@dataclass(frozen=True, slots=True)
class LinearWeights:
    weight: torch.Tensor  # [out_features, in_features], the checkpoint's tensor
    bias: torch.Tensor | None  # [out_features]
    packed: Any  # the backend's layout of ``weight`` (its PackFn's result), or None


# (x, positions, kv_caches, meta, attention_ns=None) -> x after every layer. ``attention_ns``
# (int64 [1]), where given, gets the fused call's cache-write and attention time added to it.
# One whose ``graph_ready`` attribute is true launches only kernels sized by tensor shapes, with
# no host read of a device value: the engine then captures it in CUDA graphs.
# One that runs LoRA steps as well has ``lora_dtype`` (the dtype the adapters' slots must be
# in for it) and ``takes_lora(batch)``, and takes the step's ``lora=`` (a LoRABatch).
LayersFn = Callable[..., torch.Tensor]


def stack_lora_dtype(stack: LayersFn | None) -> torch.dtype | None:
    """The dtype a fused stack needs its LoRA slots in; None where it runs no LoRA."""
    return getattr(stack, "lora_dtype", None)


def stack_takes_lora(stack: LayersFn, lora: Any) -> bool:
    """Whether a fused stack runs this step's LoRA batch itself."""
    takes = getattr(stack, "takes_lora", None)
    return takes is not None and takes(lora)
# a model's exported stack (its weights and shapes as data) -> all its layers as one call, or
# None where these weights or shapes need the per-layer path
FuseFn = Callable[[Any], LayersFn | None]


@dataclass(frozen=True, slots=True)
class Backend:
    """The kernels one engine runs, chosen once at start (see ``backends.select_backend``)."""

    name: str
    description: str  # what it is, for the start-up line and GetModelInfo
    linear: LinearFn
    pack_weight: PackFn
    rms_norm: NormFn
    silu_and_mul: Callable[[torch.Tensor], torch.Tensor]  # [n, 2 * w] -> [n, w]
    rope: RopeFn
    attention: AttentionBackend
    # stack kind -> its fused implementation; a kind not here (or a FuseFn's None) runs the
    # model's layers one by one through the ops above
    fused_stacks: Mapping[str, FuseFn] = field(default_factory=dict)
    # GGUF block types (``"Q4_1"``...) whose weights linear / pack_weight take as they are
    # stored (uint8 [N, K / 32, block bytes]); the loader de-quantizes any other
    quantized_types: frozenset[str] = frozenset()
    sampling: SamplingKernels = SamplingKernels()
    # the logits in fp32 where the backend writes them so itself (Backend.logits)
    fp32_logits: LogitsFn | None = None

    def logits(self, x: torch.Tensor, weight: torch.Tensor, packed: Any) -> torch.Tensor:
        """fp32 logits [rows, vocab]: the backend's own (fp32_logits), else linear's widened."""
        if self.fp32_logits is not None:
            out = self.fp32_logits(x, weight, packed)
            if out is not None:
                return out
        return self.linear(x, weight, None, packed).float()

    def fuse(self, stack: Any) -> LayersFn | None:
        """A model's exported stack as one call a step, where this backend fuses it."""
        fuse = self.fused_stacks.get(stack.kind)
        return fuse(stack) if fuse is not None else None


@dataclass(frozen=True, slots=True)
class BackendEntry:
    """A name in the backend registry: what it is (for the start-up line, also when it cannot
    run), and ``resolve``: the backend on a device, or why there is none there. Resolving may
    build and load compiled kernels; the registry does it once per engine."""

    name: str
    description: str
    resolve: Callable[[torch.device], Backend | Unavailable]
