"""A GGUF file's tensors as our model's state dict, without converting the file.

Linear weights of the types the backend multiplies natively stay as the file stores them:
uint8 ``[out_features, in_features / 32, block_bytes]``, each block exactly ggml's (what
``csrc/cpu/quant_linear.cpp`` reads; the block size names the type). Everything else (norms,
the embedding table for its lookup, weights of other types) is de-quantized with the ``gguf``
package's reference into ``dtype``. A tied embedding that is block-quantized also serves the
logits as blocks (``GgufState.tied_logits``): the largest single matrix of a small model.

GGUF quirks live here: llama.cpp's names (``blk.N.attn_q`` ...), its reversed shapes, and the
row order its converter gives Llama's Q and K projections (rotary halves interleaved), undone
as transformers' own GGUF loader undoes it.
"""

from __future__ import annotations

import logging
import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from engine_worker.weights.gguf_file import read_gguf

logger = logging.getLogger(__name__)

# llama.cpp's tensor names -> ours (the model's, before fusing Q/K/V and gate/up)
_NAMES = {
    "token_embd": "embed_tokens",
    "output_norm": "norm",
    "output": "lm_head",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_BLOCK = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)$")
_TOP = re.compile(r"(\w+)\.(weight|bias)$")
FLOAT_TYPES = ("F32", "F16", "BF16")
# architectures whose converter permutes Q/K rows (llama.cpp's convert_hf_to_gguf LlamaModel)
_PERMUTED_QK = ("llama", "mistral")


@dataclass(frozen=True, slots=True)
class GgufState:
    """The state dict (our names, Q/K/V and gate/up not yet fused), which tensors stayed as
    blocks, the tied logits' blocks if any, and a count of the file's types."""

    tensors: dict[str, torch.Tensor]
    quantized: frozenset[str]
    tied_logits: torch.Tensor | None
    type_counts: dict[str, int]
    dequantized_types: tuple[str, ...]  # block types without a kernel, widened at load

    def summary(self) -> str:
        counts = ", ".join(f"{n} {t}" for t, n in sorted(self.type_counts.items()))
        widened = (f"; de-quantized (no kernel): {', '.join(self.dequantized_types)}"
                   if self.dequantized_types else "")
        return f"{counts}{widened}"


def _our_name(gguf_name: str) -> str | None:
    m = _BLOCK.match(gguf_name)
    if m:
        layer, base, kind = m.groups()
        ours = _NAMES.get(base)
        return None if ours is None else f"layers.{layer}.{ours}.{kind}"
    m = _TOP.match(gguf_name)
    if m and m.group(1) in _NAMES:
        return f"{_NAMES[m.group(1)]}.{m.group(2)}"
    return None


def _unpermute_rows(t: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row permutation (rows [heads, 2, dim/2] -> [heads, dim/2, 2]
    order), on any trailing layout: floats [N, K], blocks [N, K / 32, bytes] or a bias [N]."""
    rows = t.shape[0]
    half = rows // num_heads // 2
    return t.reshape(num_heads, half, 2, *t.shape[1:]).transpose(1, 2).reshape(t.shape)


def read_gguf_state(path: Path, *, dtype: torch.dtype, native_types: frozenset[str],
                    strict: bool, num_heads: int, num_kv_heads: int) -> GgufState:
    """Every tensor of ``path`` we know, named ours. ``native_types``: block types kept as
    blocks (linear weights only); ``strict``: a block type outside them (and not a float type)
    is an error naming the tensor, the type and the supported list, else it is de-quantized."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import dequantize

    file = read_gguf(path)
    permute = str(file.fields.get("general.architecture", "llama")) in _PERMUTED_QK
    tensors: dict[str, torch.Tensor] = {}
    quantized: set[str] = set()
    widened: set[str] = set()
    counts: Counter[str] = Counter()
    for t in file.tensors:
        name = _our_name(t.name)
        if name is None:
            logger.warning("GGUF: ignoring tensor %s", t.name)
            continue
        qtype = GGMLQuantizationType(t.type_id)
        type_name = qtype.name
        counts[type_name] += 1
        block_size, type_bytes = GGML_QUANT_SIZES[qtype]
        shape = list(t.shape)
        is_linear = name.endswith(".weight") and len(shape) == 2 and not name.startswith("embed")
        keep_blocks = type_name in native_types and len(shape) == 2 and \
            (is_linear or name == "embed_tokens.weight")
        if not keep_blocks and type_name not in FLOAT_TYPES:
            if strict and is_linear:
                raise ValueError(
                    f"quantization: GGUF tensor {t.name} is {type_name}, which has no native "
                    f"kernel (supported: {', '.join(sorted(native_types))}); "
                    f"use quantization=dequantize or auto to widen it at load")
            if is_linear:
                widened.add(type_name)
        rows = int(np.prod(shape[:-1])) if len(shape) > 1 else 1
        raw = t.data.reshape(rows, -1)  # [rows, bytes a row]
        if keep_blocks:
            blocks = torch.from_numpy(raw.reshape(shape[0], shape[1] // block_size, type_bytes)
                                      .copy())
            if name == "embed_tokens.weight":
                tensors["tied_logits"] = blocks  # the lookup gets floats below
            else:
                tensors[name] = blocks
                quantized.add(name)
                continue
        if type_name in FLOAT_TYPES:
            float_dtype = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16}[type_name]
            values = torch.from_numpy(raw.view(float_dtype).copy())
            if type_name == "BF16":
                values = values.view(torch.bfloat16)
        else:
            values = torch.from_numpy(dequantize(raw, qtype))
        tensors[name] = values.reshape(shape).to(dtype)
    tied_logits = tensors.pop("tied_logits", None)
    if permute:
        for name in list(tensors):
            heads = num_heads if ".q_proj." in name else num_kv_heads if ".k_proj." in name \
                else None
            if heads is not None:
                tensors[name] = _unpermute_rows(tensors[name], heads).contiguous()
    if widened:
        logger.warning("GGUF: no native kernel for %s: those weights are de-quantized at load "
                       "(native: %s)", ", ".join(sorted(widened)), ", ".join(sorted(native_types)))
    return GgufState(tensors, frozenset(quantized), tied_logits, dict(counts),
                     tuple(sorted(widened)))


def dequantize_blocks(blocks: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Blocks [N, K / 32 (K / 256: k-quants), bytes] (a type ``read_gguf_state`` keeps) as
    values [N, K]."""
    import gguf
    from gguf.quants import dequantize

    qt = gguf.GGMLQuantizationType
    by_bytes = {gguf.GGML_QUANT_SIZES[t][1]: t
                for t in (qt.Q4_0, qt.Q4_1, qt.Q8_0, qt.Q4_K, qt.Q5_K, qt.Q6_K)}
    n, num_blocks, nbytes = blocks.shape
    values = dequantize(blocks.reshape(n, num_blocks * nbytes).numpy(), by_bytes[nbytes])
    return torch.from_numpy(values.reshape(n, -1)).to(dtype)
