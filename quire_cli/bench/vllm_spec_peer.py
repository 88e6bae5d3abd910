"""The vLLM side of ``quire bench spec-decode``, run by the vLLM venv's interpreter as a file.

It imports nothing from Quire (that venv has none of it), nor vLLM at module level. Two vLLM
``LLM`` instances, one with ``speculative_config``, decode the same prompts (token ids, so
the very prompts Quire decoded) greedily, taking turns run by run as Quire's two engines do.
Decode speed of one request is ``(N - 1) / (t(N tokens) - t(1 token))``, prefix caching off
so both calls compute the whole prompt. An engine that fails to start or to generate is
reported with its error instead of figures.

    python -I vllm_spec_peer.py --requests requests.json --output out.json

``requests.json``: ``{"prompts": {name: [ids]}, "output_len": N, "repeats": R,
"spec_config": {...}, "model": DIR, "dtype": "float32"}``. ``VLLM_CPU_KVCACHE_SPACE`` (GiB)
sizes each engine's KV cache.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import traceback


def _timed(llm, params_cls, ids, max_tokens):
    params = params_cls(temperature=0.0, max_tokens=max_tokens, ignore_eos=False)
    start = time.perf_counter()
    out = llm.generate([{"prompt_token_ids": list(ids)}], params, use_tqdm=False)[0]
    return time.perf_counter() - start, list(out.outputs[0].token_ids)


def _decode_rate(llm, params_cls, ids, n):
    t1, _ = _timed(llm, params_cls, ids, 1)
    t_n, tokens = _timed(llm, params_cls, ids, n)
    return (len(tokens) - 1) / (t_n - t1) if len(tokens) > 1 else 0.0, tokens


def _error(e: BaseException) -> str:
    lines = traceback.format_exception_only(type(e), e)
    return "".join(lines).strip()[-2000:]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--requests", required=True)
    parser.add_argument("--output", required=True)
    ns = parser.parse_args()
    with open(ns.requests) as f:
        req = json.load(f)

    import vllm
    from vllm import LLM, SamplingParams

    result = {"vllm_version": vllm.__version__, "spec_config": req["spec_config"]}
    engines = {}
    for label, spec in (("off", None), ("on", req["spec_config"])):
        kw = {"speculative_config": spec} if spec is not None else {}
        try:
            engines[label] = LLM(model=req["model"], dtype=req["dtype"], max_model_len=2048,
                                 enable_prefix_caching=False, seed=0, **kw)
        except BaseException as e:  # noqa: BLE001 - the error is the result
            result[f"{label}_error"] = _error(e)
            print(f"vLLM {label}: {result[f'{label}_error']}", flush=True)
    if "off" in engines and "on" in engines:
        for llm in engines.values():
            try:
                _timed(llm, SamplingParams, list(req["prompts"].values())[-1][:16], 8)
            except BaseException as e:  # noqa: BLE001
                result["warmup_error"] = _error(e)
        for name, ids in req["prompts"].items():
            runs = {"off": [], "on": [], "ratios": []}
            tokens = {}
            for _ in range(req["repeats"]):
                for label, llm in engines.items():
                    rate, tokens[label] = _decode_rate(llm, SamplingParams, ids,
                                                       req["output_len"])
                    runs[label].append(rate)
                    print(f"vLLM {label:<4}{name:<8}{rate:>8.1f} tok/s", flush=True)
                runs["ratios"].append(runs["on"][-1] / runs["off"][-1])
            result[name] = {"off_tokens_per_s": statistics.median(runs["off"]),
                            "on_tokens_per_s": statistics.median(runs["on"]),
                            "ratio": statistics.median(runs["ratios"]), "runs": runs,
                            "same_tokens": tokens["off"] == tokens["on"],
                            "num_output_tokens": len(tokens["on"])}
    with open(ns.output, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
