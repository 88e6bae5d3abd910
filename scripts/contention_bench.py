"""How much the offline engine loses when another process takes a slice of a core: the serving
benchmark's random workload (64 prompts of 256 random token ids, ``--max-tokens`` greedy tokens
each, ignore_eos) through ``LLM.generate``, alternately alone and beside a spinner that runs
``--busy-ms`` in every ``--period-ms`` (by default 0.2 of a core: about what the router, the
engine's gRPC thread and vLLM's client take in a served run). Each run gets fresh prompts, so
the prefix cache never carries one run into the next.

    python scripts/contention_bench.py --repeats 3 [--max-tokens 128] [--out F.json]

Prints each run's seconds, and JSON {"quiet": [...], "spin": [...]} (seconds a run).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import random
import time


def spin(stop, busy_s: float, period_s: float) -> None:
    while not stop.is_set():
        started = time.perf_counter()
        while time.perf_counter() - started < busy_s:
            pass
        time.sleep(max(period_s - busy_s, 0.0))


def prompts(seed: int, num: int = 64, length: int = 256) -> list[dict]:
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(100, 40000) for _ in range(length)]}
            for _ in range(num)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--busy-ms", type=float, default=2.0)
    parser.add_argument("--period-ms", type=float, default=10.0)
    parser.add_argument("--num-threads", type=int, default=2)
    parser.add_argument("--out", help="write the JSON here too")
    args = parser.parse_args()

    from engine_worker.llm import LLM
    from engine_worker.sampling_params import SamplingParams

    llm = LLM(num_threads=args.num_threads)
    llm.generate(prompts(10 ** 6)[:4], SamplingParams(max_tokens=8, ignore_eos=True))  # warm
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    seconds: dict[str, list[float]] = {"quiet": [], "spin": []}
    for rep in range(args.repeats):
        for spinning in (False, True):
            stop = mp.Event()
            spinner = mp.Process(target=spin, args=(stop, args.busy_ms / 1e3,
                                                    args.period_ms / 1e3)) if spinning else None
            if spinner is not None:
                spinner.start()
            started = time.perf_counter()
            llm.generate(prompts(2 * rep + spinning), params)
            elapsed = time.perf_counter() - started
            if spinner is not None:
                stop.set()
                spinner.join()
            name = "spin" if spinning else "quiet"
            seconds[name].append(round(elapsed, 3))
            print(f"run {rep} {name}: {elapsed:.3f} s", flush=True)
    print(json.dumps(seconds))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(seconds | {"args": vars(args)}, f, indent=1)


if __name__ == "__main__":
    main()
