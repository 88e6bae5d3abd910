"""``quire bench compare --peer llama.cpp``: Quire's native GGUF kernels against its own
de-quantized bf16 path and llama.cpp, on one GGUF file, in one run, same thread count.

Three systems: Quire with the GGUF's blocks multiplied natively (``quantization=auto``), Quire
with the weights widened to bf16 at load (``quantization=dequantize``), and llama.cpp through
``llama-cpp-python`` in its own venv (``--llama-python``; installed on demand by
``scripts/install-llama-cpp.sh`` when missing, never by the tests). Figures:

- one request's decode speed (greedy, ``--decode-output-len`` tokens, best of ``--repeats``),
  each also as a fraction of the memory bandwidth measured in the same run, for the bytes one
  decode step streams (the weights as that system holds them: ``limits.py``); Quire's two
  engines take turns, a pair of prompts each (which goes first swaps each turn), and the
  median of the turns' paired ratios is reported beside the ratio of the bests; from the two
  paths' bytes and rates, the step time fitted as bytes / bandwidth + a fixed time shared by
  both (``step_fit``), which says how far the fixed time keeps the ratio below the bytes';
- the time to first token of a ``--ttft-prompt-len`` prompt (best of ``--repeats``);
- for Quire's two paths, the long-tailed batched workload of ``quire bench throughput``
  (llama-cpp-python's API serves one sequence at a time, so llama.cpp has no such figure):
  ``--repeats`` turns, the two engines alternating (which goes first swaps each turn), so each
  pair of runs is a minute apart on a machine whose speed drifts; the median turn and the
  median of the turns' paired ratios are reported.

Quire's engines fault their KV cache in at start (``--kv-cache-prefault``, on by default here
as in ``quire engine``): llama.cpp clears its KV buffer when it creates a context, so neither
pays for fresh pages inside a timed step.

Every system sees the same token ids (``compare.make_requests``) and is measured the same way
(``vllm_peer.measure``'s rules; ``llama_peer.py`` for llama.cpp). JSON and a PNG are written.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from engine_worker.config import quire_cache_dir
from quire_cli.bench.report import write_json

PEER_SCRIPT = Path(__file__).with_name("llama_peer.py")
INSTALL_SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "install-llama-cpp.sh"
# the systems, in the order they run and are reported
NATIVE, DEQUANTIZED, LLAMA = "quire native", "quire dequantize", "llama.cpp"


def default_llama_python() -> str:
    return str(quire_cache_dir() / "llama-cpp" / "bin" / "python")


def add_llama_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("llama.cpp peer (--peer llama.cpp)")
    g.add_argument("--llama-python", default="",
                   help="the interpreter of a venv with llama-cpp-python (default: "
                        "$QUIRE_CACHE_DIR/llama-cpp/bin/python; built there by "
                        "scripts/install-llama-cpp.sh on first use)")
    g.add_argument("--skip-throughput", action="store_true",
                   help="skip the batched workload (Quire's native vs bf16 paths)")


def _llama_python(path: str) -> str:
    python = path or default_llama_python()
    if not Path(python).exists():
        venv = Path(python).parent.parent
        print(f"llama.cpp peer: no interpreter at {python}; installing llama-cpp-python into "
              f"{venv} (a source build: minutes)", file=sys.stderr)
        subprocess.run(["bash", str(INSTALL_SCRIPT), str(venv)], check=True)
    return python


def _best(result: dict) -> dict:
    return {**result, "decode_tokens_per_s": max(result["decode_runs"]),
            "ttft_s": min(result["ttft_runs_s"])}


def run_quire(engine_args, quantization: str, model: str, threads: int,
              requests: dict) -> tuple[Any, dict]:
    """-> (the engine, warmed up; its load time and what it runs). Its decode, TTFT and
    batched figures come later, the two engines taking turns (``alternate_decode``,
    ``alternate_throughput``)."""
    from engine_worker import LLM, SamplingParams
    from quire_cli.bench.limits import weight_bytes
    from quire_cli.bench.vllm_peer import _timed

    start = time.perf_counter()
    llm = LLM(**{**dataclasses.asdict(engine_args), "model": model,
                 "quantization": quantization, "num_threads": threads})
    load_s = time.perf_counter() - start
    warm = requests["warmup"]
    _timed(llm, SamplingParams, warm["prompt_token_ids"], warm["output_lens"])
    info = llm.info
    return llm, {"load_s": load_s, "threads": threads, "kernels": info.backend,
                 "dtype": str(info.dtype).removeprefix("torch."),
                 "quantization": info.quantization,
                 "quantization_summary": info.quantization_summary,
                 "step_bytes": weight_bytes(llm.engine.runner.model)}


def turn_order(names: list[str], turn: int) -> list[str]:
    """Who runs first swaps each turn: neither engine always follows the other."""
    return names if turn % 2 == 0 else names[::-1]


def alternate_decode(llms: dict, requests: dict) -> tuple[dict[str, list[float]], float]:
    """One request's decode on each engine a pair of prompts at a time, the engines taking
    turns (which goes first swaps each turn; the first turn a warm-up), so that each pair of
    runs sees the same state of a machine whose speed drifts: -> (each engine's rates, the
    median of the turns' native / de-quantized ratios)."""
    from engine_worker import SamplingParams
    from quire_cli.bench.vllm_peer import decode_rate

    n = requests["decode_output_len"]
    rates: dict[str, list[float]] = {name: [] for name in llms}
    for turn, pair in enumerate(requests["decode_prompt_pairs"]):
        for name in turn_order(list(llms), turn):
            rate = decode_rate(llms[name], SamplingParams, pair, n)
            if turn:
                rates[name].append(rate)
    paired = statistics.median(a / b for a, b in zip(rates[NATIVE], rates[DEQUANTIZED]))
    return rates, paired


def alternate_throughput(llms: dict, requests: dict, turns: int) -> dict[str, list[dict]]:
    """The batched workload ``turns`` times on each engine, alternating, the first swapping
    each turn (A B, B A, A B, ...): -> each engine's runs, in turn order."""
    from engine_worker import SamplingParams
    from quire_cli.bench.vllm_peer import _timed

    work = requests["workload"]
    runs: dict[str, list[dict]] = {name: [] for name in llms}
    for turn in range(turns):
        for name in turn_order(list(llms), turn):
            elapsed, num_out = _timed(llms[name], SamplingParams, work["prompt_token_ids"],
                                      work["output_lens"], requests["ignore_eos"])
            runs[name].append({"elapsed_s": elapsed, "num_output_tokens": num_out,
                               "output_tokens_per_s": num_out / elapsed})
    return runs


def throughput_figures(turns: dict[str, list[dict]]) -> tuple[dict, dict, float]:
    """-> (each engine's median turn, its runs' tok/s, the median of native/de-quantized
    over the turns, each pair of runs side by side in time)."""
    rates = {name: [r["output_tokens_per_s"] for r in runs] for name, runs in turns.items()}
    median = {name: sorted(runs, key=lambda r: r["output_tokens_per_s"])[(len(runs) - 1) // 2]
              for name, runs in turns.items()}
    paired = statistics.median(n / d for n, d in zip(rates[NATIVE], rates[DEQUANTIZED]))
    return median, rates, paired


def run_llama(python: str, threads: int, requests: dict, timeout_s: float) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    with tempfile.TemporaryDirectory(prefix="quire-compare-") as tmp:
        req_path, out = Path(tmp) / "requests.json", Path(tmp) / "llama.json"
        req_path.write_text(json.dumps(requests))
        # -I: the script's directory (Quire's benchmarks) stays off the peer's sys.path
        cmd = [python, "-I", str(PEER_SCRIPT), "--requests", str(req_path),
               "--threads", str(threads), "--output", str(out)]
        done = subprocess.run(cmd, env=env, stdout=sys.stderr, timeout=timeout_s)
        if done.returncode != 0 or not out.exists():
            how = f"exit {done.returncode}" if done.returncode >= 0 else \
                f"killed by {signal.Signals(-done.returncode).name}"  # SIGILL: see the script
            raise RuntimeError(f"the llama.cpp peer failed ({how}): {' '.join(cmd)}")
        return _best(json.loads(out.read_text()))


def gguf_step_bytes(path: Path) -> int:
    """What llama.cpp streams a decode step: every tensor of the file once (a tied token
    embedding is the logits' weight; its lookup reads one row)."""
    from engine_worker.weights.gguf_file import read_gguf

    return sum(t.data.nbytes for t in read_gguf(path).tensors)


def step_fit(bytes_a: float, rate_a: float, bytes_b: float, rate_b: float) -> dict | None:
    """Two paths of one model on one machine, each decode step taking bytes / bandwidth +
    fixed seconds, the same bandwidth and fixed time for both (attention, norms, sampling and
    the engine's Python do not depend on how the weights are coded): -> that bandwidth (GB/s)
    and fixed time (ms), from each path's bytes a step and tokens a second, and the ceiling
    of the rate ratio a over b (b's bytes over a's: what the ratio tends to as the fixed time
    goes to nothing). None where the two do not fit (a path streaming fewer bytes that is not
    faster: noise, or a difference that is not in the bytes)."""
    step_a, step_b = 1 / rate_a, 1 / rate_b
    if bytes_b <= bytes_a or step_b <= step_a:
        return None
    bandwidth = (bytes_b - bytes_a) / (step_b - step_a)
    fixed = step_a - bytes_a / bandwidth
    return {"bandwidth_gb_per_s": bandwidth / 1e9, "fixed_ms": fixed * 1e3,
            "ratio_ceiling": bytes_b / bytes_a}


def native_step_fit(runs: dict, paired: bool = False) -> dict | None:
    """step_fit of the native path against the de-quantized one: from their best decode rates,
    or (paired) the median fit of the turns run side by side (decode_runs, in turn order)."""
    n, d = runs[NATIVE], runs[DEQUANTIZED]
    if not paired:
        return step_fit(n["step_bytes"], n["decode_tokens_per_s"], d["step_bytes"],
                        d["decode_tokens_per_s"])
    fits = [f for a, b in zip(n["decode_runs"], d["decode_runs"])
            if (f := step_fit(n["step_bytes"], a, d["step_bytes"], b)) is not None]
    if not fits:
        return None
    return {k: statistics.median(f[k] for f in fits) for k in fits[0]} | {"turns": len(fits)}


def _ratios(runs: dict) -> dict:
    n, d = runs[NATIVE], runs[DEQUANTIZED]
    out = {"decode_native_over_dequantize": n["decode_tokens_per_s"] / d["decode_tokens_per_s"],
           "ttft_native_over_dequantize": n["ttft_s"] / d["ttft_s"]}
    if "throughput" in n and "throughput" in d:
        out["throughput_native_over_dequantize"] = (
            n["throughput"]["output_tokens_per_s"] / d["throughput"]["output_tokens_per_s"])
    if LLAMA in runs:
        lc = runs[LLAMA]
        out["decode_native_over_llama_cpp"] = n["decode_tokens_per_s"] / lc["decode_tokens_per_s"]
        # below 1: Quire's first token comes sooner
        out["ttft_native_over_llama_cpp"] = n["ttft_s"] / lc["ttft_s"]
    return out


def _print_report(env: dict, runs: dict, ratios: dict, limits_text: str,
                  fit: dict | None) -> None:
    print(f"CPU: {env['cpu_model']} ({env['cpu_count']} cores; {' '.join(env['isa_flags'])}); "
          f"{env['threads']} threads each; {limits_text}")
    print(f"{'system':<18}{'decode tok/s':>13}{'of bandwidth':>14}{'MB a step':>11}"
          f"{'TTFT s':>9}{'batch tok/s':>13}")
    for name, r in runs.items():
        tput = r.get("throughput", {}).get("output_tokens_per_s")
        print(f"{name:<18}{r['decode_tokens_per_s']:>13.1f}{r['decode_fraction']:>14.0%}"
              f"{r['step_bytes'] / 1e6:>11.1f}{r['ttft_s']:>9.3f}"
              f"{'' if tput is None else f'{tput:.1f}':>13}")
    print("ratios: " + ", ".join(f"{k} {v:.2f}" for k, v in ratios.items()))
    if fit is not None:
        print(f"a decode step on Quire's two paths, fitted as bytes / "
              f"{fit['bandwidth_gb_per_s']:.1f} GB/s + {fit['fixed_ms']:.2f} ms each; the "
              f"bytes alone would allow native {fit['ratio_ceiling']:.2f}x the de-quantized "
              "path" + ("" if fit["fixed_ms"] >= 0 else ": no fixed time fits, the two paths "
                        "did not see one bandwidth (the de-quantized one ran slower)"))


def _write_plot(path: Path, runs: dict, env: dict) -> bool:
    try:
        from matplotlib.figure import Figure
    except ImportError:
        print("note: matplotlib is not installed (pip install quire[bench]); no plot written",
              file=sys.stderr)
        return False
    colors = {NATIVE: "tab:blue", DEQUANTIZED: "tab:cyan", LLAMA: "tab:gray"}
    names = list(runs)
    batched = [n for n in names if "throughput" in runs[n]]
    panels = (("One request: decode (best of runs)", "tokens/s", names,
               [runs[n]["decode_tokens_per_s"] for n in names], "%.1f"),
              ("Decode, of memory bandwidth", "fraction", names,
               [runs[n]["decode_fraction"] for n in names], "%.2f"),
              ("Time to first token", "seconds", names, [runs[n]["ttft_s"] for n in names],
               "%.3f"),
              ("Batched long-tailed workload", "output tokens/s", batched,
               [runs[n]["throughput"]["output_tokens_per_s"] for n in batched], "%.1f"))
    fig = Figure(figsize=(16, 4.5), layout="constrained")
    for ax, (title, ylabel, labels, values, fmt) in zip(fig.subplots(1, 4), panels):
        ax.bar_label(ax.bar([n.replace(" ", "\n") for n in labels], values,
                            color=[colors[n] for n in labels]), fmt=fmt)
        ax.set(title=title, ylabel=ylabel)
    fig.suptitle(f"{Path(env['gguf']).name}: Quire native / de-quantized bf16 / llama.cpp on "
                 f"{env['cpu_model']} ({env['threads']} threads; {' '.join(env['isa_flags'])})",
                 fontsize=10)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    return True


def run_from_args(ns: argparse.Namespace) -> int:
    from engine_worker import SamplingParams
    from engine_worker.arg_utils import engine_args_from_namespace
    from engine_worker.weights.resolve import gguf_path_of, resolve_model_dir
    from quire.config_args import dataclass_from_namespace
    from quire_cli.bench.compare import CompareConfig, cpu_facts, make_requests
    from quire_cli.bench.limits import decode_fraction, describe, limits_report, measure_limits
    from quire_cli.bench.vllm_peer import measure_ttft

    cfg = dataclass_from_namespace(CompareConfig, ns)
    engine_args = engine_args_from_namespace(ns)
    gguf = gguf_path_of(engine_args.model)
    if gguf is None:
        raise ValueError(f"model: --peer llama.cpp needs a GGUF model (the embedded model or a "
                         f".gguf path), got {engine_args.model!r}")
    python = None if cfg.skip_vllm else _llama_python(ns.llama_python)
    threads = engine_args.num_threads or os.cpu_count()
    model_dir = resolve_model_dir(engine_args.model)  # the de-quantized copy: its config.json
    vocab_size = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    max_model_len = engine_args.max_model_len or 2048
    if max(cfg.ttft_prompt_len, cfg.max_input_len + cfg.max_output_len) >= max_model_len:
        raise ValueError(f"max_model_len: {max_model_len} is too short for the prompts")
    requests = {**make_requests(cfg, vocab_size, model_dir, max_model_len),
                "gguf_path": str(gguf)}
    env = {**cpu_facts(), "gguf": str(gguf), "threads": threads,
           "loadavg_1m_at_start": os.getloadavg()[0]}
    runs: dict[str, dict] = {}
    llms: dict[str, Any] = {}
    before = os.getloadavg()[0]
    for name, quantization in ((NATIVE, "auto"), (DEQUANTIZED, "dequantize")):
        print(name, file=sys.stderr)
        llms[name], runs[name] = run_quire(engine_args, quantization, str(gguf), threads,
                                           requests)
    print(f"one request's decode, {cfg.repeats} turns each, alternating", file=sys.stderr)
    decode_runs, decode_paired = alternate_decode(llms, requests)
    for name, llm in llms.items():
        runs[name] = _best({**runs[name], "decode_runs": decode_runs[name],
                            **measure_ttft(llm, SamplingParams, requests),
                            "loadavg_1m_before": before, "loadavg_1m_after": os.getloadavg()[0]})
    paired = None
    if not ns.skip_throughput:
        print(f"the batched workload, {cfg.repeats} turns each, alternating", file=sys.stderr)
        median, rates, paired = throughput_figures(
            alternate_throughput(llms, requests, cfg.repeats))
        for name in llms:
            runs[name].update(throughput=median[name], throughput_runs=rates[name])
    llms.clear()
    gc.collect()
    if python is not None:
        print(f"{LLAMA} ({python})", file=sys.stderr)
        before = os.getloadavg()[0]
        runs[LLAMA] = {**run_llama(python, threads, requests, cfg.peer_timeout_s),
                       "step_bytes": gguf_step_bytes(gguf), "loadavg_1m_before": before,
                       "loadavg_1m_after": os.getloadavg()[0]}
    limits = measure_limits("cpu")
    for r in runs.values():
        r["decode_fraction"] = decode_fraction(r["decode_tokens_per_s"], r["step_bytes"],
                                               limits)
    env["loadavg_1m_at_end"] = os.getloadavg()[0]
    ratios = _ratios(runs)
    ratios["decode_native_over_dequantize_paired"] = decode_paired
    if paired is not None:  # pairs of runs side by side in time, not two medians
        ratios["throughput_native_over_dequantize"] = paired
    fits = {"best": native_step_fit(runs), "paired": native_step_fit(runs, paired=True)}
    _print_report(env, runs, ratios, describe(limits), fits["best"])
    report = {"config": {**dataclasses.asdict(cfg), "peer": "llama.cpp",
                         "engine": dataclasses.asdict(engine_args)},
              "environment": env, "machine": limits_report(limits),
              "workload": requests["workload_summary"], "runs": runs, "ratios": ratios,
              "decode_step_fit": fits}
    print(f"wrote {write_json(report, cfg.output_json)}")
    plot = Path(cfg.output_plot) if cfg.output_plot else Path(cfg.output_json).with_suffix(".png")
    if _write_plot(plot, runs, env):
        print(f"wrote {plot}")
    return 0
