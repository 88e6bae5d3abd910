"""``EngineInfo`` values for tests of its readers (metrics, the start block), built by hand."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from engine_worker.engine_info import EngineInfo
from quire.block_hash import BLOCK_HASH_ALGORITHM, ROOT_HASH

CPU_INFO = EngineInfo(
    model="tiny", model_dir=Path("/models/tiny-llama"), tokenizer_dir=Path("/models/tiny-llama"),
    architecture="LlamaForCausalLM", max_model_len=512, vocab_size=49152,
    device=torch.device("cpu"), dtype=torch.float32, num_threads=2, backend="torch",
    attention="torch", backend_reason="requested (kernels=torch)", backend_fallback=False,
    backend_summary="torch (reference ops): requested (kernels=torch)",
    cuda_graphs="off (cpu)", layer_execution="per-layer", quantization="none",
    quantization_summary="none: the checkpoint is not quantized", quantization_loud=False,
    block_size=16, num_kv_blocks=64, kv_block_bytes=24576,
    enable_prefix_caching=True, memory_profile=None, memory=None,
    block_hash_algorithm=BLOCK_HASH_ALGORITHM, block_hash_seed=ROOT_HASH,
    tokenizer_digest="0" * 64)


def engine_info(**changes) -> EngineInfo:
    return dataclasses.replace(CPU_INFO, **changes)
