"""Per-step attention metadata; the attention implementations are backends'
(``engine_worker.backends``)."""

from engine_worker.attention.metadata import AttentionMetadata, PrefillChunk

__all__ = ["AttentionMetadata", "PrefillChunk"]
