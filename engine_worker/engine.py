"""The engine step API: ``add_request``, ``step``, ``abort_request``, ``has_unfinished_requests``.

Synchronous and single-threaded; the gRPC server drives it from its own loop thread. One step:
schedule -> run the model -> update the scheduler -> detokenize and build outputs. ``step()``
returns a ``StepResult``: the outputs, the counts after the step and the KV events it sealed, so
nothing outside reaches into the scheduler or the cache manager. What was decided at start (the
model, backend, dtype, KV cache size, ...) is one frozen ``EngineInfo``, ``engine.info``.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from engine_worker.backends import select_backend
from engine_worker.config import EngineArgs, EngineConfig
from engine_worker.distributed.executor import MultiprocExecutor
from engine_worker.distributed.shard import PPStage, TPShard
from engine_worker.distributed.worker import WorkerSpec, WorkerStart
from engine_worker.engine_info import EngineInfo
from engine_worker.grammar import GrammarCompilerCache
from engine_worker.input_processor import InputProcessor, PromptType
from engine_worker.kv_cache.events import KVEventRecorder
from engine_worker.kv_cache.manager import KVCacheManager, KVCacheStats
from engine_worker.kv_cache.prefault import LAZY, prefault_kv_cache
from engine_worker.lora.cache import UnknownLoRAError
from engine_worker.lora.manager import LoRAManager, LoRAStats
from engine_worker.lora.request import LoRARequest
from engine_worker.kv_cache.sizing import (MemoryProfile, bytes_per_block, kv_budget_bytes,
                                           num_blocks_for_budget, profiled_kv_budget_bytes)
from engine_worker.model_runner.graphs import (CudaGraphChoice, CudaGraphDecoder,
                                               build_graph_decoder, choose_cuda_graphs)
from engine_worker.model_runner.profiling import CudaMemory, profile_memory
from engine_worker.model_runner.runner import ModelRunner
from engine_worker.output_processor import OutputProcessor
from engine_worker.outputs import RequestOutput
from engine_worker.platform import (allocate_zeroed, available_memory_bytes, keep_freed_memory,
                                   select_device, select_dtype)
from engine_worker.pooler import Pooler
from engine_worker.pooling_params import PoolingParams
from engine_worker.progress import progress, start_summary
from engine_worker.request import RequestStatus
from engine_worker.sampling_params import SamplingParams
from engine_worker.scheduler.multi_step import steps_across_ranks
from engine_worker.scheduler.scheduler import Scheduler
from engine_worker.spec_decode.draft_model import DraftShape
from engine_worker.spec_decode.methods import TargetFacts, build_speculator
from engine_worker.spec_decode.speculator import Speculator
from engine_worker.step_types import SchedulerStats
from engine_worker.tokenizer import Tokenizer
from engine_worker.weights.loader import LoadedModel, load_model, read_hf_config
from engine_worker.models.registry import lookup_architecture
from engine_worker.weights.int4_checkpoint import INT4_METHODS
from engine_worker.weights.int4_choice import checkpoint_format_of
from engine_worker.weights.quantization import choose_quantization
from engine_worker.weights.resolve import (EMBEDDED_MODEL_ID, gguf_path_of, resolve_model,
                                           resolve_model_dir)
from quire.errors import FieldError
from quire.block_hash import BLOCK_HASH_ALGORITHM, ROOT_HASH
from quire.kv_events import KVCacheSnapshot, KVEventBatch
from quire.tokenizer_digest import tokenizer_dir_digest

logger = logging.getLogger(__name__)

# a CPU step's token budget while only pooling requests are unfinished (see
# LLMEngine._pooling_batched_tokens)
POOLING_STEP_TOKENS = 8192


class EngineDeadError(RuntimeError):
    """A step failed; the engine's state is unknown and it serves nothing more."""


@dataclass(frozen=True, slots=True)
class EngineStats:
    """The engine's counts at one moment: its scheduler's and its KV cache's."""

    scheduler: SchedulerStats
    kv_cache: KVCacheStats
    lora: LoRAStats | None = None  # None: LoRA is off


@dataclass(frozen=True, slots=True)
class StepResult:
    """What one ``LLMEngine.step()`` produced: outputs of every request that progressed or
    finished, the counts after the step, and the KV-event batches sealed since the last step
    (in order; a consumer mirroring the cache applies each exactly once)."""

    outputs: list[RequestOutput]
    stats: EngineStats
    kv_event_batches: tuple[KVEventBatch, ...]


@dataclass(frozen=True, slots=True)
class KVCacheSize:
    """How large the KV cache was made and, on a GPU sized from a profile, the profile and
    how the memory was shared out."""

    num_blocks: int
    block_bytes: int
    memory_profile: MemoryProfile | None
    memory: str | None


class LLMEngine:
    """One model, one KV cache, one scheduler; ``info`` holds the facts fixed at start."""

    def __init__(self, config: EngineConfig) -> None:
        """Choose the device, kernels and dtype, load the model and tokenizer, size and
        allocate the KV cache, build the collaborators, record the facts and announce them."""
        start = time.monotonic()
        self.config = config
        self.dead_reason: str | None = None  # set when a step failed; the engine is unusable
        self._executor: MultiprocExecutor | None = None
        world_size = config.parallel.world_size
        self._host_malloc = keep_freed_memory()
        if config.device.num_threads:
            torch.set_num_threads(config.device.num_threads)
        elif world_size > 1:  # the ranks share the cores: one torch team each
            torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // world_size))
        self._device = select_device(config.device.device)
        self._backend = select_backend(config.device.kernels, self._device,
                                       config.device.attention_backend)
        self._quantization = choose_quantization(
            config.model.quantization,
            checkpoint_format=checkpoint_format_of(config.model.model),
            backend=self._backend.name, native_types=self._backend.backend.quantized_types)
        self._source = resolve_model(config.model.model, native_gguf=self._quantization.native)
        self._model_dir = self._source.model_dir
        self._tokenizer_dir = (resolve_model_dir(config.model.tokenizer)
                               if config.model.tokenizer else self._model_dir)
        self._dtype = select_dtype(config.model.dtype, self._device, self._backend.name)
        if world_size > 1:
            self._executor = self._start_workers()
        try:
            self._start_rank0(start)
        except BaseException:
            self.shutdown()
            raise

    def _start_rank0(self, start: float) -> None:
        """The rest of the start, in this process: the engine core and rank 0's shard."""
        config = self.config
        loaded, self.tokenizer = self._load_model_and_tokenizer()
        self._max_model_len = loaded.max_model_len
        self._pooler = Pooler(config.model.pooler_config.resolved(self._model_dir))
        # the adapters' slots before the memory profile (their bytes are counted) and the
        # graphs (which record the deltas over them)
        self._lora = None if config.lora is None else LoRAManager.for_model(
            loaded.model, config.lora, self._backend.name, self._dtype, self._device)
        self._graph_choice = self._choose_cuda_graphs(loaded.model)
        size = self._size_kv_cache(loaded.model)
        self._speculator = self._build_speculator(loaded, size.num_blocks)
        if self._executor is not None:
            with progress(logger, "Starting the tensor-parallel workers' runners"):
                self._executor.start_workers(WorkerStart(
                    num_blocks=size.num_blocks, block_size=config.cache.block_size,
                    eos_token_ids=self.tokenizer.eos_token_ids, seed=config.model.seed,
                    pooler_config=self._pooler.config,
                    kv_cache_prefault=config.cache.kv_cache_prefault))
        kv_caches = self._allocate_kv_cache(loaded.model, size.num_blocks)
        self._build(loaded.model, kv_caches, size.num_blocks)
        self.info = self._facts(loaded, size)
        self._pending_outputs: list[RequestOutput] = []
        self._load_lora_modules()
        self._announce(time.monotonic() - start)

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> LLMEngine:
        return cls(args.create_engine_config())

    # ------------------------------------------------------------------- start-up
    def _start_workers(self) -> MultiprocExecutor:
        """Tensor parallelism: check the model splits, then start ranks 1 .. tp - 1 (they load
        their slices while this process loads rank 0's)."""
        parallel = self.config.parallel
        tp, world_size = parallel.tensor_parallel_size, parallel.world_size
        _, arch = lookup_architecture(hf := read_hf_config(self._model_dir))
        cfg = arch.parse_config(hf)
        TPShard.of(0, tp, num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads,
                   intermediate_size=cfg.intermediate_size, vocab_size=cfg.vocab_size)
        PPStage.of(0, parallel.pipeline_parallel_size, cfg.num_layers)
        if self._device.type == "cuda" and torch.cuda.device_count() < world_size:
            raise ValueError(f"tensor_parallel_size: {tp} x pipeline_parallel_size "
                             f"{parallel.pipeline_parallel_size} needs {world_size} GPUs, "
                             f"torch sees {torch.cuda.device_count()}")
        spec = WorkerSpec(rank=0, world_size=world_size, tensor_parallel_size=tp, store_port=0,
                          model_dir=self._model_dir, gguf=self._source.gguf,
                          strict_quantization=self._quantization.strict,
                          int4_native=self._quantization.method in INT4_METHODS,
                          pipeline_micro_batch_tokens=parallel.pipeline_micro_batch_tokens,
                          lora=self.config.lora,
                          dtype=self._dtype, device=self._device.type,
                          kernels=self._backend.name,
                          attention_backend=self._backend.backend.attention.name,
                          max_model_len=self.config.model.max_model_len,
                          num_threads=torch.get_num_threads(),
                          log_level=logging.getLogger().getEffectiveLevel())
        with progress(logger, f"Starting {world_size - 1} worker process"
                              f"{'es' if world_size > 2 else ''} (one a rank)"):
            return MultiprocExecutor(spec, on_failure=self._worker_failed)

    def _worker_failed(self, reason: str) -> None:
        # from the executor's watcher thread: the next step (or the server's loop) sees it
        if self.dead_reason is None:
            self.dead_reason = reason

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers (a no-op for one process); the engine serves
        nothing more afterwards. Also done when the engine is collected or Python exits."""
        if self._executor is not None:
            self._executor.shutdown()
            if self.dead_reason is None:
                self.dead_reason = "the engine was shut down"

    def _load_model_and_tokenizer(self) -> tuple[LoadedModel, Tokenizer]:
        loaded = load_model(self._model_dir, dtype=self._dtype, device=self._device,
                            backend=self._backend.backend,
                            max_model_len=self.config.model.max_model_len,
                            gguf=self._source.gguf, strict_quantization=self._quantization.strict,
                            comm=None if self._executor is None else self._executor.comm,
                            int4_native=self._quantization.method in INT4_METHODS,
                            micro_batch_tokens=self.config.parallel.pipeline_micro_batch_tokens)
        with progress(logger, "Loading the tokenizer"):
            return loaded, Tokenizer(self._tokenizer_dir)

    def _choose_cuda_graphs(self, model) -> CudaGraphChoice:
        sched = self.config.scheduler
        return choose_cuda_graphs(
            # a pooling runner never decodes: nothing to capture
            device=self._device, enforce_eager=self.config.device.enforce_eager
            or self.config.model.runner == "pooling"
            # collectives inside captured graphs are unproven here: eager under parallelism
            or self.config.parallel.world_size > 1,
            attention=self._backend.backend.attention.name,
            # a fused stack says whether its launches are graph-ready (backends/base.py)
            fused_layers=model.layer_stack is not None
            and not getattr(model.layer_stack, "graph_ready", False),
            max_num_seqs=sched.max_num_seqs,
            max_num_batched_tokens=sched.max_num_batched_tokens)

    def _size_kv_cache(self, model) -> KVCacheSize:
        """As many blocks as the budget holds: a profile's leftover on a GPU unless a size
        was given, else the given size or a share of the available memory."""
        cache, cfg = self.config.cache, model.cfg
        block_bytes = bytes_per_block(num_layers=cfg.num_layers, block_size=cache.block_size,
                                      num_kv_heads=model.shard.num_kv_heads,
                                      head_dim=cfg.head_dim,
                                      dtype_bytes=torch.finfo(self._dtype).bits // 8)
        if self._device.type == "cpu":  # the ranks' slices share this host's memory
            block_bytes *= model.shard.size
        profile = None
        if self._device.type == "cuda" and cache.kv_cache_memory_bytes is None:
            profile = self._profile_memory(model)
            budget = profiled_kv_budget_bytes(profile, cache.gpu_memory_utilization)
        else:
            budget = kv_budget_bytes(kv_cache_memory_bytes=cache.kv_cache_memory_bytes,
                                     memory_utilization=cache.gpu_memory_utilization,
                                     available_bytes=available_memory_bytes(self._device),
                                     on_gpu=self._device.type == "cuda")
        num_blocks = num_blocks_for_budget(budget_bytes=budget, block_bytes=block_bytes)
        capacity = num_blocks * cache.block_size
        if capacity < self._max_model_len:
            logger.warning("KV cache holds %d tokens, less than max_model_len=%d: longer "
                           "requests will be rejected", capacity, self._max_model_len)
        return KVCacheSize(num_blocks=num_blocks, block_bytes=block_bytes, memory_profile=profile,
                           memory=None if profile is None else profile.describe(
                               cache.gpu_memory_utilization, num_blocks * block_bytes))

    def _profile_memory(self, model) -> MemoryProfile:
        """The device's memory before the KV cache is sized: a dummy step at the scheduler's
        limits for the peak activations, then, where graphs will run, their memory, captured
        once over a one-block scratch cache and freed. The real graphs are captured after the
        cache is allocated (they hold its addresses) and take what was measured."""
        cache, sched, cfg = self.config.cache, self.config.scheduler, model.cfg
        with progress(logger, "Profiling memory at the largest step"):
            profile = profile_memory(model, CudaMemory(self._device),
                                     num_tokens=sched.max_num_batched_tokens,
                                     num_seqs=sched.max_num_seqs,
                                     max_model_len=self._max_model_len,
                                     block_size=cache.block_size, device=self._device)
        if not self._graph_choice.enabled:
            return profile
        scratch = torch.zeros(2, 1, cache.block_size, cfg.num_kv_heads, cfg.head_dim,
                              dtype=self._dtype, device=self._device)
        with progress(logger, "Measuring CUDA graph memory"):
            graph_bytes = CudaGraphDecoder.measure_bytes(lambda: self._graph_decoder(model),
                                                         [scratch] * cfg.num_layers)
        return dataclasses.replace(profile, cuda_graph_bytes=graph_bytes)

    def _pooling_batched_tokens(self) -> int:
        """A step's token budget while only pooling requests are unfinished. On a CPU, steps
        of POOLING_STEP_TOKENS: each step's fork/joins (a dozen a layer) and weight passes are
        spread over four times the tokens of the default budget (32 mixed-length inputs:
        about a fifth less CPU time on a loaded Zen 3), with nothing to stall and no memory
        profile that a wider step would outgrow (activations of 8192 tokens are ~0.1 GB a
        buffer for a 135M model). Elsewhere the profiled step (max_num_batched_tokens) bounds
        the activation memory, so the budget stays that."""
        sched = self.config.scheduler
        if self._device.type != "cpu":
            return sched.max_num_batched_tokens
        return max(sched.max_num_batched_tokens, POOLING_STEP_TOKENS)

    def _graph_decoder(self, model) -> CudaGraphDecoder:
        lora_view = self._lora.graph_batch \
            if self._lora is not None and self._lora.graph_ready else None
        return build_graph_decoder(model, self._graph_choice.sizes, self._max_model_len,
                                   self.config.cache.block_size, self._device, lora_view)

    def _build_speculator(self, loaded: LoadedModel, num_blocks: int) -> Speculator | None:
        """The speculator of ``speculative_config`` (a draft model is loaded here, on the
        target's device, dtype and kernels, and checked against the target)."""
        target = TargetFacts(
            device=self._device, dtype=self._dtype, backend=self._backend.backend,
            shape=DraftShape(vocab_size=loaded.model.cfg.vocab_size,
                             block_size=self.config.cache.block_size,
                             max_model_len=self._max_model_len),
            num_kv_blocks=num_blocks, tokenizer_digest=tokenizer_dir_digest(self._tokenizer_dir))
        return build_speculator(self.config.speculative, self._device.type, target)

    def _allocate_kv_cache(self, model, num_blocks: int) -> list[torch.Tensor]:
        with progress(logger, "Allocating the KV cache"):
            # one tensor a layer: [2 (K, V), num_blocks, block_size, num_kv_heads, head_dim]
            kv_caches = [allocate_zeroed(shape, self._dtype, self._device) for shape
                         in model.kv_cache_shapes(num_blocks, self.config.cache.block_size)]
        self._kv_cache_pages = "" if self._device.type != "cpu" else LAZY
        if self.config.cache.kv_cache_prefault and self._device.type == "cpu":
            with progress(logger, "Faulting the KV cache's pages in"):
                self._kv_cache_pages = prefault_kv_cache(kv_caches, torch.get_num_threads())
        return kv_caches

    def _build(self, model, kv_caches: list[torch.Tensor], num_blocks: int) -> None:
        """The collaborators: graphs (captured over the real cache), KV events, the cache
        manager, the scheduler, the runner and the input and output processors."""
        cache, sched = self.config.cache, self.config.scheduler
        graphs = None
        if self._graph_choice.enabled:
            with progress(logger, f"Capturing CUDA graphs ({self._graph_choice.reason})"):
                graphs = self._graph_decoder(model)
                graphs.capture(kv_caches)
        lora = self.config.lora
        self._kv_events = KVEventRecorder(medium=self._device.type)
        self._kv_cache_manager = KVCacheManager(num_blocks, cache.block_size,
                                                cache.enable_prefix_caching, self._kv_events)
        self._scheduler = Scheduler(
            kv_cache_manager=self._kv_cache_manager,
            max_num_batched_tokens=sched.max_num_batched_tokens, max_num_seqs=sched.max_num_seqs,
            max_model_len=self._max_model_len, policy=sched.scheduling_policy,
            long_prefill_token_threshold=sched.long_prefill_token_threshold,
            short_prompts_first=sched.short_prompts_first, speculator=self._speculator,
            max_loras=None if lora is None else lora.max_loras,
            pooling_batched_tokens=self._pooling_batched_tokens(),
            num_scheduler_steps=steps_across_ranks(sched.num_scheduler_steps,
                                                   self.config.parallel.world_size))
        self.runner = ModelRunner(model, kv_caches, cache.block_size, self._device,
                                  model.cfg.vocab_size, self.tokenizer.eos_token_ids,
                                  self.config.model.seed, graphs=graphs, pooler=self._pooler,
                                  lora=self._lora,
                                  sampling_kernels=self._backend.backend.sampling)
        self.input_processor = InputProcessor(
            self.tokenizer, max_model_len=self._max_model_len,
            kv_capacity_tokens=num_blocks * cache.block_size, vocab_size=model.cfg.vocab_size,
            max_num_seqs=sched.max_num_seqs, pooler_config=self._pooler.config,
            runner=self.config.model.runner)
        self.output_processor = OutputProcessor(self.tokenizer)
        # structured outputs: xgrammar needs the logits' width, which may exceed the tokenizer's
        tokenizer = self.tokenizer
        self.grammars = GrammarCompilerCache(lambda: tokenizer.hf, model.cfg.vocab_size,
                                             tokenizer.eos_token_ids)

    def _facts(self, loaded: LoadedModel, size: KVCacheSize) -> EngineInfo:
        cache, backend = self.config.cache, self._backend
        return EngineInfo(
            model=self.config.model.model or EMBEDDED_MODEL_ID, model_dir=self._model_dir,
            tokenizer_dir=self._tokenizer_dir, architecture=loaded.architecture,
            max_model_len=self._max_model_len, vocab_size=self.tokenizer.vocab_size,
            device=self._device, dtype=self._dtype, num_threads=torch.get_num_threads(),
            host_malloc=self._host_malloc, kv_cache_pages=self._kv_cache_pages,
            backend=backend.name, attention=backend.backend.attention.name,
            backend_reason=backend.reason, backend_fallback=backend.fallback,
            backend_summary=backend.describe(), cuda_graphs=self._graph_choice.describe(),
            layer_execution=("fused" if getattr(loaded.model, "layer_stack", None) is not None
                             else "per-layer"),
            quantization=self._quantization.method,
            quantization_summary=self._quantization.describe() + (
                f" ({loaded.weights_summary})" if loaded.weights_summary else ""),
            quantization_loud=self._quantization.loud or bool(
                self._source.gguf and "de-quantized" in loaded.weights_summary),
            block_size=cache.block_size,
            num_kv_blocks=size.num_blocks, kv_block_bytes=size.block_bytes,
            enable_prefix_caching=cache.enable_prefix_caching,
            memory_profile=size.memory_profile, memory=size.memory,
            block_hash_algorithm=BLOCK_HASH_ALGORITHM, block_hash_seed=ROOT_HASH,
            speculative_config=(self.config.speculative.to_json()
                                if self.config.speculative is not None else ""),
            tokenizer_digest=tokenizer_dir_digest(self._tokenizer_dir),
            runner=self.config.model.runner, pooling_type=self._pooler.config.pooling_type,
            pooling_normalize=self._pooler.config.normalize,
            hidden_size=loaded.model.cfg.hidden_size,
            tensor_parallel_size=self.config.parallel.tensor_parallel_size,
            pipeline_parallel_size=self.config.parallel.pipeline_parallel_size,
            distributed_executor_backend=("" if self._executor is None
                                          else self.config.parallel.distributed_executor_backend),
            all_reduce_backend=("none" if self._executor is None
                                else self._executor.comm.name),
            worker_pids=() if self._executor is None else tuple(self._executor.pids),
            **self._lora_facts())

    def _lora_facts(self) -> dict:
        lora = self.config.lora
        if lora is None:
            return {}
        return dict(enable_lora=True, max_loras=lora.max_loras, max_lora_rank=lora.max_lora_rank,
                    max_cpu_loras=lora.max_cpu_loras)

    def _load_lora_modules(self) -> None:
        """``lora_modules``: adapters loaded at start (a bad one stops the start, named)."""
        if self._lora is None:
            return
        for name, path in self.config.lora.lora_modules:
            self.add_lora(self._lora.cache.request_for(name, path))
            logger.info("LoRA adapter %r loaded from %s", name, path)

    def _announce(self, elapsed_s: float) -> None:
        # the one place that says what runs: loud (WARNING) when the backend is a fallback
        loud = self.info.backend_fallback or self.info.quantization_loud
        logger.log(logging.WARNING if loud else logging.INFO, "%s",
                   start_summary(self.info, elapsed_s=elapsed_s))

    # -------------------------------------------------------------------- the step API
    def add_request(self, request_id: str, prompt: PromptType,
                    params: SamplingParams | PoolingParams, arrival_time: float | None = None,
                    priority: int = 0, cache_salt: str | None = None,
                    lora_request: LoRARequest | str | None = None) -> None:
        """Validate and queue a request; raises ValueError naming the bad field (nothing is
        queued then, and other requests are unaffected). ``cache_salt`` isolates its cached
        blocks: requests share cached prefixes only when their salts are equal.
        ``lora_request``: the LoRA adapter it runs under, a ``LoRARequest`` (registered first
        if new) or a registered adapter's name (else ``UnknownLoRAError``). With
        ``PoolingParams`` it is a pooling request: its one output, a ``PoolingRequestOutput``,
        carries the prompt's embedding (``engine_worker.pooler``)."""
        self._check_alive()
        if self.output_processor.has(request_id):
            raise ValueError(f"request_id: {request_id!r} is already in use")
        arrival = time.monotonic() if arrival_time is None else arrival_time
        lora_name = self._lora_name_of(lora_request)
        processed = self.input_processor.process(request_id, prompt, params, arrival, priority,
                                                 cache_salt)
        processed.request.lora_name = lora_name
        clash = [s for s in processed.sample_ids if self.output_processor.is_live_sample(s)]
        if clash:
            raise ValueError(f"request_id: {request_id!r} would reuse the live sample id "
                             f"{clash[0]!r}")
        if isinstance(params, PoolingParams):
            self.output_processor.add_pooling_request(request_id, processed.prompt_token_ids)
            self._scheduler.add_request(processed.request)
            return
        if params.structured_outputs is not None:  # compiled already when the server sent it
            processed.request.grammar = self.grammars.matcher(params.structured_outputs)
        self.output_processor.add_request(request_id, processed.prompt_text,
                                          processed.prompt_token_ids, params,
                                          list(processed.sample_ids), arrival)
        self._scheduler.add_request(processed.request)

    def _lora_name_of(self, lora_request: LoRARequest | str | None) -> str | None:
        if lora_request is None or lora_request == "":
            return None
        name = lora_request if isinstance(lora_request, str) else lora_request.lora_name
        if self._lora is None:
            raise UnknownLoRAError(name, "LoRA is off on this engine (start it with "
                                   "--enable-lora)")
        if isinstance(lora_request, LoRARequest):
            self._lora.cache.add(lora_request)  # vLLM: a new adapter is loaded on first use
        self._lora.cache.check(name)
        return name

    # ------------------------------------------------------------------ LoRA adapters
    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Load, check and register an adapter (False: this one is registered already).
        A bad adapter raises ValueError naming ``lora_path`` or ``max_lora_rank``; nothing
        else changes."""
        self._check_alive()
        if self._lora is None:
            raise FieldError("enable_lora", "LoRA is off on this engine (start it with "
                             "--enable-lora)")
        return self._lora.cache.add(lora_request)

    def lora_request_for(self, lora_name: str, lora_path: str) -> LoRARequest:
        """A LoRARequest for ``add_lora`` with an id no registered adapter has."""
        if self._lora is None:
            raise FieldError("enable_lora", "LoRA is off on this engine (start it with "
                             "--enable-lora)")
        return self._lora.cache.request_for(lora_name, lora_path)

    def remove_lora(self, lora_name: str) -> bool:
        """Unregister an adapter (False: none by that name). Refused while requests run
        under it."""
        if self._lora is None:
            return False
        in_use = self._scheduler.lora_in_use(lora_name)
        if in_use:
            raise FieldError("lora_name", f"the adapter {lora_name!r} is in use by {in_use} "
                             f"request(s); unload it when they finish")
        return self._lora.remove(lora_name)

    def list_loras(self) -> dict[str, LoRARequest]:
        """Every registered adapter, by name."""
        return {} if self._lora is None else dict(self._lora.cache.registered)

    def step(self) -> StepResult:
        """Run one batch; return outputs of every request that progressed or finished."""
        self._check_alive()
        outputs, self._pending_outputs = self._pending_outputs, []
        if not self._scheduler.has_unfinished_requests():
            return self._result(outputs)
        scheduler_output = self._scheduler.schedule()
        now = time.monotonic()
        self.output_processor.mark_scheduled(scheduler_output.num_scheduled_tokens, now)
        if scheduler_output.preempted_req_ids:
            self.output_processor.mark_preempted(scheduler_output.preempted_req_ids, now)
        try:
            runner_output = (self.runner.execute(scheduler_output) if self._executor is None
                             else self._executor.execute(self.runner, scheduler_output))
        except BaseException as e:
            # The step's K/V is unknown: nothing it was to compute may be found, and the engine
            # refuses further work (the server reports it dead so the pod is restarted).
            self._kv_cache_manager.discard_pending()
            self._pending_outputs = outputs
            # a dead worker breaks the collective first; the watcher then names it
            reason = None if self._executor is None else self._executor.wait_for_failure(2.0)
            if self.dead_reason is None:
                self.dead_reason = reason or f"{type(e).__name__}: {e}"
            if self._executor is not None:  # the workers may wait on us: stop them
                self._executor.abandon()
            raise
        core_outputs = self._scheduler.update_from_output(scheduler_output, runner_output)
        new_outputs, stopped = self.output_processor.process(core_outputs)
        if stopped:
            self._scheduler.finish_requests(stopped, RequestStatus.FINISHED_STOPPED)
        self._kv_events.seal()
        return self._result(outputs + new_outputs)

    def set_step_interrupt(self, interrupt: Callable[[], bool] | None) -> None:
        """A multi-step decode (``num_scheduler_steps`` > 1) checks ``interrupt()`` before
        each pass after its first and ends its run on True: a server says so when a request
        or an abort comes in, which then waits one pass at most."""
        self.runner.interrupt = interrupt

    def _result(self, outputs: list[RequestOutput]) -> StepResult:
        return StepResult(outputs=outputs, stats=self.stats(),
                          kv_event_batches=tuple(self._kv_events.take()))

    def _check_alive(self) -> None:
        if self.dead_reason is not None:
            raise EngineDeadError(f"the engine failed and must be restarted ({self.dead_reason})")

    def abort_request(self, request_ids: str | Sequence[str]) -> None:
        """Stop requests now; their blocks return to the pool and a final output with
        finish_reason ``abort`` comes from the next ``step()``."""
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        for request_id in request_ids:
            self._scheduler.finish_requests(self.output_processor.child_ids(request_id),
                                           RequestStatus.FINISHED_ABORTED)
            self._pending_outputs.extend(self.output_processor.abort(request_id))

    def has_unfinished_requests(self) -> bool:
        return self._scheduler.has_unfinished_requests() or bool(self._pending_outputs)

    def stats(self) -> EngineStats:
        """The scheduler's and the KV cache's counts as of now (``step()`` returns them too)."""
        lora = None if self._lora is None else self._lora.stats(*self._scheduler.lora_names())
        return EngineStats(scheduler=self._scheduler.stats(),
                           kv_cache=self._kv_cache_manager.stats(), lora=lora)

    # ------------------------------------------------------------------- prefix cache
    def kv_cache_snapshot(self) -> KVCacheSnapshot:
        """Every cached block hash, as of the last sealed event batch; the batches after it
        come with the following ``step()`` results."""
        return self._kv_events.snapshot(self._kv_cache_manager.cached_block_hashes())

    def reset_prefix_cache(self) -> bool:
        """Forget all cached blocks (only when no request holds any); True if done. The
        ``AllBlocksCleared`` event comes with the next ``step()`` result."""
        done = self._kv_cache_manager.reset_prefix_cache()
        self._kv_events.seal()
        return done
