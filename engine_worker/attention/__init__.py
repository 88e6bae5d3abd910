"""Attention backends, looked up by name."""

from engine_worker.attention.metadata import AttentionMetadata, PrefillChunk
from engine_worker.attention.torch_backend import TorchAttentionBackend

ATTENTION_BACKENDS = {"torch": TorchAttentionBackend}

__all__ = ["ATTENTION_BACKENDS", "AttentionMetadata", "PrefillChunk", "TorchAttentionBackend"]
