"""What an engine is, decided once at start and never changed: the model, where and how it runs,
its KV cache, and the facts a router must share with it to trust its own block hashes.

``LLMEngine`` builds one ``EngineInfo`` at the end of its constructor; the servicer
(``GetModelInfo``), the metrics (``quire:backend_info``, ``quire:cuda_graphs_info``), the start
block (``progress.start_summary``), the offline ``LLM`` and the benchmarks read it, and none of
them reaches into the engine's collaborators. torch is imported for the annotations only, so
readers such as the metrics stay light.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from engine_worker.kv_cache.sizing import MemoryProfile


@dataclass(frozen=True, slots=True)
class EngineInfo:
    """The engine's facts. Counts are ``num_*``, sizes carry their unit."""

    # ---- the model
    model: str  # what was asked for: a path or a hub id (the embedded model's id by default)
    model_dir: Path  # the local directory the weights were loaded from
    tokenizer_dir: Path  # the directory of tokenizer.json (model_dir unless one was given)
    architecture: str  # the checkpoint's, e.g. "LlamaForCausalLM"
    max_model_len: int  # longest sequence, prompt plus output, in tokens
    vocab_size: int  # the tokenizer's (the model's embedding may have more rows)

    # ---- where and how it runs
    device: torch.device
    dtype: torch.dtype  # of the weights and of the KV cache
    num_threads: int  # torch's intra-op threads (what matters on a CPU)
    backend: str  # the kernel backend's registry name: "cpu", "cpu-avx2", "torch", ...
    attention: str  # the attention ops it runs: "torch", "triton", ...
    backend_reason: str  # why that one: requested, the fastest here, or why others could not run
    backend_fallback: bool  # a faster backend was preferred but cannot run here
    backend_summary: str  # one line for the log: name (what it is): reason
    cuda_graphs: str  # "on (35 batch sizes, 1 to 256)", "off (cpu)", "off (enforce_eager)"
    # "fused": the backend runs every decoder layer in one call a step; "per-layer": one
    # Python call per op (the backend fuses none of this model's stack; slower on a CPU)
    layer_execution: str
    # how the weights are held (weights.quantization): "gguf" (blocks multiplied natively),
    # "awq" / "gptq" (4-bit packed weights multiplied natively), "dequantize" (a quantized checkpoint widened to dtype) or "none" (a float checkpoint);
    # part of the cache identity: K/V differ between a 4-bit and a 16-bit engine
    quantization: str
    quantization_summary: str  # one line for the start block: method: why (tensor types)
    quantization_loud: bool  # a quantized format not run natively (all or some of it)

    # ---- the KV cache
    block_size: int  # tokens per block, the unit of prefix caching and of the block hashes
    num_kv_blocks: int
    kv_block_bytes: int  # K and V of one block in every layer
    enable_prefix_caching: bool  # blocks are cached, found again and reported as KV events
    # on a GPU sized from a profile: the device's memory as profiled, and how it was shared out
    memory_profile: MemoryProfile | None
    memory: str | None

    # ---- what a router must agree on before it trusts its hashes
    block_hash_algorithm: str
    block_hash_seed: int  # the chain's root hash
    tokenizer_digest: str  # SHA-256 of tokenizer.json

    # ---- speculative decoding: vLLM's speculative_config as it runs (JSON), "" when off
    speculative_config: str = ""
    # ---- what it serves (vLLM's --runner) and how embeddings pool (--pooler-config)
    runner: str = "generate"  # "generate": generation and embeddings; "pooling": embeddings
    pooling_type: str = "LAST"  # "LAST", "MEAN" or "CLS"
    pooling_normalize: bool = True  # embeddings are L2-normalised unless a request says not
    hidden_size: int = 0  # the embeddings' dimension
    # ---- how host memory is reused between steps (platform.keep_freed_memory)
    host_malloc: str = ""
    # how the KV cache's pages come in (kv_cache/prefault.py; "" off the CPU)
    kv_cache_pages: str = ""
    # LoRA (vLLM's arguments; max_* are 0 when LoRA is off)
    enable_lora: bool = False
    max_loras: int = 0
    max_lora_rank: int = 0
    max_cpu_loras: int = 0
    # ---- tensor parallelism: ranks, how they run ("mp"; "" alone) and their all-reduce
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    distributed_executor_backend: str = ""
    all_reduce_backend: str = "none"  # "gloo", "nccl", "shm"; "none" with one rank
    worker_pids: tuple[int, ...] = ()  # the worker processes of ranks 1 .. tp - 1

    @property
    def kv_capacity_tokens(self) -> int:
        """Tokens the whole KV cache holds."""
        return self.num_kv_blocks * self.block_size

    @property
    def kv_cache_bytes(self) -> int:
        return self.num_kv_blocks * self.kv_block_bytes
