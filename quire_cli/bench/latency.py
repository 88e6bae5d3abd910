"""``quire bench latency``: one request on an idle engine, against transformers in the same run.

Two numbers, each the median of ``--repeats`` runs:

- decode speed: tokens per second of one greedy request after its first token (a short prompt,
  ``--output-len`` tokens, EOS ignored), i.e. (output_len - 1) / (end - first token);
- time to first token of a ``--prompt-len``-token prompt (prefill of the whole prompt plus the
  first sample), with nothing cached (every prompt is new).

The baseline is transformers' ``generate`` on the same checkpoint and dtype: decode speed from
two runs of different lengths (their difference cancels the prefill), TTFT as one forward over
the prompt plus the first greedy token.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import os
import random
import statistics
import sys
import time
from dataclasses import dataclass

from engine_worker.arg_utils import add_bench_engine_args, engine_args_from_namespace
from quire.config_args import dataclass_from_namespace, require_at_least
from quire_cli.bench.limits import (decode_fraction, describe, limits_report, measure_limits,
                                    weight_bytes)
from quire_cli.bench.prompts import random_prompt
from quire_cli.bench.report import write_json


@dataclass(frozen=True, slots=True)
class LatencyConfig:
    prompt_len: int = 1000
    decode_prompt_len: int = 32
    output_len: int = 256
    repeats: int = 3
    skip_hf: bool = False
    output_json: str = "bench_results/latency.json"

    def __post_init__(self) -> None:
        require_at_least(self, ("prompt_len", "decode_prompt_len", "repeats"))
        require_at_least(self, ("output_len",), minimum=8)


def add_latency_args(parser: argparse.ArgumentParser) -> None:
    d = LatencyConfig()
    for name in ("prompt_len", "decode_prompt_len", "output_len", "repeats"):
        parser.add_argument("--" + name.replace("_", "-"), type=int, default=getattr(d, name))
    parser.add_argument("--skip-hf", action="store_true", help="do not run the baseline")
    parser.add_argument("--output-json", default=d.output_json)
    add_bench_engine_args(parser)


def quire_latency(engine, cfg: LatencyConfig, rng: random.Random, vocab_size: int) -> dict:
    from engine_worker import SamplingParams

    def one(prompt, max_tokens):
        """-> (TTFT s, decode tokens/s after the first token)."""
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        start = time.perf_counter()
        engine.add_request(f"lat-{rng.random()}", {"prompt_token_ids": prompt}, params)
        first = None
        while engine.has_unfinished_requests():
            outputs = engine.step().outputs
            if first is None and outputs:
                first = time.perf_counter()
        end = time.perf_counter()
        rate = (max_tokens - 1) / (end - first) if max_tokens > 1 else None
        return first - start, rate

    one(random_prompt(rng, cfg.prompt_len, vocab_size), 4)  # warm-up of both shapes
    ttft = [one(random_prompt(rng, cfg.prompt_len, vocab_size), 1)[0] for _ in range(cfg.repeats)]
    rates = [one(random_prompt(rng, cfg.decode_prompt_len, vocab_size), cfg.output_len)[1]
             for _ in range(cfg.repeats)]
    return {"ttft_s": statistics.median(ttft), "ttft_runs_s": ttft,
            "decode_tokens_per_s": statistics.median(rates), "decode_runs": rates}


def hf_latency(model_dir, dtype, device, cfg: LatencyConfig, rng: random.Random,
               vocab_size: int) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()

    def generate(prompt, n) -> float:
        ids = torch.tensor([prompt], device=device)
        start = time.perf_counter()
        model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                       max_new_tokens=n, min_new_tokens=n, pad_token_id=0)
        if ids.is_cuda:
            torch.cuda.synchronize(device)
        return time.perf_counter() - start

    with torch.inference_mode():
        generate(random_prompt(rng, cfg.prompt_len, vocab_size), 2)
        ttft = [generate(random_prompt(rng, cfg.prompt_len, vocab_size), 1)
                for _ in range(cfg.repeats)]
        short = cfg.decode_prompt_len
        rates = []
        for _ in range(cfg.repeats):
            t_full = generate(random_prompt(rng, short, vocab_size), cfg.output_len)
            t_few = generate(random_prompt(rng, short, vocab_size), 1)
            rates.append((cfg.output_len - 1) / (t_full - t_few))
    return {"ttft_s": statistics.median(ttft), "ttft_runs_s": ttft,
            "decode_tokens_per_s": statistics.median(rates), "decode_runs": rates}


def run_from_args(ns: argparse.Namespace) -> int:
    from engine_worker import LLM

    cfg = dataclass_from_namespace(LatencyConfig, ns)
    engine_args = engine_args_from_namespace(ns)
    llm = LLM(**dataclasses.asdict(engine_args))
    engine = llm.engine
    vocab_size = engine.tokenizer.vocab_size
    rng = random.Random(0)
    print("quire: one request at a time", file=sys.stderr)
    report = {"config": dataclasses.asdict(cfg), "engine": dataclasses.asdict(engine_args),
              "environment": {"kernels": engine.info.backend, "dtype": str(engine.info.dtype),
                              "cpu_count": os.cpu_count(),
                              "loadavg_1m_at_start": os.getloadavg()[0]},
              "quire": quire_latency(engine, cfg, rng, vocab_size)}
    info = engine.info
    model_dir, dtype, device = info.model_dir, info.dtype, info.device
    model_bytes = weight_bytes(engine.runner.model)
    del llm, engine
    gc.collect()
    limits = measure_limits(device)
    fraction = decode_fraction(report["quire"]["decode_tokens_per_s"], model_bytes, limits)
    report["machine"] = {**limits_report(limits), "weight_bytes": model_bytes,
                         "decode_fraction_of_memory_bandwidth": fraction}
    if not cfg.skip_hf:
        print("transformers: one request at a time", file=sys.stderr)
        report["hf"] = hf_latency(model_dir, dtype, device, cfg, rng, vocab_size)
        report["ratio_decode"] = (report["quire"]["decode_tokens_per_s"]
                                  / report["hf"]["decode_tokens_per_s"])
        report["ratio_ttft"] = report["hf"]["ttft_s"] / report["quire"]["ttft_s"]
    report["environment"]["loadavg_1m_at_end"] = os.getloadavg()[0]
    print(f"{'system':<14}{'decode tok/s':>14}{'TTFT s (' + str(cfg.prompt_len) + ' tokens)':>24}")
    for system in ("quire", "hf"):
        if system in report:
            r = report[system]
            print(f"{system:<14}{r['decode_tokens_per_s']:>14.1f}{r['ttft_s']:>24.3f}")
    if "hf" in report:
        print(f"ratio: decode {report['ratio_decode']:.2f}x, TTFT {report['ratio_ttft']:.2f}x")
    print(f"machine (measured in this run): {describe(limits)}; one request streams "
          f"{model_bytes / 1e6:.0f} MB of weights a step, so its decode reaches "
          f"{fraction:.0%} of the memory bandwidth")
    print(f"wrote {write_json(report, cfg.output_json)}")
    return 0
