"""``quire bench lora``: the long-tailed workload spread over several LoRA adapters plus the
base model, against the same workload on the base model alone, on the same engine, same run.

The adapters are random PEFT directories written here (rank ``--lora-rank`` on q, k, v, o,
gate, up and down; non-zero B so every delta is computed), loaded at start. The workload is
``bench throughput``'s (random prompts, long-tailed lengths, every request to its
max_tokens); the LoRA run gives request i adapter ``i % (num_adapters + 1)`` (the last one the
base model), so every step mixes adapters. The two runs take turns ``--repeats`` times and the
ratio quoted is the median of the paired ratios of output tokens/s (target: >= 0.8).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from engine_worker.arg_utils import add_bench_engine_args, engine_args_from_namespace
from quire.config_args import dataclass_from_namespace, require_at_least
from quire_cli.bench.report import write_json

MODULES = {"self_attn": ("q_proj", "k_proj", "v_proj", "o_proj"),
           "mlp": ("gate_proj", "up_proj", "down_proj")}


@dataclass(frozen=True, slots=True)
class LoRABenchConfig:
    num_adapters: int = 4
    lora_rank: int = 16
    num_prompts: int = 32
    repeats: int = 2
    output_json: str = "bench_results/lora.json"

    def __post_init__(self) -> None:
        require_at_least(self, ("num_adapters", "lora_rank", "num_prompts", "repeats"))


def add_lora_args(parser: argparse.ArgumentParser) -> None:
    d = LoRABenchConfig()
    parser.add_argument("--num-adapters", type=int, default=d.num_adapters)
    parser.add_argument("--lora-rank", type=int, default=d.lora_rank)
    parser.add_argument("--num-prompts", type=int, default=d.num_prompts)
    parser.add_argument("--repeats", type=int, default=d.repeats)
    parser.add_argument("--output-json", default=d.output_json)
    add_bench_engine_args(parser)


def write_adapter(directory: Path, shapes: dict[str, tuple[int, int]], num_layers: int,
                  rank: int, seed: int) -> str:
    """A random PEFT LoRA directory for a Llama-family model (``shapes``: module -> (in, out))."""
    import torch
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(num_layers):
        for block, modules in MODULES.items():
            for module in modules:
                fan_in, fan_out = shapes[module]
                key = f"base_model.model.model.layers.{layer}.{block}.{module}"
                tensors[f"{key}.lora_A.weight"] = torch.randn(rank, fan_in, generator=g) \
                    / fan_in ** 0.5
                tensors[f"{key}.lora_B.weight"] = torch.randn(fan_out, rank, generator=g) * 0.01
    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(directory / "adapter_model.safetensors"))
    (directory / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "bias": "none",
        "target_modules": [m for ms in MODULES.values() for m in ms]}))
    return str(directory)


def _run(engine, workload, loras: list[str | None]) -> float:
    """Output tokens/s of the whole workload added at once, request i under loras[i]."""
    from engine_worker import SamplingParams

    start = time.perf_counter()
    for i, (prompt, n) in enumerate(zip(workload.prompt_token_ids, workload.output_lens)):
        engine.add_request(f"lora-{start}-{i}", {"prompt_token_ids": list(prompt)},
                           SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True),
                           lora_request=loras[i])
    num_tokens = 0
    while engine.has_unfinished_requests():
        for out in engine.step().outputs:
            if out.finished:
                num_tokens += len(out.outputs[0].token_ids)
    return num_tokens / (time.perf_counter() - start)


def run_from_args(ns: argparse.Namespace) -> int:
    from engine_worker import LLM
    from quire_cli.bench.throughput import make_workload

    cfg = dataclass_from_namespace(LoRABenchConfig, ns)
    args = engine_args_from_namespace(ns)
    engine = LLM(**(dataclasses.asdict(args) | {"enable_lora": True,
                                                "max_loras": cfg.num_adapters,
                                                "max_lora_rank": cfg.lora_rank})).engine
    model = engine.runner.model
    shapes = {m: (i, o) for mods in model.lora_projections().values() for m, i, o in mods}
    names = [f"adapter-{i}" for i in range(cfg.num_adapters)]
    with tempfile.TemporaryDirectory(prefix="quire-bench-lora-") as root:
        for i, name in enumerate(names):
            engine.add_lora(engine.lora_request_for(name, write_adapter(
                Path(root) / name, shapes, model.cfg.num_layers, cfg.lora_rank, seed=i)))
    workload = make_workload(num_prompts=cfg.num_prompts, input_lens=(16, 256),
                             output_lens=(16, 128), vocab_size=engine.tokenizer.vocab_size,
                             seed=0)
    mixed = [(names + [None])[i % (len(names) + 1)] for i in range(cfg.num_prompts)]
    _run(engine, make_workload(num_prompts=4, input_lens=(8, 16), output_lens=(4, 8),
                               vocab_size=engine.tokenizer.vocab_size, seed=1), mixed)  # warm
    runs: dict[str, list[float]] = {"base": [], "lora": [], "ratios": []}
    report = {"config": dataclasses.asdict(cfg), "engine": dataclasses.asdict(args),
              "workload": workload.summary(),
              "environment": {"cpu_count": os.cpu_count(), "kernels": engine.info.backend,
                              "dtype": str(engine.info.dtype),
                              "loadavg_1m_at_start": os.getloadavg()[0]}}
    for _ in range(cfg.repeats):
        runs["base"].append(_run(engine, workload, [None] * cfg.num_prompts))
        runs["lora"].append(_run(engine, workload, mixed))
        runs["ratios"].append(runs["lora"][-1] / runs["base"][-1])
        print(f"  base {runs['base'][-1]:8.1f}  lora {runs['lora'][-1]:8.1f} output tok/s",
              file=sys.stderr)
    report["environment"]["loadavg_1m_at_end"] = os.getloadavg()[0]
    report |= {"runs": runs, "ratio": statistics.median(runs["ratios"]),
               "base_tokens_per_s": statistics.median(runs["base"]),
               "lora_tokens_per_s": statistics.median(runs["lora"])}
    print(f"{cfg.num_adapters} adapters (rank {cfg.lora_rank}) + base vs base alone: "
          f"{report['lora_tokens_per_s']:.1f} / {report['base_tokens_per_s']:.1f} output tok/s "
          f"= {report['ratio']:.2f}x (target >= 0.8x; {engine.info.backend}, "
          f"{engine.info.dtype})")
    print(f"report: {write_json(report, cfg.output_json)}")
    return 0
