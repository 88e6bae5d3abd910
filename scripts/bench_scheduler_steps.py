"""One request's decode (and the long-tailed batched workload) with one pass a step against
multi-step decode, two engines in one process taking turns (A B, B A, ...), so that the
machine's drift falls on both alike.

    .venv/bin/python scripts/bench_scheduler_steps.py --quantization auto --turns 10 \\
        --output-json steps.json

Each turn: a 32-token prompt, 128 greedy tokens (EOS ignored), decode rate = 127 tokens over
the time after the first token; with ``--batched``, the 64-request workload of ``quire bench
compare`` (EOS on) as output tokens / s. Prints each engine's turns and the median of the
paired ratios.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from engine_worker import LLM, SamplingParams
from quire_cli.bench.throughput import make_workload
from quire_cli.bench.vllm_peer import _timed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quantization", default="auto")
    ap.add_argument("--steps", type=int, nargs=2, default=[1, 8])
    ap.add_argument("--turns", type=int, default=10)
    ap.add_argument("--batched", action="store_true")
    ap.add_argument("--num-threads", type=int, default=2)
    ap.add_argument("--output-json", default=None)
    ns = ap.parse_args()
    llms = {k: LLM(kv_cache_memory_bytes=512 << 20, num_threads=ns.num_threads,
                   dtype="bfloat16", quantization=ns.quantization, num_scheduler_steps=k,
                   kv_cache_prefault=True) for k in ns.steps}
    work = make_workload(num_prompts=64, input_lens=(16, 512), output_lens=(16, 256),
                         vocab_size=49152, seed=0)
    prompts = [list(p) for p in work.prompt_token_ids]
    one = [{"prompt_token_ids": list(range(1000, 1032))}]
    greedy = SamplingParams(max_tokens=128, temperature=0, ignore_eos=True)

    def turn(llm) -> float:
        if ns.batched:
            elapsed, num_out = _timed(llm, SamplingParams, prompts, list(work.output_lens),
                                      False)
            return num_out / elapsed
        m = llm.generate(one, greedy, use_tqdm=False)[0].metrics
        return 127 / (time.monotonic() - m.first_token_time)

    for llm in llms.values():  # warm-up
        turn(llm)
    rates: dict[int, list[float]] = {k: [] for k in llms}
    for t in range(ns.turns):
        order = list(llms) if t % 2 == 0 else list(reversed(llms))
        for k in order:
            rates[k].append(turn(llms[k]))
    a, b = ns.steps
    paired = statistics.median(y / x for x, y in zip(rates[a], rates[b]))
    result = {"quantization": ns.quantization, "batched": ns.batched, "turns": ns.turns,
              "rates": {str(k): v for k, v in rates.items()},
              "medians": {str(k): statistics.median(v) for k, v in rates.items()},
              f"paired_{b}_over_{a}": paired}
    for k, v in rates.items():
        print(f"num_scheduler_steps {k}: " + " ".join(f"{r:.1f}" for r in v)
              + f" (median {statistics.median(v):.1f})")
    print(f"paired median {b} / {a}: {paired:.3f}")
    if ns.output_json:
        with open(ns.output_json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
