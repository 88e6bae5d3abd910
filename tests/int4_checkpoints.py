"""AWQ and GPTQ test checkpoints made here: a float model's linear layers quantized by our own
round-to-nearest quantizer (no calibration: the format, not the method, is under test) and
packed as AutoAWQ (GEMM) and AutoGPTQ write them, with the ``quantization_config`` transformers
writes. The reference de-quantizations below follow the formats' own code step by step
(AutoAWQ's ``unpack_awq`` + ``reverse_awq_order`` + ``(w - z) * s``; AutoGPTQ's
``QuantLinear.forward`` fallback: zeros + 1, ``scales[g_idx] * (w - zeros[g_idx])``) and are
written independently of ``engine_worker.weights.int4_checkpoint``, which tests compare with them.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ: code i of a word is column order[i]
AWQ_UNPACK_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)  # AutoAWQ's AWQ_REVERSE_ORDER
QUANTIZED = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def quantize_rtn(w: torch.Tensor, group_size: int, sym: bool, min_zero: int = 0):
    """w [N, K] -> (codes int32 [N, K] 0..15, zeros int32 [N, G], scales fp16 [N, G]):
    min/max per group (asymmetric) or max |w| (symmetric, zero 8), codes rounded to nearest.
    ``min_zero``: the smallest zero point allowed (1 for the original GPTQ format, whose stored
    zero - 1 cannot hold -1)."""
    n, k = w.shape
    g = w.float().view(n, k // group_size, group_size)
    if sym:
        scales = (g.abs().amax(-1) * 2 / 15).clamp(min=1e-6).half()
        zeros = torch.full_like(scales, 8, dtype=torch.int32)
    else:
        lo, hi = g.amin(-1).clamp(max=0), g.amax(-1).clamp(min=0)
        scales = ((hi - lo) / 15).clamp(min=1e-6).half()
        zeros = torch.round(-lo / scales.float()).to(torch.int32).clamp(min_zero, 15)
    codes = torch.round(g / scales.float()[..., None]) + zeros[..., None]
    return codes.clamp(0, 15).to(torch.int32).view(n, k), zeros, scales


def _pack_along_last(values: torch.Tensor, order=tuple(range(8))) -> torch.Tensor:
    """int32 [..., 8W] -> int32 [..., W]: code i of word c holds value 8c + order[i]."""
    v = values.view(*values.shape[:-1], -1, 8)
    word = torch.zeros(v.shape[:-1], dtype=torch.int64)
    for i, col in enumerate(order):
        word |= (v[..., col].to(torch.int64) & 0xF) << (4 * i)
    return torch.where(word >= 2**31, word - 2**32, word).to(torch.int32)


def pack_awq(codes, zeros, scales):
    """AutoAWQ WQLinear_GEMM: qweight [K, N / 8], qzeros [G, N / 8], scales [G, N]."""
    return {"qweight": _pack_along_last(codes.t().contiguous(), AWQ_PACK_ORDER),
            "qzeros": _pack_along_last(zeros.t().contiguous(), AWQ_PACK_ORDER),
            "scales": scales.t().contiguous()}


def pack_gptq(codes, zeros, scales, group_size: int, v2: bool = False):
    """AutoGPTQ: qweight [K / 8, N] along the input, qzeros [G, N / 8] (zero - 1 unless v2)."""
    stored = zeros if v2 else zeros - 1
    k = codes.shape[1]
    return {"qweight": _pack_along_last(codes.contiguous()).t().contiguous(),
            "qzeros": _pack_along_last(stored.t().contiguous()),
            "scales": scales.t().contiguous(),
            "g_idx": (torch.arange(k) // group_size).to(torch.int32)}


def reference_awq(qweight, qzeros, scales, group_size: int) -> torch.Tensor:
    """AutoAWQ's dequantize_gemm, in fp32: [K, N] -> returned transposed, [N, K]."""
    shifts = torch.arange(0, 32, 4)
    iw = (qweight[:, :, None].to(torch.int64) >> shifts) .view(qweight.shape[0], -1)
    iz = (qzeros[:, :, None].to(torch.int64) >> shifts).view(qzeros.shape[0], -1)
    rev = torch.arange(iw.shape[-1]).view(-1, 8)[:, list(AWQ_UNPACK_ORDER)].reshape(-1)
    iw, iz = iw[:, rev] & 0xF, iz[:, rev] & 0xF
    s = scales.float().repeat_interleave(group_size, dim=0)
    z = iz.repeat_interleave(group_size, dim=0)
    return ((iw - z) * s).t().contiguous()


def reference_gptq(qweight, qzeros, scales, g_idx, v2: bool = False) -> torch.Tensor:
    """AutoGPTQ QuantLinear.forward's de-quantization, in fp32: [N, K]."""
    shifts = torch.arange(0, 32, 4)
    z = ((qzeros[:, :, None].to(torch.int64) >> shifts) & 0xF).reshape(scales.shape)
    if not v2:
        z = z + 1
    w = ((qweight[:, None, :].to(torch.int64) >> shifts[None, :, None]) & 0xF)
    w = w.reshape(-1, qweight.shape[1])  # [K, N]
    g = g_idx.long()
    return (scales.float()[g] * (w - z[g])).t().contiguous()


def quantize_checkpoint(float_dir: Path, out_dir: Path, method: str, *, sym: bool = False,
                        group_size: int = 128, gptq_v2: bool = False) -> Path:
    """``float_dir`` (a transformers checkpoint) with its decoder linear layers as ``method``
    ("awq" / "gptq") 4-bit; tokenizer and other files copied. Returns ``out_dir``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    for f in float_dir.iterdir():
        if f.is_file() and f.suffix != ".safetensors" and f.name != "config.json":
            (out_dir / f.name).write_bytes(f.read_bytes())
    state = load_file(str(float_dir / "model.safetensors"))
    out = {}
    for name, tensor in state.items():
        module = name.removesuffix(".weight")
        if not (name.endswith(".weight") and module.rsplit(".", 1)[-1] in QUANTIZED):
            out[name] = tensor.half() if tensor.is_floating_point() else tensor
            continue
        codes, zeros, scales = quantize_rtn(tensor, group_size, sym,
                                            min_zero=1 if method == "gptq" and not gptq_v2 else 0)
        packed = pack_awq(codes, zeros, scales) if method == "awq" else \
            pack_gptq(codes, zeros, scales, group_size, gptq_v2)
        out.update({f"{module}.{part}": t for part, t in packed.items()})
    save_file(out, str(out_dir / "model.safetensors"))
    cfg = json.loads((float_dir / "config.json").read_text())
    cfg["torch_dtype"] = cfg["dtype"] = "float16"
    if method == "awq":
        cfg["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": group_size,
                                      "zero_point": True, "version": "gemm",
                                      "modules_to_not_convert": None}
    else:
        cfg["quantization_config"] = {"quant_method": "gptq", "bits": 4,
                                      "group_size": group_size, "desc_act": False, "sym": sym,
                                      "checkpoint_format": "gptq_v2" if gptq_v2 else "gptq",
                                      "damp_percent": 0.1, "true_sequential": True}
    (out_dir / "config.json").write_text(json.dumps(cfg, indent=2))
    return out_dir
