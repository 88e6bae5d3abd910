"""The llama.cpp side of ``quire bench compare --peer llama.cpp``, run by the interpreter of a venv
with ``llama-cpp-python`` as a file (``scripts/install-llama-cpp.sh`` makes one).

It imports nothing from Quire (that venv has none of it). It measures what ``vllm_peer.measure``
measures for one request, the same way, on the same prompts (token ids, so no tokenizer
differs): decode speed ``(N - 1) / (t(N tokens) - t(1 token))`` on fresh prompts, greedy, and
the time to first token as the time of a one-token generation on a fresh prompt. Each
generation starts from an empty KV cache (the prompts share no prefix).

    python -I llama_peer.py --requests requests.json --threads 2 --output out.json
"""

from __future__ import annotations

import argparse
import json
import time


def _timed(llm, tokens: list[int], max_tokens: int) -> float:
    """Seconds to ``max_tokens`` greedy tokens after ``tokens`` (EOS does not stop it:
    ``Llama.generate`` yields until the caller stops)."""
    llm.reset()
    start = time.perf_counter()
    n = 0
    for _ in llm.generate(tokens, top_k=1, top_p=1.0, min_p=0.0, temp=0.0,
                          repeat_penalty=1.0, reset=True):
        n += 1
        if n == max_tokens:
            break
    return time.perf_counter() - start


def measure(llm, req: dict) -> dict:
    n = req["decode_output_len"]
    rates = []
    for i, (short, long) in enumerate(req["decode_prompt_pairs"]):  # the first: a warm-up
        t1 = _timed(llm, short, 1)
        t_n = _timed(llm, long, n)
        if i:
            rates.append((n - 1) / (t_n - t1))
    ttfts = [_timed(llm, p, 1) for p in req["ttft_prompts"]][1:]
    return {"decode_runs": rates, "ttft_runs_s": ttfts}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", required=True, help="JSON written by llama_compare.py")
    parser.add_argument("--threads", type=int, required=True)
    parser.add_argument("--output", required=True)
    ns = parser.parse_args()
    with open(ns.requests) as f:
        req = json.load(f)

    import llama_cpp

    start = time.perf_counter()
    # llama-cpp-python's defaults otherwise (n_batch 512: what a user gets)
    llm = llama_cpp.Llama(model_path=req["gguf_path"], n_ctx=req["max_model_len"],
                          n_threads=ns.threads, n_threads_batch=ns.threads, seed=0,
                          verbose=False)
    load_s = time.perf_counter() - start
    result = measure(llm, req)
    result.update(system="llama.cpp", load_s=load_s, threads=ns.threads,
                  llama_cpp_python_version=llama_cpp.__version__,
                  system_info=llama_cpp.llama_print_system_info().decode(errors="replace"),
                  n_batch=llm.n_batch, n_ctx=llm.n_ctx())
    with open(ns.output, "w") as f:
        json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
