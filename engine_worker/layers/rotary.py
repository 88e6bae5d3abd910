"""Rotary position embedding (Su et al., 2021), NeoX layout, with the config's frequency scaling.

The cos/sin table is built once for every position up to ``max_position`` in fp32, then looked up
by the flat ``positions`` of a step, so prefill chunks and decodes share one code path.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True, slots=True)
class RopeConfig:
    """``scaling`` holds the checkpoint's rope_scaling / rope_parameters keys (``rope_type``...)."""

    head_dim: int
    theta: float
    max_position_embeddings: int
    scaling: tuple[tuple[str, object], ...] = ()

    @property
    def rope_type(self) -> str:
        return str(dict(self.scaling).get("rope_type", "default"))


def _base_inv_freq(cfg: RopeConfig) -> torch.Tensor:
    exponents = torch.arange(0, cfg.head_dim, 2, dtype=torch.int64).to(torch.float32)
    return 1.0 / (cfg.theta ** (exponents / cfg.head_dim))


def _default(cfg: RopeConfig) -> tuple[torch.Tensor, float]:
    return _base_inv_freq(cfg), 1.0


def _linear(cfg: RopeConfig) -> tuple[torch.Tensor, float]:
    return _base_inv_freq(cfg) / float(dict(cfg.scaling)["factor"]), 1.0


def _llama3(cfg: RopeConfig) -> tuple[torch.Tensor, float]:
    """Llama 3.1: low frequencies divided by ``factor``, high kept, a smooth ramp between."""
    s = dict(cfg.scaling)
    inv_freq = _base_inv_freq(cfg)
    factor, low, high = float(s["factor"]), float(s["low_freq_factor"]), float(s["high_freq_factor"])
    old_len = float(s["original_max_position_embeddings"])
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(is_medium, smoothed, scaled), 1.0


def _yarn(cfg: RopeConfig) -> tuple[torch.Tensor, float]:
    """YaRN (Peng et al., 2023): interpolate low frequencies, extrapolate high ones, and scale
    attention by ``0.1 ln(factor) + 1``."""
    s = dict(cfg.scaling)
    dim, base = cfg.head_dim, cfg.theta
    orig_len = s.get("original_max_position_embeddings") or cfg.max_position_embeddings
    factor = s.get("factor") or cfg.max_position_embeddings / orig_len

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = s.get("attention_factor")
    if attention_factor is None:
        if s.get("mscale") and s.get("mscale_all_dim"):
            attention_factor = mscale(factor, s["mscale"]) / mscale(factor, s["mscale_all_dim"])
        else:
            attention_factor = mscale(factor)

    def correction_dim(num_rotations: float) -> float:
        return dim * math.log(orig_len / (num_rotations * 2 * math.pi)) / (2 * math.log(base))

    low = correction_dim(s.get("beta_fast") or 32)
    high = correction_dim(s.get("beta_slow") or 1)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation_weight = 1 - ramp
    pos_freqs = base ** (torch.arange(0, dim, 2).to(torch.float32) / dim)
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation_weight) \
        + (1.0 / pos_freqs) * extrapolation_weight
    return inv_freq, float(attention_factor)


ROPE_SCALINGS: dict[str, Callable[[RopeConfig], tuple[torch.Tensor, float]]] = {
    "default": _default,
    "linear": _linear,
    "llama3": _llama3,
    "yarn": _yarn,
}


class RotaryEmbedding(nn.Module):
    """Holds the cos/sin tables; ``kernel`` (the backend's rope) applies them."""

    def __init__(self, cfg: RopeConfig, max_position: int, device: torch.device,
                 kernel: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None = None) -> None:
        super().__init__()
        self.kernel = kernel or apply_rope
        if cfg.rope_type not in ROPE_SCALINGS:
            raise ValueError(f"rope_scaling: type {cfg.rope_type!r} is not supported "
                             f"(supported: {sorted(ROPE_SCALINGS)})")
        # Built on the CPU in fp32 (also when the model is constructed on the meta device).
        with torch.device("cpu"):
            inv_freq, attention_factor = ROPE_SCALINGS[cfg.rope_type](cfg)
            positions = torch.arange(max_position, dtype=torch.float32)
            freqs = positions[:, None] * inv_freq[None, :]  # [max_position, head_dim / 2]
            emb = torch.cat((freqs, freqs), dim=-1)  # [max_position, head_dim]
            cos, sin = emb.cos() * attention_factor, emb.sin() * attention_factor
        self.register_buffer("cos", cos.to(device), persistent=False)
        self.register_buffer("sin", sin.to(device), persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor,
                k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # positions: [num_tokens]; q: [num_tokens, num_heads, head_dim]; k: [.., num_kv_heads, ..]
        return self.kernel(positions, q, k, self.cos, self.sin)


def apply_rope(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
               sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference: new tensors; cos and sin are the fp32 tables, looked up by position."""
    cos = cos[positions].unsqueeze(1).to(q.dtype)
    sin = sin[positions].unsqueeze(1).to(q.dtype)
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
