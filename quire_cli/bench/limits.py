"""The machine's limits, measured in the same run as a benchmark, and a result as a fraction of
them: what the README states beside every speed figure, on a CPU or a GPU alike.

- memory bandwidth: a copy of a buffer far larger than any cache (bytes read plus bytes
  written, per second), the best of a few;
- matmul peak: a square matmul in each dtype the device multiplies natively (fp32 always; bf16
  where the hardware has it: a GPU, or a CPU whose oneDNN has bf16), the best of a few.

One decode step of one request streams every weight once, so decode tokens/s x weight bytes
over the bandwidth is the fraction of the memory limit one request reaches. A token costs about
2 x parameters FLOPs in the matmuls, so (prompt + output tokens) x 2 x parameters per second
over the matmul peak is the fraction of the compute limit a batch run reaches (attention's own
FLOPs left out: small at these lengths).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True, slots=True)
class MachineLimits:
    device: str
    memory_gb_per_s: float
    matmul_tflops: dict[str, float]  # dtype name -> measured TFLOP/s

    @property
    def peak_tflops(self) -> float:
        return max(self.matmul_tflops.values())


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _best_seconds(fn, device: torch.device, repeats: int) -> float:
    fn()  # first touch: page faults, kernel selection
    _sync(device)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        _sync(device)
        best = min(best, time.perf_counter() - start)
    return best


def _copy_seconds(copy_bytes: int, device: torch.device, repeats: int) -> float:
    src = torch.empty(copy_bytes // 4, dtype=torch.float32, device=device).fill_(1.0)
    dst = torch.empty_like(src)
    return _best_seconds(lambda: dst.copy_(src), device, repeats)


def _native_dtypes(device: torch.device) -> list[torch.dtype]:
    if device.type == "cuda":
        return [torch.float32, torch.bfloat16]
    bf16 = torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    return [torch.float32, torch.bfloat16] if bf16 else [torch.float32]


def measure_limits(device: torch.device | str, *, copy_bytes: int | None = None,
                   matmul_size: int | None = None, repeats: int = 5) -> MachineLimits:
    device = torch.device(device)
    gpu = device.type == "cuda"
    copy_bytes = copy_bytes or (2 << 30 if gpu else 512 << 20)
    n = matmul_size or (8192 if gpu else 2048)
    bandwidth = 2 * copy_bytes / _copy_seconds(copy_bytes, device, repeats) / 1e9
    tflops = {}
    for dtype in _native_dtypes(device):
        a = torch.randn(n, n, device=device).to(dtype)
        b = torch.randn(n, n, device=device).to(dtype)
        with torch.inference_mode():
            seconds = _best_seconds(lambda: torch.mm(a, b), device, repeats)
        tflops[str(dtype).removeprefix("torch.")] = 2 * n ** 3 / seconds / 1e12
    return MachineLimits(str(device), bandwidth, tflops)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _decode_form(packed: Any) -> torch.Tensor | None:
    """The layout a decode step's few-rows kernel streams where a backend packed one of its own
    (the AVX-512 set's ``skinny``: bf16 exponent-coded to 12 bits a weight where a row allows);
    None where it streams the weight as loaded."""
    skinny = getattr(packed, "skinny", None)
    return skinny if isinstance(skinny, torch.Tensor) and skinny.numel() else None


def weight_bytes(model: torch.nn.Module) -> int:
    """What one decode step streams: the model's parameters (a tied embedding counted once),
    each linear weight in the form its few-rows kernel reads where the backend packed one
    (the exponent-coded bf16 of the AVX-512 set is three quarters of the bf16 weight). Where the
    logits stream another form of a tied embedding (a GGUF's blocks, ``tied_logits_weight``,
    or the packed table), that form counts instead: the float table is only looked up."""
    from engine_worker.layers.linear import Linear

    total = sum(_nbytes(p) for p in model.parameters())
    for module in model.modules():
        if isinstance(module, Linear) and (form := _decode_form(module.packed)) is not None:
            total += _nbytes(form) - _nbytes(module.weight)
    if hasattr(model, "lm_head") and model.lm_head is None:  # tied: logits read the table
        table = model.embed_tokens.weight
        tied = getattr(model, "tied_logits_weight", None)
        form = _decode_form(getattr(model, "logits_packed", None))
        streamed = tied if tied is not None else form
        if streamed is not None:
            total += _nbytes(streamed) - _nbytes(table)
    return total


def num_parameters(model: torch.nn.Module) -> int:
    """Weights, not bytes: a GGUF block-quantized weight (uint8 [N, K / 32, block bytes], or
    K / 256 for the k-quants' blocks of 144 bytes and more) holds N * K."""
    return sum(p.shape[0] * p.shape[1] * (256 if p.shape[2] >= 144 else 32)
               if p.dtype == torch.uint8 and p.dim() == 3 else p.numel()
               for p in model.parameters())


def decode_fraction(tokens_per_s: float, model_bytes: int, limits: MachineLimits) -> float:
    """Of the memory limit, for one request decoding ``tokens_per_s``."""
    return tokens_per_s * model_bytes / (limits.memory_gb_per_s * 1e9)


def compute_fraction(tokens: int, seconds: float, parameters: int,
                     limits: MachineLimits) -> float:
    """Of the matmul peak, for ``tokens`` (prompt and output) processed in ``seconds``."""
    return tokens * 2 * parameters / seconds / (limits.peak_tflops * 1e12)


def limits_report(limits: MachineLimits) -> dict:
    # four significant digits, not a fixed number of places: a loaded 2-core machine measures
    # ~0.02 TFLOP/s, where three places would lose 2-3 % of the figure the fractions divide by
    return {"device": limits.device, "memory_gb_per_s": _significant(limits.memory_gb_per_s),
            "matmul_tflops": {k: _significant(v) for k, v in limits.matmul_tflops.items()}}


def _significant(value: float, digits: int = 4) -> float:
    return float(f"{value:.{digits}g}")


def describe(limits: MachineLimits) -> str:
    peaks = ", ".join(f"{k} {v * 1000:.0f} GFLOP/s" for k, v in limits.matmul_tflops.items())
    return f"{limits.device}: memory {limits.memory_gb_per_s:.1f} GB/s, matmul {peaks}"
