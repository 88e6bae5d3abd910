"""Attention backends, looked up by name."""

from engine_worker.attention.cpu_backend import CpuPagedAttentionBackend
from engine_worker.attention.metadata import AttentionMetadata, PrefillChunk
from engine_worker.attention.torch_backend import TorchAttentionBackend

ATTENTION_BACKENDS = {"torch": TorchAttentionBackend, "cpu": CpuPagedAttentionBackend}

__all__ = ["ATTENTION_BACKENDS", "AttentionMetadata", "CpuPagedAttentionBackend",
           "PrefillChunk", "TorchAttentionBackend"]
