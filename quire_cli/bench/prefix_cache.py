"""``quire bench prefix-cache``: a shared-prefix workload with prefix caching on and off.

``num_groups`` system prompts, each shared by ``prompts_per_group`` requests that add their own
question; requests arrive interleaved across groups, all at once. Reports throughput, time to
first token (queueing included, from each request's own metrics) and the cache hit rate for
both settings in one run, plus the TTFT of a single request on an idle engine.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import random
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from engine_worker.arg_utils import add_engine_args, engine_args_from_namespace
from quire_cli.bench.prompts import FIRST_PLAIN_TOKEN_ID, random_prompt
from quire_cli.bench.report import write_json


@dataclass(frozen=True, slots=True)
class PrefixWorkload:
    prompts: tuple[tuple[int, ...], ...]  # interleaved: group 0, group 1, ..., group 0, ...
    output_len: int


def make_prefix_workload(*, num_groups: int, prompts_per_group: int, system_prompt_len: int,
                         question_len: int, output_len: int, seed: int,
                         vocab_size: int = 49152) -> PrefixWorkload:
    rng = random.Random(seed)
    systems = [random_prompt(rng, system_prompt_len, vocab_size) for _ in range(num_groups)]
    prompts = [tuple(systems[g] + random_prompt(rng, question_len, vocab_size))
               for _ in range(prompts_per_group) for g in range(num_groups)]
    return PrefixWorkload(tuple(prompts), output_len)


def _percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))]


def run_setting(engine_args, workload: PrefixWorkload, caching: bool) -> dict:
    from engine_worker import LLM, SamplingParams

    llm = LLM(**dataclasses.asdict(dataclasses.replace(engine_args,
                                                       enable_prefix_caching=caching)))
    params = SamplingParams(temperature=0, max_tokens=workload.output_len, ignore_eos=True)
    warm = [list(range(FIRST_PLAIN_TOKEN_ID, FIRST_PLAIN_TOKEN_ID + 64))]
    llm.generate([{"prompt_token_ids": p} for p in warm], params, use_tqdm=False)
    llm.engine.reset_prefix_cache()
    before = llm.engine.stats().kv_cache
    start = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": list(p)} for p in workload.prompts], params,
                           use_tqdm=False)
    elapsed = time.perf_counter() - start
    stats = llm.engine.stats().kv_cache
    ttfts = [o.metrics.time_to_first_token_s for o in outputs]
    num_out = sum(len(o.outputs[0].token_ids) for o in outputs)
    num_in = sum(len(p) for p in workload.prompts)
    queries = stats.prefix_cache_queries - before.prefix_cache_queries
    hits = stats.prefix_cache_hits - before.prefix_cache_hits
    # one more request on an idle engine, sharing group 0's system prompt
    idle_prompt = list(workload.prompts[0][:-8]) + list(range(200, 208))
    idle = llm.generate({"prompt_token_ids": idle_prompt},
                        SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)[0]
    result = {
        "prefix_caching": caching, "elapsed_s": elapsed, "num_requests": len(outputs),
        "output_tokens_per_s": num_out / elapsed, "total_tokens_per_s": (num_in + num_out) / elapsed,
        "ttft_mean_s": statistics.fmean(ttfts), "ttft_p50_s": _percentile(ttfts, 0.5),
        "ttft_p90_s": _percentile(ttfts, 0.9), "cache_hit_rate": hits / queries if queries else 0,
        "cached_tokens": sum(o.num_cached_tokens for o in outputs),
        "idle_ttft_s": idle.metrics.time_to_first_token_s,
        "idle_cached_tokens": idle.num_cached_tokens,
    }
    del llm
    gc.collect()
    return result


def measure_sharing(engine_args, prompt_len: int = 1000, n: int = 8,
                    max_tokens: int = 16) -> dict:
    """Peak KV blocks in use for n samples of one prompt: one request with ``n`` (forked,
    blocks shared) against ``n`` separate seeded requests; prefix caching off in both."""
    from engine_worker import SamplingParams
    from engine_worker.engine import LLMEngine

    prompt = [FIRST_PLAIN_TOKEN_ID + (7 * i) % 40000 for i in range(prompt_len)]
    peaks = {}
    for label, params_list in (
            ("shared", [SamplingParams(n=n, temperature=1.0, seed=0, max_tokens=max_tokens,
                                       ignore_eos=True)]),
            ("separate", [SamplingParams(temperature=1.0, seed=i, max_tokens=max_tokens,
                                         ignore_eos=True) for i in range(n)])):
        engine = LLMEngine.from_engine_args(dataclasses.replace(engine_args,
                                                                enable_prefix_caching=False))
        for i, params in enumerate(params_list):
            engine.add_request(str(i), {"prompt_token_ids": prompt}, params)
        peak = 0
        while engine.has_unfinished_requests():
            stats = engine.step().stats.kv_cache
            peak = max(peak, stats.num_blocks - stats.num_free_blocks)
        peaks[label] = peak
        del engine
        gc.collect()
    block_size = engine_args.block_size
    return {"prompt_len": prompt_len, "n": n, "max_tokens": max_tokens,
            "prompt_blocks": -(-prompt_len // block_size),
            "peak_blocks_shared": peaks["shared"], "peak_blocks_separate": peaks["separate"]}


def add_prefix_cache_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--num-groups", type=int, default=8)
    parser.add_argument("--prompts-per-group", type=int, default=8)
    parser.add_argument("--system-prompt-len", type=int, default=1000)
    parser.add_argument("--question-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--workload-seed", type=int, default=0)
    parser.add_argument("--output-json", type=Path,
                        default=Path("bench_results/prefix_cache.json"))
    add_engine_args(parser)
    parser.set_defaults(dtype="bfloat16")


def _write_plot(path: Path, results: list[dict]) -> None:
    try:
        from matplotlib.figure import Figure
    except ImportError:
        print("note: matplotlib is not installed; no plot written", file=sys.stderr)
        return
    labels = ["caching on" if r["prefix_caching"] else "caching off" for r in results]
    fig = Figure(figsize=(10, 4), layout="constrained")
    ax_tp, ax_ttft = fig.subplots(1, 2)
    ax_tp.bar_label(ax_tp.bar(labels, [r["total_tokens_per_s"] for r in results]), fmt="%.0f")
    ax_tp.set(title="Throughput (prompt + output)", ylabel="tokens/s")
    x = range(len(results))
    for offset, key in ((-0.2, "ttft_p50_s"), (0.2, "ttft_p90_s")):
        ax_ttft.bar([i + offset for i in x], [r[key] for r in results], width=0.4,
                    label=key.removeprefix("ttft_").removesuffix("_s"))
    ax_ttft.set(title="Time to first token (queueing included)", ylabel="seconds",
                xticks=list(x), xticklabels=labels)
    ax_ttft.legend()
    fig.savefig(path, dpi=120)


def run_from_args(ns: argparse.Namespace) -> int:
    engine_args = engine_args_from_namespace(ns)
    workload = make_prefix_workload(
        num_groups=ns.num_groups, prompts_per_group=ns.prompts_per_group,
        system_prompt_len=ns.system_prompt_len, question_len=ns.question_len,
        output_len=ns.output_len, seed=ns.workload_seed)
    results = [run_setting(engine_args, workload, caching) for caching in (False, True)]
    off, on = results
    sharing = measure_sharing(engine_args)
    report = {
        "config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(ns).items()
                   if k != "func"},
        "off": off, "on": on,
        "throughput_ratio": on["total_tokens_per_s"] / off["total_tokens_per_s"],
        "ttft_p50_ratio": off["ttft_p50_s"] / on["ttft_p50_s"],
        "idle_ttft_ratio": off["idle_ttft_s"] / on["idle_ttft_s"],
        "parallel_sampling": sharing,
    }
    print(f"{'setting':<12}{'tok/s':>9}{'out tok/s':>11}{'TTFT p50':>10}{'TTFT p90':>10}"
          f"{'idle TTFT':>11}{'hit rate':>10}")
    for r in results:
        print(f"{'on' if r['prefix_caching'] else 'off':<12}{r['total_tokens_per_s']:>9.0f}"
              f"{r['output_tokens_per_s']:>11.1f}{r['ttft_p50_s']:>10.2f}{r['ttft_p90_s']:>10.2f}"
              f"{r['idle_ttft_s']:>11.3f}{r['cache_hit_rate']:>10.1%}")
    print(f"caching on vs off: throughput x{report['throughput_ratio']:.2f}, "
          f"TTFT p50 x{report['ttft_p50_ratio']:.2f} faster, "
          f"idle TTFT x{report['idle_ttft_ratio']:.2f} faster")
    print(f"n={sharing['n']} samples of a {sharing['prompt_len']}-token prompt "
          f"({sharing['prompt_blocks']} blocks): peak {sharing['peak_blocks_shared']} blocks "
          f"shared vs {sharing['peak_blocks_separate']} as separate requests")
    write_json(report, ns.output_json)
    _write_plot(ns.output_json.with_suffix(".png"), results)
    print(f"wrote {ns.output_json} and {ns.output_json.with_suffix('.png')}")
    return 0
