"""``quire bench spec-decode``: one request at a time, speculative decoding on vs off, same run.

Two chat prompts through the model's chat template, each decoded greedily by two engines
built in this process (the same flags, one with ``--speculative-config``):

- *repeat*: "repeat this passage" over a ~500-token passage in the prompt, where n-gram
  proposals come from the prompt and are mostly accepted;
- *edit*: "rewrite this passage with these small edits" over the same passage (a name, a
  year and a word replaced): proposals are accepted except around the edits;
- *open*: an open-ended request, where proposals are rare and mostly rejected (a small
  model's greedy text repeats itself, though, so it may gain too);
- *batch* (``--batch-requests``): the long-tailed random workload of ``bench throughput``,
  all at once, where the batch rule turns drafts off while the batch is large.

Decode speed is (output tokens - 1) / (time after the first token); the two engines take
turns run by run and the ratio quoted is the median of the paired ratios (targets: >= 1.8x on
repeat, >= 0.95x on open). Whether both decoded the same tokens is reported (greedy; in fp32
they must be, in bf16 they may differ where two tokens' logits round alike). bf16 by default,
as the other benchmarks: on an AVX2 CPU an fp32 weight goes through torch's fp32 matmul, whose
multi-row path costs several times its one-row path (up to 30x on a loaded 2-core Zen 3),
while the bf16 panel kernel streams the weight once for every row.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass

from engine_worker.arg_utils import add_bench_engine_args, engine_args_from_namespace
from quire.config_args import dataclass_from_namespace, require_at_least
from quire_cli.bench.report import write_json

PASSAGE = (
    "The lighthouse at the end of the harbour was built in 1852 by a company of stonemasons "
    "who had never before worked so far from home. They came by boat from the mainland with "
    "their tools, their families and a small library of books on geometry, and they lived for "
    "three years in wooden huts on the rocks while the tower rose above them. Each stone was "
    "cut to fit the one below it, so that the whole tower locked together like the pieces of a "
    "puzzle, and no mortar was needed to hold it against the winter storms. When the lamp was "
    "first lit, people in the town gathered on the quay to watch the beam sweep across the "
    "water, and the children counted the seconds between each flash. The first keeper was a "
    "retired sailor named Thomas Hale, who kept a careful log of every ship that passed, every "
    "storm that struck the tower and every repair that he made to the lamp. His log books, "
    "written in a small and steady hand, are kept today in the town museum, where visitors can "
    "read about the night in 1867 when a fishing boat lost its mast in a gale and drifted "
    "towards the rocks until Hale rowed out alone and towed it into the harbour. For more than "
    "a century the light was tended by keepers who lived in the small cottage at the foot of "
    "the tower, trimming the wick, polishing the great glass lens and winding the clockwork "
    "that turned it. In 1961 the lamp was replaced by an electric light, and in 1989 the last "
    "keeper left the island when the light was made automatic. The cottage stood empty for "
    "many years, and the paint peeled from its doors, until a group of volunteers from the "
    "town repaired the roof, cleaned the windows and opened it as a small museum. Today the "
    "light still flashes every ten seconds, and on calm summer evenings the volunteers lead "
    "visitors up the hundred and twelve steps of the spiral staircase to the lamp room, where "
    "they can look out over the harbour, the town and the open sea beyond it. On a clear day "
    "it is possible to see the mainland, a thin grey line on the horizon, from which the "
    "stonemasons first set out more than a hundred and seventy years ago.")

PROMPTS = {
    "repeat": "Repeat the following passage exactly, word for word, with nothing before or "
              "after it:\n\n" + PASSAGE,
    "edit": "Rewrite the following passage with three small edits: the keeper's name is "
            "Peter Grey instead of Thomas Hale, the tower was built in 1858 instead of 1852, "
            "and the museum is called the harbour museum. Keep every other word exactly as it "
            "is, and write nothing before or after the passage:\n\n" + PASSAGE,
    "open": "Write a story about a young cook who travels to a distant city to open a "
            "restaurant, describing the people she meets along the way.",
}


@dataclass(frozen=True, slots=True)
class SpecBenchConfig:
    output_len: int = 400
    repeats: int = 2
    batch_requests: int = 16  # the batched check: long-tailed random prompts (0: skip)
    spec_config: str = ('{"method": "ngram", "num_speculative_tokens": 4, '
                        '"prompt_lookup_max": 5, "prompt_lookup_min": 2}')
    output_json: str = "bench_results/spec_decode.json"
    # vLLM's CPU build side by side (its venv's python; empty: skip), on the same prompts
    vllm_python: str = ""
    vllm_dtype: str = "float32"  # its bf16 on an AVX2 CPU is torch's emulated matmul

    def __post_init__(self) -> None:
        require_at_least(self, ("repeats",))
        require_at_least(self, ("output_len",), minimum=8)


def add_spec_decode_args(parser: argparse.ArgumentParser) -> None:
    d = SpecBenchConfig()
    parser.add_argument("--output-len", type=int, default=d.output_len)
    parser.add_argument("--repeats", type=int, default=d.repeats)
    parser.add_argument("--batch-requests", type=int, default=d.batch_requests,
                        help="requests of the batched check (long-tailed random prompts, "
                             "throughput on vs off; 0: skip)")
    parser.add_argument("--spec-config", default=d.spec_config,
                        help="the speculative_config of the 'on' engine (JSON)")
    parser.add_argument("--output-json", default=d.output_json)
    parser.add_argument("--vllm-python", default=d.vllm_python,
                        help="vLLM's CPU build's python: its ngram method on the same prompts, "
                             "on vs off taking turns (empty: skip)")
    parser.add_argument("--vllm-dtype", default=d.vllm_dtype)
    add_bench_engine_args(parser)


def _decode_run(engine, prompt_ids: list[int], output_len: int, tag: str):
    """-> (decode tokens/s after the first token, the output token ids)."""
    from engine_worker import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=output_len)
    engine.add_request(tag, {"prompt_token_ids": prompt_ids}, params)
    first = None
    tokens: list[int] = []
    while engine.has_unfinished_requests():
        for out in engine.step().outputs:
            tokens = out.outputs[0].token_ids
            if first is None and tokens:
                first = time.perf_counter()
    end = time.perf_counter()
    return (len(tokens) - 1) / (end - first) if len(tokens) > 1 else 0.0, tokens


def _batch_run(engine, workload) -> float:
    """Output tokens per second of the whole batch, all requests added at once."""
    from engine_worker import SamplingParams

    start = time.perf_counter()
    for i, (prompt, n) in enumerate(zip(workload.prompt_token_ids, workload.output_lens)):
        engine.add_request(f"batch-{time.perf_counter()}-{i}", {"prompt_token_ids": list(prompt)},
                           SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
    num_tokens = 0
    while engine.has_unfinished_requests():
        for out in engine.step().outputs:
            if out.finished:
                num_tokens += len(out.outputs[0].token_ids)
    return num_tokens / (time.perf_counter() - start)


def _batched(engines, cfg: SpecBenchConfig) -> dict:
    """The long-tailed batched workload (``bench throughput``'s), on and off taking turns:
    the batch rule should keep speculation from costing throughput."""
    from quire_cli.bench.throughput import make_workload

    workload = make_workload(num_prompts=cfg.batch_requests, input_lens=(16, 256),
                             output_lens=(16, 96), vocab_size=engines["off"].tokenizer.vocab_size,
                             seed=0)
    runs: dict[str, list[float]] = {"off": [], "on": [], "ratios": []}
    for _ in range(cfg.repeats):
        for label, engine in engines.items():
            runs[label].append(_batch_run(engine, workload))
            print(f"  {label:<4}batch {runs[label][-1]:>8.1f} output tok/s", file=sys.stderr)
        runs["ratios"].append(runs["on"][-1] / runs["off"][-1])
    return {"runs": runs, "ratio": statistics.median(runs["ratios"]),
            "off_tokens_per_s": statistics.median(runs["off"]),
            "on_tokens_per_s": statistics.median(runs["on"])}


def _vllm(cfg: SpecBenchConfig, prompts: dict[str, list[int]], model_dir) -> dict:
    """vLLM's side (``vllm_spec_peer.py`` in its venv): the same prompts' token ids, the same
    speculative_config, its decode speed on vs off; or the error it stopped with."""
    import subprocess
    import tempfile
    from pathlib import Path

    script = Path(__file__).with_name("vllm_spec_peer.py")
    with tempfile.TemporaryDirectory() as tmp:
        requests, output = Path(tmp) / "requests.json", Path(tmp) / "out.json"
        requests.write_text(json.dumps({
            "prompts": prompts, "output_len": cfg.output_len, "repeats": cfg.repeats,
            "spec_config": json.loads(cfg.spec_config), "model": str(model_dir),
            "dtype": cfg.vllm_dtype}))
        env = os.environ | {"VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE",
                                                                      "1")}
        proc = subprocess.run([cfg.vllm_python, "-I", str(script), "--requests", str(requests),
                               "--output", str(output)], env=env, capture_output=True,
                              text=True)
        for line in proc.stdout.splitlines():
            if line.startswith("vLLM "):
                print(f"  {line}", file=sys.stderr)
        if not output.exists():
            return {"error": f"exit {proc.returncode}: {proc.stderr[-3000:]}"}
        return json.loads(output.read_text())


def _prompts(engine) -> dict[str, list[int]]:
    tokenizer = engine.tokenizer
    return {name: tokenizer.encode(tokenizer.apply_chat_template(
        [{"role": "user", "content": text}]), add_special_tokens=False)
        for name, text in PROMPTS.items()}


def _spec_report(engine) -> dict:
    stats = engine.stats().scheduler.spec_decoding
    return dataclasses.asdict(stats) | {"acceptance_rate": stats.acceptance_rate,
                                        "mean_acceptance_length": stats.mean_acceptance_length}


def run_from_args(ns: argparse.Namespace) -> int:
    from engine_worker import LLM

    cfg = dataclass_from_namespace(SpecBenchConfig, ns)
    base_args = engine_args_from_namespace(ns)
    report = {"config": dataclasses.asdict(cfg), "engine": dataclasses.asdict(base_args),
              "environment": {"cpu_count": os.cpu_count(),
                              "loadavg_1m_at_start": os.getloadavg()[0]}}
    # both engines live side by side and take turns, run by run, so a change in the
    # machine's load between runs falls on both alike
    engines = {label: LLM(**(dataclasses.asdict(base_args) | {"speculative_config": spec})).engine
               for label, spec in (("off", None), ("on", json.loads(cfg.spec_config)))}
    prompts = _prompts(engines["off"])
    report["environment"]["kernels"] = engines["off"].info.backend
    report["environment"]["dtype"] = str(engines["off"].info.dtype)
    report["prompt_tokens"] = {name: len(ids) for name, ids in prompts.items()}
    for label, engine in engines.items():
        _decode_run(engine, prompts["open"][:16], 8, f"{label}-warm")
    runs = {name: {"off": [], "on": [], "ratios": []} for name in prompts}
    tokens: dict[str, dict[str, list[int]]] = {name: {} for name in prompts}
    for r in range(cfg.repeats):
        for name, ids in prompts.items():
            for label, engine in engines.items():
                rate, tokens[name][label] = _decode_run(engine, ids, cfg.output_len,
                                                        f"{label}-{name}-{r}")
                runs[name][label].append(rate)
                print(f"  {label:<4}{name:<8}{rate:>8.1f} tok/s ({len(tokens[name][label])} "
                      f"tokens)", file=sys.stderr)
            runs[name]["ratios"].append(runs[name]["on"][-1] / runs[name]["off"][-1])
    report["on_spec_decoding"] = _spec_report(engines["on"])
    report["environment"]["loadavg_1m_at_end"] = os.getloadavg()[0]
    print(f"{'prompt':<10}{'off tok/s':>12}{'on tok/s':>12}{'ratio':>8}  same tokens")
    for name in prompts:
        r = runs[name]
        ratio = statistics.median(r["ratios"])
        same = tokens[name]["off"] == tokens[name]["on"]
        report[name] = {"off_tokens_per_s": statistics.median(r["off"]),
                        "on_tokens_per_s": statistics.median(r["on"]), "runs": r,
                        "ratio": ratio, "same_tokens": same,
                        "num_output_tokens": len(tokens[name]["on"])}
        print(f"{name:<10}{statistics.median(r['off']):>12.1f}"
              f"{statistics.median(r['on']):>12.1f}{ratio:>7.2f}x  {same}")
    if cfg.batch_requests:
        report["batch"] = _batched(engines, cfg)
        b = report["batch"]
        print(f"{'batch':<10}{b['off_tokens_per_s']:>12.1f}{b['on_tokens_per_s']:>12.1f}"
              f"{b['ratio']:>7.2f}x  ({cfg.batch_requests} requests, output tok/s)")
        report["on_spec_decoding"] = _spec_report(engines["on"])
    if cfg.vllm_python:
        from engine_worker.weights.resolve import resolve_model_dir

        # the safetensors directory (a GGUF the engine ran natively is converted for vLLM)
        report["vllm"] = v = _vllm(cfg, prompts, resolve_model_dir(base_args.model))
        for name in prompts:
            if name in v:
                print(f"vLLM {name:<5}{v[name]['off_tokens_per_s']:>12.1f}"
                      f"{v[name]['on_tokens_per_s']:>12.1f}{v[name]['ratio']:>7.2f}x  "
                      f"{v[name]['same_tokens']}")
        for key in ("error", "off_error", "on_error", "warmup_error"):
            if key in v:
                print(f"vLLM {key}: {v[key]}")
    spec = report["on_spec_decoding"]
    print(f"acceptance: {spec['acceptance_rate']:.2f} of draft tokens, "
          f"{spec['mean_acceptance_length']:.2f} tokens per verifying step")
    print(f"wrote {write_json(report, cfg.output_json)}")
    return 0
