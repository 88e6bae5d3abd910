"""``quire bench embed``: embedding throughput, Quire's engine against transformers batched the
way sentence-transformers batches (inputs sorted by length, fixed-size padded batches, the
attention mask in the pooling), on the same inputs, model and threads, in one run; in the
engine's dtype on both sides unless ``--hf-dtype`` names transformers' own (a CPU without bf16
arithmetic, a Zen 3: Quire's AVX2 kernels run bf16 weights, transformers' bf16 matmul is
emulated there, so a user runs it in fp32).

Inputs: ``num_inputs`` random token-id prompts of lengths drawn uniformly from
[``min_len``, ``max_len``]. Both sides pool the same way (the engine's resolved pooler config:
LAST or MEAN, normalized or not), and the report gives the smallest cosine similarity between
the two sides' vectors, so a fast wrong answer shows.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import os
import random
import statistics
import time
from pathlib import Path

from engine_worker.arg_utils import add_server_engine_args, engine_args_from_namespace
from quire_cli.bench.prompts import random_prompt
from quire_cli.bench.report import write_json


def make_inputs(num_inputs: int, min_len: int, max_len: int, seed: int,
                vocab_size: int = 49152) -> list[list[int]]:
    rng = random.Random(seed)
    return [random_prompt(rng, rng.randint(min_len, max_len), vocab_size)
            for _ in range(num_inputs)]


def hf_embed(model, inputs: list[list[int]], batch_size: int, pooling_type: str,
             normalize: bool):
    """sentence-transformers' way: longest first, padded batches of ``batch_size``, the mask in
    the pooling; returns the vectors in the inputs' order."""
    import torch

    order = sorted(range(len(inputs)), key=lambda i: -len(inputs[i]))
    out = [None] * len(inputs)
    with torch.inference_mode():
        for start in range(0, len(order), batch_size):
            batch = [inputs[i] for i in order[start:start + batch_size]]
            width = max(len(p) for p in batch)
            ids = torch.zeros(len(batch), width, dtype=torch.long)
            mask = torch.zeros(len(batch), width, dtype=torch.long)
            for row, prompt in enumerate(batch):
                ids[row, :len(prompt)] = torch.tensor(prompt)
                mask[row, :len(prompt)] = 1
            hidden = model(input_ids=ids, attention_mask=mask).last_hidden_state.float()
            if pooling_type == "MEAN":
                pooled = (hidden * mask[..., None]).sum(1) / mask.sum(1, keepdim=True)
            elif pooling_type == "CLS":
                pooled = hidden[:, 0]
            else:  # LAST: each row's last real token (right padding)
                pooled = hidden[torch.arange(len(batch)), mask.sum(1) - 1]
            if normalize:
                pooled = torch.nn.functional.normalize(pooled, dim=-1)
            for row, i in enumerate(order[start:start + batch_size]):
                out[i] = pooled[row]
    return out


def run(engine_args, inputs: list[list[int]], hf_batch_size: int, repeats: int = 1,
        hf_dtype: str | None = None) -> dict:
    """Both sides loaded side by side, then timed taking turns (Quire, transformers, Quire,
    ...) ``repeats`` times each, so a machine whose load changes weighs on both; the first
    turn's figures head the report, every turn's ratio and their median follow."""
    import torch
    import transformers

    from engine_worker import LLM

    llm = LLM(**dataclasses.asdict(engine_args))
    info = llm.info
    prompts = [{"prompt_token_ids": p} for p in inputs]
    dtype = getattr(torch, hf_dtype) if hf_dtype else info.dtype
    model = transformers.AutoModel.from_pretrained(info.model_dir, dtype=dtype).eval()
    llm.embed(prompts[:4], use_tqdm=False)  # warm-ups
    hf_embed(model, inputs[:4], hf_batch_size, info.pooling_type, info.pooling_normalize)
    turns, cosine = [], 1.0
    for _ in range(repeats):
        llm.engine.reset_prefix_cache()  # every input computed, as on the other side
        start, kernel = time.perf_counter(), _kernel_s()
        ours = llm.embed(prompts, use_tqdm=False)
        quire_s, quire_kernel_s = time.perf_counter() - start, _kernel_s() - kernel
        start = time.perf_counter()
        theirs = hf_embed(model, inputs, hf_batch_size, info.pooling_type,
                          info.pooling_normalize)
        hf_s = time.perf_counter() - start
        cosine = min([cosine] + [torch.nn.functional.cosine_similarity(
            torch.tensor(o.outputs.embedding), b, dim=0).item() for o, b in zip(ours, theirs)])
        turns.append({"quire_s": quire_s, "hf_s": hf_s, "ratio": hf_s / quire_s,
                      "quire_kernel_s": quire_kernel_s})
        del ours, theirs
        gc.collect()
    num_tokens = sum(len(p) for p in inputs)
    quire_s, hf_s = turns[0]["quire_s"], turns[0]["hf_s"]
    ceiling = matmul_ceiling(model, dtype, hf_tokens_per_s=num_tokens / hf_s,
                             quire_tokens_per_s=num_tokens / quire_s)
    return {
        "num_inputs": len(inputs), "num_tokens": num_tokens,
        "pooling_type": info.pooling_type, "normalize": info.pooling_normalize,
        "dtype": str(info.dtype).removeprefix("torch."), "kernels": info.backend,
        "hf_dtype": str(dtype).removeprefix("torch."),
        "quantization": info.quantization,
        "num_threads": info.num_threads, "kv_cache_pages": info.kv_cache_pages,
        "quire": {"elapsed_s": quire_s, "inputs_per_s": len(inputs) / quire_s,
                  "tokens_per_s": num_tokens / quire_s},
        "hf": {"elapsed_s": hf_s, "inputs_per_s": len(inputs) / hf_s,
               "tokens_per_s": num_tokens / hf_s, "batch_size": hf_batch_size},
        "ratio": hf_s / quire_s, "min_cosine_similarity": cosine,
        "turns": turns, "ratio_median": statistics.median(t["ratio"] for t in turns),
        **ceiling,
        "loadavg_1m_at_end": os.getloadavg()[0],
    }


def _kernel_s() -> float:
    """CPU seconds this process has spent in the kernel (page faults, mostly): a turn that
    faults fresh KV cache pages in shows them here (see kv_cache/prefault.py)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_stime


def matmul_ceiling(model, dtype, *, hf_tokens_per_s: float, quire_tokens_per_s: float) -> dict:
    """The most tokens a second any implementation could embed here: every token costs 2 x
    the model's linear weights in matmul FLOPs (attention, norms and the embedding lookup
    left out, so the bound is generous), at this machine's matmul peak in ``dtype`` measured
    now (``limits.measure_limits``; the fp32 peak where the dtype has no native matmul). A
    ratio to transformers above this bound's is out of reach for a float path on this machine;
    natively quantized weights on int8 dot products (VNNI: twice bf16's products a cycle) can
    pass it."""
    import torch

    from quire_cli.bench.limits import limits_report, measure_limits

    limits = measure_limits("cpu")
    name = str(dtype).removeprefix("torch.")
    peak = limits.matmul_tflops.get(name, limits.matmul_tflops["float32"]) * 1e12
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    tokens_per_s = peak / (2 * linear)
    return {"machine": limits_report(limits),
            "matmul_ceiling": {"linear_parameters": linear, "matmul_gflops": peak / 1e9,
                               "tokens_per_s": tokens_per_s,
                               "ratio_to_hf": tokens_per_s / hf_tokens_per_s,
                               "quire_fraction": quire_tokens_per_s / tokens_per_s}}


def add_embed_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--num-inputs", type=int, default=256)
    parser.add_argument("--min-len", type=int, default=8)
    parser.add_argument("--max-len", type=int, default=512)
    parser.add_argument("--hf-batch-size", type=int, default=32,
                        help="transformers' batch size (sentence-transformers' default: 32)")
    parser.add_argument("--workload-seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=1,
                        help="time both sides this many times, taking turns; each turn's "
                             "ratio and the median are reported")
    parser.add_argument("--output-json", type=Path, default=Path("bench_results/embed.json"))
    add_server_engine_args(parser)
    parser.add_argument("--hf-dtype", choices=["float32", "bfloat16"], default=None,
                        help="transformers' dtype (default: the engine's)")
    # fp32 on both sides by default: a Zen 3 has no bf16 arithmetic (FIELD-NOTES.md)
    parser.set_defaults(dtype="float32")


def run_from_args(ns: argparse.Namespace) -> int:
    inputs = make_inputs(ns.num_inputs, ns.min_len, ns.max_len, ns.workload_seed)
    if ns.repeats < 1:
        raise ValueError(f"repeats: must be >= 1, got {ns.repeats}")
    result = run(engine_args_from_namespace(ns), inputs, ns.hf_batch_size, ns.repeats,
                 ns.hf_dtype)
    result["config"] = {k: str(v) if isinstance(v, Path) else v for k, v in vars(ns).items()
                        if k != "func"}
    q, hf = result["quire"], result["hf"]
    dtypes = result["dtype"] if result["hf_dtype"] == result["dtype"] else \
        f"{result['dtype']} (transformers {result['hf_dtype']})"
    print(f"{result['num_inputs']} inputs, {result['num_tokens']} tokens, "
          f"{result['pooling_type']} pooling, {dtypes}, {result['num_threads']} threads")
    print(f"quire        {q['elapsed_s']:8.2f} s {q['inputs_per_s']:8.1f} inputs/s "
          f"{q['tokens_per_s']:9.0f} tok/s")
    print(f"transformers {hf['elapsed_s']:8.2f} s {hf['inputs_per_s']:8.1f} inputs/s "
          f"{hf['tokens_per_s']:9.0f} tok/s (batches of {hf['batch_size']}, sorted by length)")
    print(f"quire / transformers: x{result['ratio']:.2f}; smallest cosine similarity "
          f"{result['min_cosine_similarity']:.6f}")
    c = result["matmul_ceiling"]
    print(f"matmul ceiling: {c['tokens_per_s']:.0f} tok/s ({c['linear_parameters'] / 1e6:.1f}M "
          f"linear weights at {c['matmul_gflops']:.0f} GFLOP/s, this machine's "
          f"{result['hf_dtype']} matmul now) = x{c['ratio_to_hf']:.2f} transformers at most; Quire runs at "
          f"{c['quire_fraction']:.0%} of it")
    if c["quire_fraction"] > 1 and result["quantization"] not in (None, "dequantize"):
        print(f"  (above it: the {result['quantization']} weights' linears run int8 dot products, "
              "whose peak is above the float matmul's; the bound is the float path's)")
    if len(result["turns"]) > 1:
        print("every turn: " + ", ".join(f"x{t['ratio']:.2f}" for t in result["turns"])
              + f"; median x{result['ratio_median']:.2f}")
    print("Quire's kernel time a turn: " + ", ".join(
        f"{t['quire_kernel_s']:.2f} s" for t in result["turns"])
          + f" (KV cache pages: {result['kv_cache_pages']})")
    write_json(result, ns.output_json)
    print(f"wrote {ns.output_json}")
    return 0
