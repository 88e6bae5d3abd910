"""``quire bench throughput``: offline throughput of Quire's engine against transformers
``generate`` with static batching, on one fixed long-tailed synthetic workload, plus decode
throughput against batch size with each step's time split by part (``step_profile``).

Both systems decode greedily (or sample, with ``--temperature`` and ``--top-p``) and stop at EOS
(unless ``--ignore-eos``) or at each request's own ``max_tokens``. A static batch runs until its longest member finishes; only each request's own
tokens (up to its EOS and its limit) count as useful, which is the cost continuous batching
removes. torch and transformers are imported inside functions so ``quire --help`` stays cheap.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import math
import os
import random
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from engine_worker.arg_utils import add_bench_engine_args, engine_args_from_namespace
from engine_worker.config import EngineArgs
from quire.config_args import dataclass_from_namespace, require_at_least
from quire_cli.bench.limits import (compute_fraction, describe, limits_report, measure_limits,
                                    num_parameters)
from quire_cli.bench.prompts import random_prompt
from quire_cli.bench.report import write_json
from quire_cli.bench.step_profile import PARTS, sweep_batch_sizes

LONG_TAIL_FRACTION = 0.25


@dataclass(frozen=True, slots=True)
class Workload:
    """Prompts as token ids, and how many output tokens each request asks for."""

    prompt_token_ids: tuple[tuple[int, ...], ...]
    output_lens: tuple[int, ...]

    def summary(self) -> dict:
        input_lens = [len(p) for p in self.prompt_token_ids]
        return {"num_prompts": len(input_lens),
                "num_input_tokens": sum(input_lens), "num_output_tokens": sum(self.output_lens),
                "input_len": _describe(input_lens), "output_len": _describe(self.output_lens)}


def _describe(values) -> dict:
    return {"min": min(values), "median": statistics.median(values),
            "mean": round(statistics.fmean(values), 1), "max": max(values)}


def _draw_len(rng: random.Random, lo: int, hi: int) -> int:
    # Mostly log-uniform (many short requests), plus a uniform tail in the top quarter of the
    # range: the few long requests that hold a static batch open after the rest are done.
    if rng.random() < LONG_TAIL_FRACTION:
        return rng.randint(lo + (hi - lo) * 3 // 4, hi)
    return min(hi, max(lo, round(math.exp(rng.uniform(math.log(lo), math.log(hi))))))


def make_workload(*, num_prompts: int, input_lens: tuple[int, int], output_lens: tuple[int, int],
                  vocab_size: int, seed: int) -> Workload:
    """Random prompts that share no prefix, so no system gains from prefix caching."""
    rng = random.Random(seed)
    lens = [(_draw_len(rng, *input_lens), _draw_len(rng, *output_lens))
            for _ in range(num_prompts)]
    prompts = tuple(tuple(random_prompt(rng, n_in, vocab_size)) for n_in, _ in lens)
    return Workload(prompts, tuple(n_out for _, n_out in lens))


def _load_schema(path: str | None) -> dict | None:
    """The ``--json-schema`` file's schema (ValueError naming json_schema)."""
    import json

    if path is None:
        return None
    try:
        schema = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"json_schema: cannot read a JSON schema from {path}: {e}") from None
    _check(isinstance(schema, dict), "json_schema", f"{path} must hold a JSON object")
    return schema


def _check(ok: bool, name: str, message: str) -> None:
    if not ok:
        raise ValueError(f"{name}: {message}")


@dataclass(frozen=True, slots=True)
class BenchConfig:
    """The benchmark's own settings; the engine's come as ``EngineArgs``."""

    num_prompts: int = 256
    min_input_len: int = 16
    max_input_len: int = 1024
    min_output_len: int = 16
    max_output_len: int = 512
    workload_seed: int = 0
    ignore_eos: bool = False
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    hf_batch_size: int = 32
    hf_num_prompts: int | None = None
    skip_hf: bool = False
    batch_sizes: tuple[int, ...] = ()
    sweep_prompt_len: int = 128
    sweep_output_len: int = 64
    output_json: str = "bench_results/throughput.json"
    output_plot: str | None = None
    json_schema: str | None = None  # a JSON schema file: also run with it on every request
    schema_repeats: int = 1  # runs without and with the schema, taking turns, this many each

    def __post_init__(self) -> None:
        require_at_least(self, ("num_prompts", "min_input_len", "min_output_len",
                                "schema_repeats",
                                "hf_batch_size", "sweep_prompt_len", "sweep_output_len"))
        _check(self.temperature >= 0, "temperature", f"must be >= 0, got {self.temperature}")
        _check(0 < self.top_p <= 1, "top_p", f"must be in (0, 1], got {self.top_p}")
        for kind in ("input", "output"):
            lo, hi = getattr(self, f"min_{kind}_len"), getattr(self, f"max_{kind}_len")
            _check(hi >= lo, f"max_{kind}_len", f"must be >= min_{kind}_len ({lo}), got {hi}")
        n = self.hf_num_prompts
        _check(n is None or 1 <= n <= self.num_prompts, "hf_num_prompts",
               f"must be in [1, num_prompts={self.num_prompts}], got {n}")
        _check(all(b >= 1 for b in self.batch_sizes), "batch_sizes",
               f"must be positive, got {list(self.batch_sizes)}")

    @property
    def plot_path(self) -> Path:
        if self.output_plot:
            return Path(self.output_plot)
        return Path(self.output_json).with_suffix(".png")


@dataclass(frozen=True, slots=True)
class SystemResult:
    """One timed run. ``num_output_tokens`` counts only requested tokens; ``num_generated_tokens``
    also counts what a static batch decoded past a request's end."""

    system: str
    num_requests: int
    elapsed_s: float
    num_input_tokens: int
    num_output_tokens: int
    num_generated_tokens: int
    output_tokens_per_s: float
    total_tokens_per_s: float
    requests_per_s: float

    @classmethod
    def from_timing(cls, system: str, workload: Workload, elapsed_s: float,
                    num_output_tokens: int, num_generated_tokens: int) -> SystemResult:
        num_input = sum(len(p) for p in workload.prompt_token_ids)
        n = len(workload.output_lens)
        return cls(system, n, elapsed_s, num_input, num_output_tokens, num_generated_tokens,
                   num_output_tokens / elapsed_s, (num_input + num_output_tokens) / elapsed_s,
                   n / elapsed_s)


def _parse_batch_sizes(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}")


def add_throughput_args(parser: argparse.ArgumentParser) -> None:
    d = BenchConfig()
    g = parser.add_argument_group("workload")
    for name in ("num_prompts", "min_input_len", "max_input_len", "min_output_len",
                 "max_output_len", "workload_seed"):
        g.add_argument("--" + name.replace("_", "-"), type=int, default=getattr(d, name))
    g.add_argument("--ignore-eos", action="store_true",
                   help="decode every request to its max_tokens (default: stop at EOS)")
    g.add_argument("--temperature", type=float, default=d.temperature,
                   help="sample at this temperature, in both systems (default: 0, greedy)")
    g.add_argument("--top-p", type=float, default=d.top_p,
                   help="sample from the top-p nucleus (with --temperature > 0)")
    h = parser.add_argument_group("transformers baseline")
    h.add_argument("--hf-batch-size", type=int, default=d.hf_batch_size, help="static batch size")
    h.add_argument("--hf-num-prompts", type=int, default=None,
                   help="run the baseline on only the first N prompts (default: all)")
    h.add_argument("--skip-hf", action="store_true", help="do not run the baseline")
    o = parser.add_argument_group("sweep and output")
    o.add_argument("--batch-sizes", type=_parse_batch_sizes, default=(),
                   help="also measure decode throughput and the step-time split at each batch "
                        "size, e.g. 1,8,32,128")
    o.add_argument("--sweep-prompt-len", type=int, default=d.sweep_prompt_len)
    o.add_argument("--sweep-output-len", type=int, default=d.sweep_output_len)
    o.add_argument("--output-json", default=d.output_json)
    o.add_argument("--output-plot", default=None, help="PNG (default: beside the JSON)")
    o.add_argument("--json-schema", default=None, metavar="FILE",
                   help="also run Quire's workload with this JSON schema as every request's "
                        "structured output (vLLM's structured_outputs.json) and report its "
                        "throughput against the run without one")
    o.add_argument("--schema-repeats", type=int, default=d.schema_repeats,
                   help="with --json-schema: this many runs without and with the schema, "
                        "taking turns (without, with, without, ...); each pair's ratio and "
                        "their median are reported")
    add_bench_engine_args(parser)


@dataclass(frozen=True, slots=True)
class Sampling:
    """How both systems pick tokens: greedy at temperature 0."""

    temperature: float = 0.0
    top_p: float = 1.0


def _requests(workload: Workload, ignore_eos: bool, sampling: Sampling = Sampling(),
              json_schema: dict | None = None):
    from engine_worker import SamplingParams
    from engine_worker.sampling_params import StructuredOutputsParams

    structured = None if json_schema is None else StructuredOutputsParams(json=json_schema)
    prompts = [{"prompt_token_ids": list(p)} for p in workload.prompt_token_ids]
    return prompts, [SamplingParams(temperature=sampling.temperature, top_p=sampling.top_p,
                                    max_tokens=n, ignore_eos=ignore_eos,
                                    structured_outputs=structured)
                     for n in workload.output_lens]


def time_quire(llm, workload: Workload, warmup: Workload, ignore_eos: bool,
               system: str = "quire", sampling: Sampling = Sampling(),
               json_schema: dict | None = None) -> tuple[SystemResult, tuple[int, ...]]:
    """The run's result and each request's output length. ``json_schema``: every request's
    structured output (its grammar, compiled in the warm-up, may end a request before its
    max_tokens, even with ``ignore_eos``)."""
    llm.generate(*_requests(warmup, True, sampling, json_schema), use_tqdm=False)
    llm.engine.reset_prefix_cache()  # an earlier run of the same prompts gives no head start
    prompts, params = _requests(workload, ignore_eos, sampling, json_schema)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    got = tuple(len(o.outputs[0].token_ids) for o in outputs)
    if ignore_eos and json_schema is None and got != tuple(workload.output_lens):
        print(f"warning: {system} produced {sum(got)} output tokens, "
              f"{sum(workload.output_lens)} requested", file=sys.stderr)
    return SystemResult.from_timing(system, workload, elapsed, sum(got), sum(got)), got


def time_schema_pair(llm, workload: Workload, warmup: Workload, schema: dict,
                     sampling: Sampling) -> tuple[SystemResult, SystemResult]:
    """(plain, with the schema) on the same token work: a grammar ends each request where its
    JSON is complete, so the plain run that follows asks each request for exactly the tokens
    the schema run produced (ignore_eos): the same prompts and lengths, no grammar."""
    with_schema, lens = time_quire(llm, workload, warmup, True, system="quire+json-schema",
                                   sampling=sampling, json_schema=schema)
    plain, _ = time_quire(llm, Workload(workload.prompt_token_ids, lens), warmup, True,
                          system="quire (same lengths, no schema)", sampling=sampling)
    return plain, with_schema


def _useful_tokens(generated, limit: int, eos_ids: frozenset[int] | None) -> int:
    """A row's tokens up to and including its first EOS (when EOS ends requests), at most
    its own limit."""
    for i, token in enumerate(generated[:limit]):
        if eos_ids is not None and token in eos_ids:
            return i + 1
    return min(limit, len(generated))


def _hf_batch(model, prompts, output_lens, pad_id: int, device,
              eos_ids: frozenset[int] | None, sampling: Sampling) -> tuple[int, int]:
    """One static batch; returns (useful output tokens, tokens decoded in all). With
    ``eos_ids`` None, EOS is masked until the longest request's limit (ignore_eos)."""
    import torch

    width = max(len(p) for p in prompts)
    # [batch, width], left padded so every row's last prompt token sits in the last column.
    input_ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, p in enumerate(prompts):
        input_ids[row, width - len(p):] = torch.tensor(p)
        mask[row, width - len(p):] = 1
    max_new = max(output_lens)
    # min_new_tokens masks EOS until max_new, so no row may stop before the longest one; with
    # EOS allowed the batch still runs until every row has stopped or reached max_new.
    sample = ({"do_sample": True, "temperature": sampling.temperature,
               "top_p": sampling.top_p, "top_k": 0} if sampling.temperature > 0
              else {"do_sample": False})
    out = model.generate(input_ids=input_ids.to(device), attention_mask=mask.to(device),
                         **sample, max_new_tokens=max_new,
                         min_new_tokens=max_new if eos_ids is None else 0, pad_token_id=pad_id,
                         **({} if eos_ids is None else {"eos_token_id": sorted(eos_ids)}))
    generated = out[:, width:].tolist()
    useful = sum(_useful_tokens(row, n, eos_ids) for row, n in zip(generated, output_lens))
    return useful, len(generated[0]) * len(prompts)


def time_hf(model_dir, dtype, device, workload: Workload, warmup: Workload,
            batch_size: int, eos_ids: frozenset[int] | None,
            sampling: Sampling = Sampling()) -> SystemResult:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
    gen = model.generation_config
    pad_id = gen.pad_token_id if gen.pad_token_id is not None else gen.eos_token_id
    pad_id = pad_id[0] if isinstance(pad_id, list) else pad_id  # any id: padding is masked
    useful = decoded = 0
    with torch.inference_mode():
        _hf_batch(model, warmup.prompt_token_ids, warmup.output_lens, pad_id, device, None,
                  sampling)
        start = time.perf_counter()
        for i in range(0, len(workload.output_lens), batch_size):
            u, d = _hf_batch(model, workload.prompt_token_ids[i:i + batch_size],
                             workload.output_lens[i:i + batch_size], pad_id, device, eos_ids,
                             sampling)
            useful, decoded = useful + u, decoded + d
        elapsed = time.perf_counter() - start
    return SystemResult.from_timing("transformers", workload, elapsed, useful, decoded)


def _print_table(results: list[SystemResult], ratio: float | None) -> None:
    print(f"{'system':<14}{'requests':>9}{'out tok/s':>12}{'total tok/s':>13}{'req/s':>9}"
          f"{'elapsed s':>11}")
    for r in results:
        print(f"{r.system:<14}{r.num_requests:>9}{r.output_tokens_per_s:>12.1f}"
              f"{r.total_tokens_per_s:>13.1f}{r.requests_per_s:>9.2f}{r.elapsed_s:>11.1f}")
    if ratio is not None:
        print(f"ratio (quire / transformers output tok/s): {ratio:.2f}x")


def _write_plot(path: Path, results: list[SystemResult], sweep: list) -> bool:
    try:
        from matplotlib.figure import Figure  # no pyplot: no global backend state to set
    except ImportError:
        print("note: matplotlib is not installed (pip install quire[bench]); no plot written",
              file=sys.stderr)
        return False
    fig = Figure(figsize=(15 if sweep else 6, 4.5), layout="constrained")
    axes = fig.subplots(1, 3 if sweep else 1, squeeze=False)[0]
    bars = axes[0].bar([r.system for r in results], [r.output_tokens_per_s for r in results],
                       color=["tab:blue", "tab:gray"][:len(results)])
    axes[0].bar_label(bars, fmt="%.0f")
    axes[0].set(title=f"Mixed workload, {results[0].num_requests} requests",
                ylabel="output tokens/s")
    if sweep:
        sizes = [p.batch_size for p in sweep]
        axes[1].plot(sizes, [p.output_tokens_per_s for p in sweep], marker="o")
        axes[1].set(title="Decode throughput vs batch size", xlabel="requests in the batch",
                    ylabel="output tokens/s", xscale="log", xticks=sizes, xticklabels=sizes)
        labels = [str(s) for s in sizes]
        totals = [sum(p.decode_step_ms.values()) for p in sweep]
        bottom = [0.0] * len(sweep)
        for part in PARTS:  # shares, so that small batches stay readable beside large ones
            values = [100 * p.decode_step_ms[part] / t for p, t in zip(sweep, totals)]
            axes[2].bar(labels, values, bottom=bottom, label=part)
            bottom = [b + v for b, v in zip(bottom, values)]
        for i, total in enumerate(totals):
            axes[2].text(i, 101, f"{total:.0f} ms", ha="center", va="bottom", fontsize=8)
        axes[2].set(title="Decode step time by part (total above)", ylim=(0, 112),
                    xlabel="requests in the batch", ylabel="% of the step")
        axes[2].legend(loc="lower left", fontsize=8)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    return True


def _environment(engine) -> dict:
    import torch
    import transformers

    # The load average shows whether something else shared the CPU during the run.
    info = engine.info
    return {"model_dir": str(info.model_dir), "device": str(info.device),
            "dtype": str(info.dtype).removeprefix("torch."), "kernels": info.backend,
            "cpu_count": os.cpu_count(), "torch_num_threads": torch.get_num_threads(),
            "loadavg_1m_at_start": os.getloadavg()[0], "torch_version": torch.__version__,
            "transformers_version": transformers.__version__}


def _write_json(path: Path, cfg: BenchConfig, engine_args: EngineArgs, env: dict,
                workload: Workload, results: list[SystemResult], ratio, sweep,
                schema_pairs: list[tuple[SystemResult, SystemResult]] = ()) -> None:
    by_system = {r.system: dataclasses.asdict(r) for r in results}
    report = {"config": {**dataclasses.asdict(cfg), "engine": dataclasses.asdict(engine_args)},
              "environment": {**env, "loadavg_1m_at_end": os.getloadavg()[0]},
              "workload": workload.summary(), "quire": by_system["quire"],
              "hf": by_system.get("transformers"), "ratio_output_tokens_per_s": ratio,
              "batch_size_sweep": [dataclasses.asdict(p) for p in sweep]}
    if schema_pairs:  # the same prompts, a JSON schema on every request
        plain, with_schema = schema_pairs[0]
        report["json_schema"] = dataclasses.asdict(with_schema) | {
            # against the plain run at the same output lengths (time_schema_pair)
            "ratio_output_tokens_per_s_vs_plain":
                with_schema.output_tokens_per_s / plain.output_tokens_per_s,
            "schema": _load_schema(cfg.json_schema),
            # every turn: with the schema, then without it at the same lengths; the ratio
            "turns": [{"plain": dataclasses.asdict(p), "json_schema": dataclasses.asdict(j),
                       "ratio": j.output_tokens_per_s / p.output_tokens_per_s}
                      for p, j in schema_pairs],
            "ratio_median": _schema_median(schema_pairs)}
    print(f"wrote {write_json(report, path)}")


def _schema_median(pairs) -> float:
    return statistics.median(j.output_tokens_per_s / p.output_tokens_per_s for p, j in pairs)


def _print_sweep(sweep) -> None:
    print(f"{'batch':>6}{'out tok/s':>11}" + "".join(f"{p + ' ms':>15}" for p in PARTS))
    for p in sweep:
        print(f"{p.batch_size:>6}{p.output_tokens_per_s:>11.1f}"
              + "".join(f"{p.decode_step_ms[k]:>15.2f}" for k in PARTS))


def run_from_args(ns: argparse.Namespace) -> int:
    from engine_worker import LLM

    cfg = dataclass_from_namespace(BenchConfig, ns)
    engine_args = engine_args_from_namespace(ns)
    llm = LLM(**dataclasses.asdict(engine_args))
    engine = llm.engine
    vocab_size, env = engine.tokenizer.vocab_size, _environment(engine)
    eos_ids = None if cfg.ignore_eos else engine.tokenizer.eos_token_ids
    workload = make_workload(num_prompts=cfg.num_prompts, seed=cfg.workload_seed,
                             input_lens=(cfg.min_input_len, cfg.max_input_len),
                             output_lens=(cfg.min_output_len, cfg.max_output_len),
                             vocab_size=vocab_size)
    # Prompts as long as the real ones, so first-use costs of large shapes are paid here; another
    # seed, so the warm-up leaves nothing in the prefix cache for the timed run.
    warmup = make_workload(num_prompts=min(8, cfg.num_prompts), output_lens=(8, 8),
                           input_lens=(cfg.min_input_len, cfg.max_input_len),
                           vocab_size=vocab_size, seed=cfg.workload_seed + 1)
    print(f"quire: {cfg.num_prompts} requests", file=sys.stderr)
    sampling = Sampling(cfg.temperature, cfg.top_p)
    schema = _load_schema(cfg.json_schema)
    results = [time_quire(llm, workload, warmup, cfg.ignore_eos, sampling=sampling)[0]]
    with_schema = None
    schema_pairs: list[tuple[SystemResult, SystemResult]] = []
    for turn in range(cfg.schema_repeats if schema is not None else 0):
        print(f"quire: {cfg.num_prompts} requests with the JSON schema, then without it at the "
              f"same output lengths ({turn + 1} of {cfg.schema_repeats})", file=sys.stderr)
        schema_pairs.append(time_schema_pair(llm, workload, warmup, schema, sampling))
    if schema_pairs:
        with_schema = schema_pairs[0][1]
    info = engine.info
    model_dir, dtype, device = info.model_dir, info.dtype, info.device
    parameters = num_parameters(engine.runner.model)
    del llm, engine  # free the KV cache before the baseline and the sweep
    gc.collect()
    limits = measure_limits(device)
    quire = results[0]
    fraction = compute_fraction(quire.num_input_tokens + quire.num_output_tokens,
                                quire.elapsed_s, parameters, limits)
    env["machine"] = {**limits_report(limits), "parameters": parameters,
                      "quire_fraction_of_matmul_peak": fraction}
    if not cfg.skip_hf:
        n = cfg.hf_num_prompts or cfg.num_prompts
        subset = Workload(workload.prompt_token_ids[:n], workload.output_lens[:n])
        print(f"transformers: {n} requests in static batches of {cfg.hf_batch_size}",
              file=sys.stderr)
        results.append(time_hf(model_dir, dtype, device, subset, warmup, cfg.hf_batch_size,
                               eos_ids, sampling))
    sweep = sweep_batch_sizes(engine_args, cfg.batch_sizes, prompt_len=cfg.sweep_prompt_len,
                              output_len=cfg.sweep_output_len, vocab_size=vocab_size)
    ratio = (results[0].output_tokens_per_s / results[1].output_tokens_per_s
             if len(results) > 1 else None)
    _print_table(results, ratio)
    print(f"machine (measured in this run): {describe(limits)}; Quire's run is "
          f"{fraction:.0%} of the matmul peak (2 x {parameters / 1e6:.1f}M FLOPs a token)")
    if sweep:
        _print_sweep(sweep)
    for plain, schema_run in schema_pairs:
        print(f"with the JSON schema: {schema_run.output_tokens_per_s:.1f} output tok/s "
              f"({schema_run.num_output_tokens} tokens) against "
              f"{plain.output_tokens_per_s:.1f} ({plain.num_output_tokens}) without it at the "
              f"same lengths: {schema_run.output_tokens_per_s / plain.output_tokens_per_s:.2f}x")
    if len(schema_pairs) > 1:
        print(f"median of {len(schema_pairs)} pairs: {_schema_median(schema_pairs):.2f}x")
    _write_json(Path(cfg.output_json), cfg, engine_args, env, workload, results, ratio, sweep,
                schema_pairs)
    if _write_plot(cfg.plot_path, results, sweep):
        print(f"wrote {cfg.plot_path}")
    return 0
