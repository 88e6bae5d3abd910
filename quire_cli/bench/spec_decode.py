"""``quire bench spec-decode``: one request at a time, speculative decoding on vs off, same run.

Two chat prompts through the model's chat template, each decoded greedily by two engines
built in this process (the same flags, one with ``--speculative-config``):

- *repeat*: "repeat this passage" over a ~500-token passage in the prompt, where n-gram
  proposals come from the prompt and are mostly accepted;
- *open*: an open-ended request, where proposals are rare and mostly rejected.

Decode speed is (output tokens - 1) / (time after the first token), the median of
``--repeats`` runs; greedy fp32 output is the same with and without speculation (checked), so
both decode the same tokens. The ratio spec/off is what to quote (targets: >= 1.8x on
repeat, >= 0.95x on open).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass

from engine_worker.arg_utils import add_engine_args, engine_args_from_namespace
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
    "open": "Write a story about a young cook who travels to a distant city to open a "
            "restaurant, describing the people she meets along the way.",
}


@dataclass(frozen=True, slots=True)
class SpecBenchConfig:
    output_len: int = 400
    repeats: int = 2
    spec_config: str = ('{"method": "ngram", "num_speculative_tokens": 4, '
                        '"prompt_lookup_max": 5, "prompt_lookup_min": 2}')
    output_json: str = "bench_results/spec_decode.json"

    def __post_init__(self) -> None:
        require_at_least(self, ("repeats",))
        require_at_least(self, ("output_len",), minimum=8)


def add_spec_decode_args(parser: argparse.ArgumentParser) -> None:
    d = SpecBenchConfig()
    parser.add_argument("--output-len", type=int, default=d.output_len)
    parser.add_argument("--repeats", type=int, default=d.repeats)
    parser.add_argument("--spec-config", default=d.spec_config,
                        help="the speculative_config of the 'on' engine (JSON)")
    parser.add_argument("--output-json", default=d.output_json)
    add_engine_args(parser)
    parser.set_defaults(dtype="float32")  # greedy outputs equal with and without speculation


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


def _measure(engine, prompts: dict[str, list[int]], cfg: SpecBenchConfig, label: str) -> dict:
    _decode_run(engine, prompts["open"][:16], 8, f"{label}-warm")
    result = {}
    for name, ids in prompts.items():
        runs, tokens = [], []
        for r in range(cfg.repeats):
            rate, tokens = _decode_run(engine, ids, cfg.output_len, f"{label}-{name}-{r}")
            runs.append(rate)
        result[name] = {"decode_tokens_per_s": statistics.median(runs), "runs": runs,
                        "num_output_tokens": len(tokens), "token_ids": tokens}
        print(f"  {label:<5}{name:<8}{statistics.median(runs):>8.1f} tok/s "
              f"({len(tokens)} tokens)", file=sys.stderr)
    stats = engine.stats().scheduler.spec_decoding
    if stats is not None:
        result["spec_decoding"] = dataclasses.asdict(stats) | {
            "acceptance_rate": stats.acceptance_rate,
            "mean_acceptance_length": stats.mean_acceptance_length}
    return result


def run_from_args(ns: argparse.Namespace) -> int:
    from engine_worker import LLM

    cfg = dataclass_from_namespace(SpecBenchConfig, ns)
    base_args = engine_args_from_namespace(ns)
    report = {"config": dataclasses.asdict(cfg), "engine": dataclasses.asdict(base_args),
              "environment": {"cpu_count": os.cpu_count(),
                              "loadavg_1m_at_start": os.getloadavg()[0]}}
    for label, spec in (("off", None), ("on", json.loads(cfg.spec_config))):
        llm = LLM(**(dataclasses.asdict(base_args) | {"speculative_config": spec}))
        tokenizer = llm.engine.tokenizer
        prompts = {name: tokenizer.encode(tokenizer.apply_chat_template(
            [{"role": "user", "content": text}]), add_special_tokens=False)
            for name, text in PROMPTS.items()}
        report["environment"]["kernels"] = llm.info.backend
        report["prompt_tokens"] = {name: len(ids) for name, ids in prompts.items()}
        report[label] = _measure(llm.engine, prompts, cfg, label)
        del llm
        gc.collect()
    report["environment"]["loadavg_1m_at_end"] = os.getloadavg()[0]
    print(f"{'prompt':<10}{'off tok/s':>12}{'on tok/s':>12}{'ratio':>8}  same tokens")
    for name in PROMPTS:
        off, on = report["off"][name], report["on"][name]
        ratio = on["decode_tokens_per_s"] / off["decode_tokens_per_s"]
        report[f"ratio_{name}"] = ratio
        same = off["token_ids"] == on["token_ids"]
        report[f"same_tokens_{name}"] = same
        print(f"{name:<10}{off['decode_tokens_per_s']:>12.1f}{on['decode_tokens_per_s']:>12.1f}"
              f"{ratio:>7.2f}x  {same}")
    spec = report["on"].get("spec_decoding", {})
    print(f"acceptance: {spec.get('acceptance_rate', 0):.2f} of draft tokens, "
          f"{spec.get('mean_acceptance_length', 1):.2f} tokens per verifying step")
    print(f"wrote {write_json(report, cfg.output_json)}")
    return 0
