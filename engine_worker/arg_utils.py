"""Every engine argument as a command-line flag and a ``QUIRE_*`` environment variable.

Flags are derived from ``EngineArgs`` (see ``quire.config_args``).
"""

from __future__ import annotations

import argparse
import os

from engine_worker.config import EngineArgs
from quire.config_args import add_dataclass_args, dataclass_from_namespace, env_name

_HELP = {
    "model": "local HF directory, .gguf file, or the embedded model's Hub id (default: embedded "
             "SmolLM2-135M-Instruct)",
    "tokenizer": "tokenizer directory, if not the model's",
    "dtype": "auto (bf16 where supported), bfloat16, float16 or float32",
    "quantization": "how a quantized checkpoint runs: auto (its own format natively where the "
                    "kernels have it, else de-quantized; said at start), gguf (GGUF Q4_0, Q4_1, "
                    "Q8_0, Q4_K, Q5_K and Q6_K blocks multiplied as stored, else an error), awq / gptq (a 4-bit AWQ "
                    "or GPTQ safetensors checkpoint's weights multiplied as packed, else an "
                    "error) or dequantize (every weight widened to dtype at load)",
    "max_model_len": "longest sequence (prompt + output) in tokens",
    "block_size": "tokens per KV block",
    "kv_cache_memory_bytes": "KV cache budget in bytes (overrides gpu_memory_utilization)",
    "gpu_memory_utilization": "on a GPU, the fraction of its memory the engine may use (weights, "
                              "profiled activations, CUDA graphs, then the KV cache; default "
                              "0.9); on a CPU, of available host memory for the KV cache "
                              "(default 0.25)",
    "enable_prefix_caching": "reuse cached KV blocks across requests (true/false)",
    "kv_cache_prefault": "on a CPU, fault the KV cache's pages in at start, as vLLM's "
                         "zero-filled cache is, so no step waits on fresh pages (true/false; "
                         "default true for quire engine and quire up, false for LLM)",
    "max_num_seqs": "most requests in one batch",
    "max_num_batched_tokens": "most tokens in one step (prefill is chunked to fit)",
    "scheduling_policy": "fcfs or priority",
    "long_prefill_token_threshold": "cap on one request's prefill chunk (0: none)",
    "short_prompts_first": "a prompt that would cost more than the rest of its step together "
                           "waits one step (once) while the shorter prompts behind it run "
                           "(true/false; default true for quire engine and quire up, false "
                           "for LLM)",
    "num_scheduler_steps": "decode passes per scheduling decision while every running request "
                           "decodes and none waits (vLLM's multi-step scheduling; tokens then "
                           "reach the client in runs of up to this many; a new request or "
                           "abort ends the run on a server; default 8 for LLM and the "
                           "offline benchmarks, 1 for quire engine, quire up, quire generate "
                           "and quire chat)",
    "seed": "seed of the engine's default random stream",
    "device": "auto, cpu or cuda[:N]",
    "num_threads": "torch CPU threads (of each rank under tensor parallelism; default there: "
                   "the CPUs divided among the ranks)",
    "tensor_parallel_size": "ranks one model is split across (heads, MLP and vocabulary "
                            "sliced per rank; one process each, torch.distributed between "
                            "them)",
    "pipeline_parallel_size": "pipeline stages: contiguous runs of layers, one stage after "
                              "another (each split in tensor_parallel_size ranks)",
    "pipeline_micro_batch_tokens": "the fewest tokens of a pipeline micro-batch: a step of at "
                                   "least twice this many passes through the stages in "
                                   "pieces (up to two a stage) that overlap; 0: steps whole",
    "distributed_executor_backend": "how the ranks run: mp (one worker process per rank "
                                    "beside the engine's own, rank 0)",
    "kernels": "kernel backend: auto (on a CPU the compiled CPU kernels where they build, else "
               "torch; on CUDA triton; said at start), cpu (AVX-512), cpu-avx2, triton (Triton "
               "paged attention), "
               "or torch (the pure-PyTorch reference)",
    "attention_backend": "auto (the kernel backend's own), torch (the reference) or triton "
                         "(Triton paged attention; on a CPU only under TRITON_INTERPRET=1)",
    "runner": "generate (generation and embeddings) or pooling (embeddings only: generation "
              "is refused)",
    "pooler_config": "how embeddings pool, JSON: {\"pooling_type\": \"LAST\" | \"MEAN\" | "
                     "\"CLS\", \"normalize\": true | false} (unset: the model's "
                     "sentence-transformers config, else LAST, normalized)",
    "enforce_eager": "no CUDA graphs: run decode steps eagerly too (graphs run only on a GPU, "
                     "with triton attention)",
    "speculative_config": "speculative decoding, as vLLM's JSON: '{\"method\": \"ngram\", "
                          "\"num_speculative_tokens\": 4, \"prompt_lookup_max\": 5, "
                          "\"prompt_lookup_min\": 2}', '{\"method\": \"suffix\", ...}' or a "
                          "draft model '{\"model\": \"DIR\", \"num_speculative_tokens\": 4}' "
                          "(also disable_by_batch_size; default: off)",
    "enable_lora": "serve LoRA adapters (PEFT directories) beside the base model",
    "max_loras": "LoRA adapters usable in one step (device slots)",
    "max_lora_rank": "largest LoRA rank accepted",
    "max_cpu_loras": "LoRA adapters kept loaded in host memory, LRU (default: max_loras)",
    "lora_modules": "LoRA adapters loaded at start: name=path ... (turns --enable-lora on)",
}


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    add_dataclass_args(parser, EngineArgs, "engine", _HELP)
    for action in parser._actions:  # vLLM's --lora-modules takes several name=path values
        if action.dest == "lora_modules":
            action.nargs = "+"


# where a server's default differs from ``LLM``'s: the KV cache faulted in at start, short
# prompts not kept waiting behind a long one (an offline batch wants full steps), and one
# decode pass a step (a stream gets each token as it comes)
SERVER_DEFAULTS = {"kv_cache_prefault": True, "short_prompts_first": True,
                   "num_scheduler_steps": 1}


def add_server_engine_args(parser: argparse.ArgumentParser) -> None:
    """The engine flags of a server (``quire engine``, ``quire up``) and of the benchmarks that
    measure one: ``SERVER_DEFAULTS`` unless a flag or QUIRE_* variable says otherwise."""
    add_engine_args(parser)
    parser.set_defaults(**{name: value for name, value in SERVER_DEFAULTS.items()
                           if env_name(name) not in os.environ})


def add_streaming_engine_args(parser: argparse.ArgumentParser) -> None:
    """The engine flags of a command that streams tokens to a terminal (``quire generate``,
    ``quire chat``): one decode pass a step, as on a server, so each token shows as it comes."""
    add_engine_args(parser)
    if env_name("num_scheduler_steps") not in os.environ:
        parser.set_defaults(num_scheduler_steps=SERVER_DEFAULTS["num_scheduler_steps"])


def add_bench_engine_args(parser: argparse.ArgumentParser) -> None:
    """The engine flags of a benchmark: bf16 by default, the dtype the targets are set in
    (QUIRE_DTYPE, when set, still wins)."""
    add_engine_args(parser)
    if parser.get_default("dtype") == "auto":
        parser.set_defaults(dtype="bfloat16")


def engine_args_from_namespace(ns: argparse.Namespace) -> EngineArgs:
    return dataclass_from_namespace(EngineArgs, ns)
