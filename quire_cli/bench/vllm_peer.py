"""The vLLM side of ``quire bench compare``, run by the vLLM venv's interpreter as a file.

It imports nothing from Quire (that venv has none of it), nor vLLM at module level:
``compare.py`` runs this same ``measure`` on Quire's ``LLM``, so both systems are measured
by one piece of code, through their offline ``LLM`` APIs:

- throughput: one ``generate`` over the whole workload (after a short warm-up);
- decode speed: ``(N - 1) / (t(N tokens) - t(1 token))`` on fresh prompts of one length;
- TTFT: the time of a one-token ``generate`` on a fresh prompt.

    python -I vllm_peer.py --requests requests.json --dtype float32 --output out.json \
        [--tensor-parallel-size N] [--decode-only]

``VLLM_CPU_KVCACHE_SPACE`` (GiB) in the environment sizes vLLM's KV cache. vLLM's ``LLM``
spawns its engine process, so it is created under ``if __name__ == "__main__"`` only.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time


def _prompts(token_lists):
    return [{"prompt_token_ids": list(ids)} for ids in token_lists]


def _timed(llm, params_cls, token_lists, max_tokens, ignore_eos=True):
    """-> (seconds, output tokens) of one generate call."""
    if isinstance(max_tokens, int):
        max_tokens = [max_tokens] * len(token_lists)
    params = [params_cls(temperature=0.0, max_tokens=n, ignore_eos=ignore_eos)
              for n in max_tokens]
    start = time.perf_counter()
    outputs = llm.generate(_prompts(token_lists), params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    return elapsed, sum(len(o.outputs[0].token_ids) for o in outputs)


def measure(llm, params_cls, req: dict, with_throughput: bool = True) -> dict:
    """The three figures on ``req`` (the request set compare.py wrote); without
    ``with_throughput``, the decode speed and TTFT only (the caller runs the batched workload
    itself)."""
    warm = req["warmup"]
    _timed(llm, params_cls, warm["prompt_token_ids"], warm["output_lens"])
    result = {}
    if with_throughput:
        work = req["workload"]
        elapsed, num_out = _timed(llm, params_cls, work["prompt_token_ids"],
                                  work["output_lens"], req["ignore_eos"])
        result["throughput"] = {"elapsed_s": elapsed, "num_output_tokens": num_out,
                                "output_tokens_per_s": num_out / elapsed}
    decode = measure_decode(llm, params_cls, req)
    return {**result, **decode, **measure_ttft(llm, params_cls, req)}


def decode_rate(llm, params_cls, pair, n: int) -> float:
    """One request's decode speed from one pair of fresh prompts: (n - 1) tokens over the
    time of an n-token generate less that of a one-token generate (its prefill)."""
    short, long = pair
    t1 = _timed(llm, params_cls, [short], 1)[0]
    t_n = _timed(llm, params_cls, [long], n)[0]
    return (n - 1) / (t_n - t1)


def measure_decode(llm, params_cls, req: dict) -> dict:
    """Only the decode speed (also ``quire bench tensor-parallel``'s figure)."""
    n = req["decode_output_len"]
    # [warm-up pair, then one pair a repeat]
    rates = [decode_rate(llm, params_cls, pair, n) for pair in req["decode_prompt_pairs"]][1:]
    return {"decode_tokens_per_s": statistics.median(rates), "decode_runs": rates}


def measure_ttft(llm, params_cls, req: dict) -> dict:
    """The time to first token of each fresh long prompt (the first a warm-up)."""
    ttfts = [_timed(llm, params_cls, [p], 1)[0] for p in req["ttft_prompts"]][1:]
    return {"ttft_s": statistics.median(ttfts), "ttft_runs_s": ttfts}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", required=True, help="JSON written by compare.py")
    parser.add_argument("--dtype", required=True)
    parser.add_argument("--output", required=True)
    parser.add_argument("--tensor-parallel-size", type=int, default=1)
    parser.add_argument("--decode-only", action="store_true")
    ns = parser.parse_args()
    with open(ns.requests) as f:
        req = json.load(f)

    import torch
    import vllm
    from vllm import LLM, SamplingParams

    start = time.perf_counter()
    llm = LLM(model=req["model_dir"], dtype=ns.dtype, max_model_len=req["max_model_len"],
              seed=0, tensor_parallel_size=ns.tensor_parallel_size)
    load_s = time.perf_counter() - start
    result = (measure_decode if ns.decode_only else measure)(llm, SamplingParams, req)
    result.update(system="vllm", dtype=ns.dtype, load_s=load_s, vllm_version=vllm.__version__,
                  tensor_parallel_size=ns.tensor_parallel_size,
                  torch_version=torch.__version__)
    with open(ns.output, "w") as f:
        json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
