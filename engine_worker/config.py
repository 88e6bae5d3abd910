"""Grouped, frozen, validated engine configuration.

Every bad value raises ``ValueError`` naming the field. This module (and the CLI) are the only
places that read environment variables.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from engine_worker.lora.config import LoRAConfig
from engine_worker.spec_decode.config import SpeculativeConfig
from engine_worker.pooler_config import RUNNERS, PoolerConfig

DTYPE_NAMES = ("auto", "bfloat16", "float16", "float32")
QUANTIZATION_NAMES = ("auto", "gguf", "awq", "gptq", "dequantize")  # weights.quantization says what each does
_DTYPE_ALIASES = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32",
                  "float": "float32"}


def _check(cond: bool, name: str, message: str) -> None:
    if not cond:
        raise ValueError(f"{name}: {message}")


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def normalize_dtype(dtype: str) -> str:
    """Map user spellings (``bf16``, ``half``...) to a canonical dtype name, or raise."""
    name = _DTYPE_ALIASES.get(str(dtype).lower(), str(dtype).lower())
    name = name.removeprefix("torch.")
    _check(name in DTYPE_NAMES, "dtype", f"must be one of {DTYPE_NAMES}, got {dtype!r}")
    return name


def quire_cache_dir() -> Path:
    """Where converted models and other derived artefacts live (``QUIRE_CACHE_DIR``)."""
    root = os.environ.get("QUIRE_CACHE_DIR")
    if root:
        return Path(root)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "quire"


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """What to load and how. ``model=None`` means the embedded SmolLM2-135M-Instruct.
    ``runner`` (vLLM's): "generate" serves generation and embeddings, "pooling" embeddings
    only; ``pooler_config``: how embeddings pool (unset fields: the model's own config)."""

    model: str | None = None
    tokenizer: str | None = None
    dtype: str = "auto"
    max_model_len: int | None = None
    seed: int = 0
    quantization: str = "auto"
    runner: str = "generate"
    pooler_config: PoolerConfig = field(default_factory=PoolerConfig)

    def __post_init__(self) -> None:
        _check(self.runner in RUNNERS, "runner", f"must be one of {RUNNERS}, got "
               f"{self.runner!r}")
        object.__setattr__(self, "pooler_config", PoolerConfig.parse(self.pooler_config))
        object.__setattr__(self, "dtype", normalize_dtype(self.dtype))
        _check(self.quantization in QUANTIZATION_NAMES, "quantization",
               f"must be one of {QUANTIZATION_NAMES}, got {self.quantization!r}")
        if self.max_model_len is not None:
            _check(_is_int(self.max_model_len) and self.max_model_len > 0,
                   "max_model_len", f"must be a positive integer, got {self.max_model_len!r}")
        _check(_is_int(self.seed), "seed", f"must be an integer, got {self.seed!r}")


@dataclass(frozen=True, slots=True)
class CacheConfig:
    """Paged KV cache sizing.

    ``kv_cache_memory_bytes`` wins when given; otherwise ``gpu_memory_utilization`` (vLLM's
    name, kept on CPU too) is, on a GPU, the fraction of the device's total memory the engine
    may use (weights, profiled peak activations, CUDA graphs and the KV cache, which gets the
    rest; default 0.9), and on a CPU the fraction of available host memory given to the KV
    cache (default 0.25).
    """

    block_size: int = 16
    kv_cache_memory_bytes: int | None = None
    gpu_memory_utilization: float | None = None
    enable_prefix_caching: bool = True
    # fault the CPU cache's pages in at start (kv_cache/prefault.py); servers default to true
    kv_cache_prefault: bool = False

    def __post_init__(self) -> None:
        _check(isinstance(self.enable_prefix_caching, bool), "enable_prefix_caching",
               f"must be a boolean, got {self.enable_prefix_caching!r}")
        _check(isinstance(self.kv_cache_prefault, bool), "kv_cache_prefault",
               f"must be a boolean, got {self.kv_cache_prefault!r}")
        _check(_is_int(self.block_size) and self.block_size in (1, 2, 4, 8, 16, 32, 64,
                                                                         128, 256),
               "block_size", f"must be a power of two between 1 and 256, got {self.block_size!r}")
        if self.kv_cache_memory_bytes is not None:
            _check(_is_int(self.kv_cache_memory_bytes) and self.kv_cache_memory_bytes > 0,
                   "kv_cache_memory_bytes",
                   f"must be a positive integer, got {self.kv_cache_memory_bytes!r}")
        if self.gpu_memory_utilization is not None:
            _check(isinstance(self.gpu_memory_utilization, (int, float))
                   and 0.0 < self.gpu_memory_utilization <= 1.0, "gpu_memory_utilization",
                   f"must be in (0, 1], got {self.gpu_memory_utilization!r}")


SCHEDULING_POLICIES = ("fcfs", "priority")
MAX_SCHEDULER_STEPS = 64


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """Continuous-batching limits for one engine step."""

    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256
    scheduling_policy: str = "fcfs"
    long_prefill_token_threshold: int = 0
    short_prompts_first: bool = False
    # vLLM's multi-step scheduling: a step of only decodes, with nothing waiting, may run up to
    # this many forward passes back to back under one scheduling decision (1: one a step;
    # servers default to 1, see arg_utils.SERVER_DEFAULTS)
    num_scheduler_steps: int = 8

    def __post_init__(self) -> None:
        _check(_is_int(self.max_num_batched_tokens) and self.max_num_batched_tokens > 0,
               "max_num_batched_tokens",
               f"must be a positive integer, got {self.max_num_batched_tokens!r}")
        _check(_is_int(self.max_num_seqs) and self.max_num_seqs > 0,
               "max_num_seqs", f"must be a positive integer, got {self.max_num_seqs!r}")
        _check(self.scheduling_policy in SCHEDULING_POLICIES, "scheduling_policy",
               f"must be one of {SCHEDULING_POLICIES}, got {self.scheduling_policy!r}")
        _check(_is_int(self.long_prefill_token_threshold)
               and self.long_prefill_token_threshold >= 0, "long_prefill_token_threshold",
               f"must be a non-negative integer, got {self.long_prefill_token_threshold!r}")
        _check(isinstance(self.short_prompts_first, bool), "short_prompts_first",
               f"must be a boolean, got {self.short_prompts_first!r}")
        _check(_is_int(self.num_scheduler_steps)
               and 1 <= self.num_scheduler_steps <= MAX_SCHEDULER_STEPS, "num_scheduler_steps",
               f"must be an integer from 1 to {MAX_SCHEDULER_STEPS}, got "
               f"{self.num_scheduler_steps!r}")


KERNEL_CHOICES = ("auto", "torch", "cpu", "cpu-avx2", "triton")  # "auto" and the keys of backends.BACKENDS
ATTENTION_CHOICES = ("auto", "torch", "triton")  # "auto": the kernel backend's own


@dataclass(frozen=True, slots=True)
class DeviceConfig:
    """Which torch device runs the model (``auto`` picks CUDA when torch sees one), and which
    kernel backend (``engine_worker.backends``): ``cpu`` is the compiled set in ``csrc/cpu``,
    ``torch`` the pure-PyTorch reference, ``auto`` the fastest that runs on the device (the
    engine says at start which one runs and why). ``enforce_eager`` turns CUDA graphs off:
    every step then runs eagerly (graphs only ever run on a GPU)."""

    device: str = "auto"
    num_threads: int | None = None
    kernels: str = "auto"
    attention_backend: str = "auto"  # another attention than the kernel backend's own
    enforce_eager: bool = False

    def __post_init__(self) -> None:
        _check(isinstance(self.enforce_eager, bool), "enforce_eager",
               f"must be a boolean, got {self.enforce_eager!r}")
        _check(self.kernels in KERNEL_CHOICES, "kernels",
               f"must be one of {KERNEL_CHOICES}, got {self.kernels!r}")
        _check(self.attention_backend in ATTENTION_CHOICES, "attention_backend",
               f"must be one of {ATTENTION_CHOICES}, got {self.attention_backend!r}")
        _check(isinstance(self.device, str)
               and re.fullmatch(r"auto|cpu|cuda(:\d+)?", self.device) is not None, "device", f"must be 'auto', 'cpu' or 'cuda[:N]', got {self.device!r}")
        if self.num_threads is not None:
            _check(_is_int(self.num_threads) and self.num_threads > 0, "num_threads",
                   f"must be a positive integer, got {self.num_threads!r}")


DISTRIBUTED_EXECUTOR_BACKENDS = ("mp",)


@dataclass(frozen=True, slots=True)
class ParallelConfig:
    """How one model is split across processes (vLLM's names). ``tensor_parallel_size`` ranks
    each hold a slice of every layer; the engine core (scheduler, sampling) is rank 0, in the
    engine's own process, and the other ranks are worker processes it starts (``mp``) and
    talks to over torch.distributed (``engine_worker.distributed``).
    ``pipeline_parallel_size`` stages hold contiguous runs of layers, each stage split in
    ``tensor_parallel_size`` ranks."""

    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    distributed_executor_backend: str = "mp"
    # the fewest tokens of a pipeline micro-batch (a step of at least twice this many goes
    # through the stages in pieces that overlap); 0: every step whole
    pipeline_micro_batch_tokens: int = 64

    def __post_init__(self) -> None:
        _check(_is_int(self.tensor_parallel_size) and self.tensor_parallel_size >= 1,
               "tensor_parallel_size",
               f"must be a positive integer, got {self.tensor_parallel_size!r}")
        _check(_is_int(self.pipeline_parallel_size) and self.pipeline_parallel_size >= 1,
               "pipeline_parallel_size",
               f"must be a positive integer, got {self.pipeline_parallel_size!r}")
        _check(_is_int(self.pipeline_micro_batch_tokens) and self.pipeline_micro_batch_tokens >= 0,
               "pipeline_micro_batch_tokens",
               f"must be a non-negative integer, got {self.pipeline_micro_batch_tokens!r}")
        _check(self.distributed_executor_backend in DISTRIBUTED_EXECUTOR_BACKENDS,
               "distributed_executor_backend", f"must be one of "
               f"{DISTRIBUTED_EXECUTOR_BACKENDS}, got {self.distributed_executor_backend!r}")

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """All groups together; built once by ``EngineArgs.create_engine_config``."""

    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    device: DeviceConfig = field(default_factory=DeviceConfig)
    speculative: SpeculativeConfig | None = None  # None: no speculative decoding
    lora: LoRAConfig | None = None  # None: LoRA adapters are off (enable_lora false)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)


@dataclass(slots=True)
class EngineArgs:
    """vLLM-style flat engine arguments, as ``LLM(...)`` and ``quire engine`` take them."""

    model: str | None = None
    tokenizer: str | None = None
    dtype: str = "auto"
    quantization: str = "auto"
    max_model_len: int | None = None
    block_size: int = 16
    kv_cache_memory_bytes: int | None = None
    gpu_memory_utilization: float | None = None
    enable_prefix_caching: bool = True
    kv_cache_prefault: bool = False
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    scheduling_policy: str = "fcfs"
    long_prefill_token_threshold: int = 0
    short_prompts_first: bool = False
    # decode passes per scheduling decision (vLLM's --num-scheduler-steps); 8 for ``LLM``,
    # where every request is known at the start and nothing streams, 1 for a server
    num_scheduler_steps: int = 8
    seed: int = 0
    device: str = "auto"
    num_threads: int | None = None
    kernels: str = "auto"
    attention_backend: str = "auto"
    enforce_eager: bool = False
    # vLLM's: a dict, or its JSON text on the command line (None: off); see spec_decode.config
    speculative_config: str | dict | None = None
    runner: str = "generate"
    # JSON text (a flag), a dict or a PoolerConfig: {"pooling_type": ..., "normalize": ...}
    pooler_config: str | None = None
    # vLLM's LoRA arguments: adapters in one step, their largest rank, adapters kept loaded
    # in host memory (default max_loras), and adapters loaded at start (name=path ...)
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    lora_modules: str | None = None
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    distributed_executor_backend: str = "mp"
    pipeline_micro_batch_tokens: int = 64

    def create_engine_config(self) -> EngineConfig:
        if not isinstance(self.enable_lora, bool):
            raise ValueError(f"enable_lora: must be a boolean, got {self.enable_lora!r}")
        # adapters given at start turn LoRA on (vLLM asks for --enable-lora as well)
        enable_lora = self.enable_lora or bool(self.lora_modules)
        return EngineConfig(
            model=ModelConfig(model=self.model, tokenizer=self.tokenizer, dtype=self.dtype,
                              max_model_len=self.max_model_len, seed=self.seed,
                              quantization=self.quantization, runner=self.runner,
                              pooler_config=self.pooler_config),
            cache=CacheConfig(block_size=self.block_size,
                              kv_cache_memory_bytes=self.kv_cache_memory_bytes,
                              gpu_memory_utilization=self.gpu_memory_utilization,
                              enable_prefix_caching=self.enable_prefix_caching,
                              kv_cache_prefault=self.kv_cache_prefault),
            scheduler=SchedulerConfig(max_num_batched_tokens=self.max_num_batched_tokens,
                                      max_num_seqs=self.max_num_seqs,
                                      scheduling_policy=self.scheduling_policy,
                                      long_prefill_token_threshold=self.long_prefill_token_threshold,
                                      short_prompts_first=self.short_prompts_first,
                                      num_scheduler_steps=self.num_scheduler_steps),
            device=DeviceConfig(device=self.device, num_threads=self.num_threads,
                                kernels=self.kernels,
                                attention_backend=self.attention_backend,
                                enforce_eager=self.enforce_eager),
            speculative=SpeculativeConfig.parse(self.speculative_config),
            lora=LoRAConfig(max_loras=self.max_loras, max_lora_rank=self.max_lora_rank,
                            max_cpu_loras=self.max_cpu_loras, lora_modules=self.lora_modules)
            if enable_lora else None,
            parallel=ParallelConfig(
                tensor_parallel_size=self.tensor_parallel_size,
                pipeline_parallel_size=self.pipeline_parallel_size,
                distributed_executor_backend=self.distributed_executor_backend,
                pipeline_micro_batch_tokens=self.pipeline_micro_batch_tokens),
        )
