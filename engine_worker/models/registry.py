"""Model architectures, looked up by the checkpoint's ``architectures`` name."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import nn

from engine_worker.layers.rotary import RopeConfig
from engine_worker.models.llama import LlamaConfig, LlamaForCausalLM


@dataclass(frozen=True, slots=True)
class ModelArch:
    """How to build one architecture: its module class and its config parser."""

    model_cls: type[nn.Module]
    parse_config: Callable[[dict[str, Any]], Any]


def _rope_from_hf(hf: dict[str, Any], head_dim: int) -> RopeConfig:
    # transformers >= 5 writes "rope_parameters" (theta included); older files write
    # "rope_theta" plus an optional "rope_scaling" whose type key is "rope_type" or "type".
    params = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    theta = params.pop("rope_theta", None) or hf.get("rope_theta", 10000.0)
    rope_type = params.pop("rope_type", None) or params.pop("type", None) or "default"
    if "original_max_position_embeddings" not in params and rope_type in ("llama3", "yarn"):
        params["original_max_position_embeddings"] = hf.get("max_position_embeddings")
    scaling = tuple(sorted({**params, "rope_type": rope_type}.items()))
    return RopeConfig(head_dim=head_dim, theta=float(theta),
                      max_position_embeddings=int(hf.get("max_position_embeddings", 2048)),
                      scaling=scaling)


def _llama_config(hf: dict[str, Any], *, qkv_bias: bool | None = None) -> LlamaConfig:
    """``qkv_bias`` fixed by the architecture (Qwen2: on q, k, v only); otherwise HF's
    ``attention_bias``, which in Llama and Mistral puts a bias on o_proj as well."""
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"model: hidden_act {hf.get('hidden_act')!r} is not supported (silu only)")
    num_heads = int(hf["num_attention_heads"])
    head_dim = int(hf.get("head_dim") or hf["hidden_size"] // num_heads)
    return LlamaConfig(
        vocab_size=int(hf["vocab_size"]),
        hidden_size=int(hf["hidden_size"]),
        intermediate_size=int(hf["intermediate_size"]),
        num_layers=int(hf["num_hidden_layers"]),
        num_heads=num_heads,
        num_kv_heads=int(hf.get("num_key_value_heads") or num_heads),
        head_dim=head_dim,
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        rope=_rope_from_hf(hf, head_dim),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        qkv_bias=bool(hf.get("attention_bias", False)) if qkv_bias is None else qkv_bias,
        o_bias=bool(hf.get("attention_bias", False)) if qkv_bias is None else False,
        mlp_bias=bool(hf.get("mlp_bias", False)),
    )


MODEL_REGISTRY: dict[str, ModelArch] = {
    "LlamaForCausalLM": ModelArch(LlamaForCausalLM, _llama_config),
    "MistralForCausalLM": ModelArch(LlamaForCausalLM, _llama_config),
    "Qwen2ForCausalLM": ModelArch(LlamaForCausalLM, lambda hf: _llama_config(hf, qkv_bias=True)),
}


def lookup_architecture(hf_config: dict[str, Any]) -> tuple[str, ModelArch]:
    """The first of the checkpoint's ``architectures`` that we implement, or ValueError."""
    names = hf_config.get("architectures") or []
    for name in names:
        if name in MODEL_REGISTRY:
            return name, MODEL_REGISTRY[name]
    raise ValueError(f"model: architecture {names!r} is not supported "
                     f"(supported: {sorted(MODEL_REGISTRY)})")
