"""``quire bench lora-router``: adapter-aware placement against round-robin, with many LoRA
adapters on a few engines (issue #27's router target).

``num_adapters`` PEFT adapters (rank ``lora_rank`` on q, k, v, o, gate, up, down; random,
non-zero ``lora_B``) are made here by PEFT from the base model, and every engine registers
all of them at start (``--lora-modules``), with ``max_loras`` step slots and ``max_cpu_loras``
adapters in host memory: fewer than the adapters, so placement decides how often an engine
must read an adapter again and how long a request waits for a step slot (vLLM's
``curr_loras`` rule). The base model is a random Llama built here (the embedded model's
tokenizer; ``--hidden-size`` / ``--num-layers``) unless ``--model`` names one.

The workload: each adapter has its own system prompt, shared by its requests, which add a
unique question; adapters are drawn with Zipf popularity (adapter i with weight
``1 / (i + 1) ** zipf_s``: a few hot adapters and a tail, as pools of fine-tunes see), and
requests arrive as a Poisson process. Every policy gets the same requests at the same times,
on fresh engines (cold caches, every adapter registered and nothing else run but one base
warm-up request each), through an in-process router.

Reported per policy: TTFT p50/p90/p99, output tokens/s, the cache hit rate the engines
reported, and adapter loads per request from the engines' own counters
(``quire:lora_adapter_loads`` reads from the adapter's path, ``quire:lora_slot_loads``
writes into a step slot); then the first policy against each other one as ratios.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import random
import shutil
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from quire.config_args import add_dataclass_args, dataclass_from_namespace, require_at_least
from quire_cli.bench.harness import (FIRST_SAFE_TOKEN_ID, RequestResult, describe_ms,
                                     machine_info, running_router, stream_request, warm_up)
from quire_cli.bench.report import write_json

LORA_COUNTERS = {"adapter_loads": "quire:lora_adapter_loads_total",
                 "slot_loads": "quire:lora_slot_loads_total"}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


@dataclass(frozen=True, slots=True)
class LoRARouterBenchConfig:
    model: str | None = None  # a model directory (None: a random Llama built here)
    hidden_size: int = 256  # the random Llama's
    num_layers: int = 4
    num_adapters: int = 8
    lora_rank: int = 16
    num_engines: int = 2
    max_loras: int = 2
    max_cpu_loras: int = 3
    num_requests: int = 96
    request_rate: float = 6.0  # requests/s (Poisson)
    system_prompt_len: int = 96
    question_len: int = 32
    output_len: int = 32
    zipf_s: float = 1.0
    policies: str = "prefix_aware,round_robin"
    flow_control: bool = True  # the router's (its default)
    seed: int = 0
    kv_cache_memory_bytes: int = 256 << 20  # per engine
    startup_timeout_s: float = 300.0
    request_timeout_s: float = 600.0
    output_json: str = "bench_results/lora_router.json"

    def __post_init__(self) -> None:
        require_at_least(self, ("hidden_size", "num_layers", "num_adapters", "lora_rank",
                                "num_engines", "max_loras", "max_cpu_loras", "num_requests",
                                "system_prompt_len", "question_len", "output_len"))
        if self.request_rate <= 0:
            raise ValueError(f"request_rate: must be > 0 (inf: all at once), got "
                             f"{self.request_rate}")
        if self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras: must be >= max_loras ({self.max_loras}), got "
                             f"{self.max_cpu_loras}")
        from router.balancer import POLICIES

        unknown = sorted(set(self.policy_names) - set(POLICIES))
        if unknown or not self.policy_names:
            raise ValueError(f"policies: each one of {sorted(POLICIES)}, got {self.policies!r}")

    @property
    def policy_names(self) -> tuple[str, ...]:
        return tuple(p.strip() for p in self.policies.split(",") if p.strip())


HELP = {
    "model": "base model directory (default: a random Llama built here with the embedded "
             "model's tokenizer)",
    "hidden_size": "the random Llama's hidden size",
    "num_layers": "the random Llama's layers",
    "max_loras": "engines' step slots for adapters (vLLM's max_loras)",
    "max_cpu_loras": "engines' adapters kept in host memory (fewer than num_adapters: reads)",
    "zipf_s": "adapter popularity: adapter i drawn with weight 1 / (i + 1) ** zipf_s",
    "policies": "comma-separated router policies, each on fresh engines (ratios: the first "
                "against each other)",
    "kv_cache_memory_bytes": "each engine's KV cache",
}


def add_lora_router_args(parser: argparse.ArgumentParser) -> None:
    add_dataclass_args(parser, LoRARouterBenchConfig, "benchmark", HELP)


# ------------------------------------------------------------------------ model and adapters
def build_random_llama(out_dir: Path, tokenizer_dir: Path, *, hidden_size: int,
                       num_layers: int, seed: int) -> Path:
    """A random Llama (GQA, tied embeddings) with the tokenizer and vocabulary of the model
    in ``tokenizer_dir``."""
    import torch
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=json.loads((tokenizer_dir / "config.json").read_text())["vocab_size"],
        hidden_size=hidden_size, intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=2048, tie_word_embeddings=True, bos_token_id=1,
        eos_token_id=2, pad_token_id=2)
    torch.manual_seed(seed)
    transformers.LlamaForCausalLM(config).save_pretrained(out_dir)
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).is_file():
            shutil.copy(tokenizer_dir / name, out_dir / name)
    return out_dir


def make_adapters(base_dir: Path, out_dir: Path, names: list[str], rank: int,
                  seed: int) -> dict[str, str]:
    """One PEFT adapter per name on every attention and MLP projection, with random non-zero
    ``lora_B`` (PEFT's ``init_lora_weights=False``, scaled up so each changes the output)."""
    import torch
    import transformers
    from peft import LoraConfig, get_peft_model

    paths = {}
    base = transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    for i, name in enumerate(names):
        torch.manual_seed(seed + i)
        model = get_peft_model(base, LoraConfig(
            r=rank, lora_alpha=2 * rank, init_lora_weights=False,
            target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                            "down_proj"]))
        with torch.no_grad():
            for param_name, param in model.named_parameters():
                if "lora_B" in param_name:
                    param.normal_(0.0, 0.02)
        model.save_pretrained(out_dir / name)
        base = model.unload()  # the base model without this adapter, for the next one
        paths[name] = str(out_dir / name)
    return paths


# ------------------------------------------------------------------------------- workload
@dataclass(frozen=True, slots=True)
class LoRARequest:
    lora_name: str
    token_ids: tuple[int, ...]
    offset_s: float  # when it is sent, after the run starts


def make_workload(cfg: LoRARouterBenchConfig, names: list[str], vocab_size: int
                  ) -> list[LoRARequest]:
    """Per-adapter system prompts, Zipf-popular adapters, Poisson arrivals (seeded)."""
    rng = random.Random(f"{cfg.seed}-lora-router")

    def draw(n: int) -> list[int]:
        return [rng.randrange(FIRST_SAFE_TOKEN_ID, vocab_size - FIRST_SAFE_TOKEN_ID)
                for _ in range(n)]

    systems = {name: draw(cfg.system_prompt_len) for name in names}
    weights = [1.0 / (i + 1) ** cfg.zipf_s for i in range(len(names))]
    requests, t = [], 0.0
    for i in range(cfg.num_requests):
        if i and cfg.request_rate != float("inf"):
            t += rng.expovariate(cfg.request_rate)
        name = rng.choices(names, weights)[0]
        requests.append(LoRARequest(name, tuple(systems[name] + draw(cfg.question_len)), t))
    return requests


# ------------------------------------------------------------------------------------ runs
def read_counters(metrics_url: str) -> dict[str, float]:
    """The engine's LoRA load counters (``LORA_COUNTERS``) from its Prometheus text."""
    with urllib.request.urlopen(metrics_url, timeout=30) as response:
        text = response.read().decode()
    values = dict.fromkeys(LORA_COUNTERS, 0.0)
    for line in text.splitlines():
        for key, name in LORA_COUNTERS.items():
            if line.startswith(name + "{") or line.startswith(name + " "):
                values[key] += float(line.rsplit(" ", 1)[1])
    return values


async def _drive(port: int, workload: list[LoRARequest], cfg: LoRARouterBenchConfig,
                 tag: str) -> tuple[list[RequestResult], float]:
    import grpc

    from quire.v1 import engine_pb2 as pb
    from quire.v1 import engine_pb2_grpc

    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = engine_pb2_grpc.EngineServiceStub(channel)
        t0 = time.perf_counter()

        async def one(i: int, request: LoRARequest) -> RequestResult:
            await asyncio.sleep(max(0.0, t0 + request.offset_s - time.perf_counter()))
            message = pb.GenerateRequest(
                request_id=f"{tag}-{i}", token_ids=pb.TokenIds(ids=request.token_ids),
                lora_name=request.lora_name, sampling=pb.SamplingOptions(
                    temperature=0, max_tokens=cfg.output_len, ignore_eos=True))
            return await stream_request(stub, message, t0=t0, timeout_s=cfg.request_timeout_s)

        results = await asyncio.gather(*(one(i, r) for i, r in enumerate(workload)))
        return list(results), time.perf_counter() - t0


async def measure(policy: str, engines, workload: list[LoRARequest],
                  cfg: LoRARouterBenchConfig) -> dict:
    """One policy's run on ``engines`` (fresh, warmed up)."""
    addresses = [e.address for e in engines]
    before = [read_counters(e.metrics_url) for e in engines]
    async with running_router(addresses, policy, cfg.startup_timeout_s,
                              flow={"flow_control": cfg.flow_control}) as router:
        router.metrics.decisions.capacity = max(router.metrics.decisions.capacity,
                                                4 * len(workload))
        results, duration_s = await _drive(router.port, workload, cfg, policy)
    after = [read_counters(e.metrics_url) for e in engines]
    ok = [r for r in results if r.ok]
    loads = {key: sum(a[key] - b[key] for a, b in zip(after, before)) for key in LORA_COUNTERS}
    prompt_tokens = sum(r.prompt_tokens for r in ok)
    per_engine = {f"engine-{i}": sorted({w.lora_name for w, r in zip(workload, results)
                                         if r.ok and r.engine_id == address})
                  for i, address in enumerate(addresses)}
    return {
        "policy": policy, "num_requests": len(results), "num_finished": len(ok),
        "errors": sorted({r.error or "unfinished" for r in results if not r.ok})[:5],
        "duration_s": duration_s,
        "output_token_throughput": sum(r.num_output_tokens for r in ok) / duration_s,
        "request_throughput": len(ok) / duration_s,
        "ttft_ms": describe_ms([r.ttft_s for r in ok]),
        "e2e_ms": describe_ms([r.e2e_s for r in ok]),
        "cache_hit_rate": (sum(r.cached_tokens for r in ok) / prompt_tokens
                           if prompt_tokens else 0.0),
        "adapter_loads_per_request": loads["adapter_loads"] / max(len(ok), 1),
        "slot_loads_per_request": loads["slot_loads"] / max(len(ok), 1),
        "adapters_per_engine": per_engine,
        "requests_per_engine": {f"engine-{i}": sum(r.engine_id == a for r in ok)
                                for i, a in enumerate(addresses)},
        "requests": [{"lora_name": w.lora_name, "sent_s": r.sent_s,
                      "engine": (f"engine-{addresses.index(r.engine_id)}"
                                 if r.engine_id in addresses else None),
                      "ttft_s": r.ttft_s if r.chunks else None, "e2e_s": r.e2e_s,
                      "cached_tokens": r.cached_tokens, "error": r.error}
                     for w, r in zip(workload, results)],
    }


def _engine_flags(cfg: LoRARouterBenchConfig, model_dir: Path,
                  adapters: dict[str, str]) -> list[str]:
    return ["--model", str(model_dir), "--dtype", "float32", "--seed", str(cfg.seed),
            "--enable-lora", "true", "--max-loras", str(cfg.max_loras),
            "--max-cpu-loras", str(cfg.max_cpu_loras), "--max-lora-rank", str(cfg.lora_rank),
            "--kv-cache-memory-bytes", str(cfg.kv_cache_memory_bytes),
            "--lora-modules", ",".join(f"{n}={p}" for n, p in adapters.items())]


async def run_policies(cfg: LoRARouterBenchConfig, model_dir: Path, adapters: dict[str, str],
                       workload: list[LoRARequest]) -> list[dict]:
    from quire_cli.stack import StackConfig, start_engines, stop_engines

    runs = []
    flags = _engine_flags(cfg, model_dir, adapters)
    for policy in cfg.policy_names:
        engines = await asyncio.to_thread(start_engines, StackConfig(
            num_engines=cfg.num_engines, startup_timeout_s=cfg.startup_timeout_s), flags)
        try:
            await warm_up([e.address for e in engines], cfg.system_prompt_len, 2,
                          cfg.request_timeout_s)
            load_1m = os.getloadavg()[0]
            run = await measure(policy, engines, workload, cfg)
        finally:
            await asyncio.to_thread(stop_engines, engines)
        runs.append(dict(run, load_average_1m_before=load_1m,
                         load_average_1m_after=os.getloadavg()[0]))
        print(f"  {policy:<14} {run['num_finished']}/{run['num_requests']} in "
              f"{run['duration_s']:.1f}s  TTFT p50 {run['ttft_ms']['p50']:.0f} ms  p90 "
              f"{run['ttft_ms']['p90']:.0f} ms  {run['output_token_throughput']:.1f} tok/s  "
              f"loads/req {run['adapter_loads_per_request']:.2f} (slots "
              f"{run['slot_loads_per_request']:.2f})  load avg {load_1m:.1f}", flush=True)
    return runs


def ratios(first: dict, other: dict) -> dict:
    """``first`` over ``other``: below 1 is better for times and loads, above 1 for
    throughput."""
    def ratio(a, b):
        return a / b if a is not None and b else None

    return {"vs": other["policy"],
            "ttft_p50": ratio(first["ttft_ms"]["p50"], other["ttft_ms"]["p50"]),
            "ttft_p90": ratio(first["ttft_ms"]["p90"], other["ttft_ms"]["p90"]),
            "output_token_throughput": ratio(first["output_token_throughput"],
                                             other["output_token_throughput"]),
            "adapter_loads_per_request": ratio(first["adapter_loads_per_request"],
                                               other["adapter_loads_per_request"]),
            "slot_loads_per_request": ratio(first["slot_loads_per_request"],
                                            other["slot_loads_per_request"])}


def run_from_args(ns: argparse.Namespace) -> int:
    from quire_cli.stack import resolve_model_once

    cfg = dataclass_from_namespace(LoRARouterBenchConfig, ns)
    names = [f"adapter-{i}" for i in range(cfg.num_adapters)]
    machine = machine_info()
    with tempfile.TemporaryDirectory(prefix="quire-bench-lora-router-") as root:
        if cfg.model:
            model_dir = resolve_model_once(cfg.model)
        else:
            model_dir = build_random_llama(Path(root) / "model", resolve_model_once(None),
                                           hidden_size=cfg.hidden_size,
                                           num_layers=cfg.num_layers, seed=cfg.seed)
        adapters = make_adapters(model_dir, Path(root) / "adapters", names, cfg.lora_rank,
                                 cfg.seed)
        vocab_size = json.loads((model_dir / "config.json").read_text())["vocab_size"]
        workload = make_workload(cfg, names, vocab_size)
        print(f"bench lora-router: {cfg.num_requests} requests at {cfg.request_rate} req/s "
              f"over {cfg.num_adapters} adapters (rank {cfg.lora_rank}), {cfg.num_engines} "
              f"engines with max_loras {cfg.max_loras}, max_cpu_loras {cfg.max_cpu_loras}",
              flush=True)
        runs = asyncio.run(run_policies(cfg, model_dir, adapters, workload))
    report = {"config": dataclasses.asdict(cfg), "machine": machine,
              "adapter_share": {n: sum(r.lora_name == n for r in workload) / len(workload)
                                for n in names},
              "runs": runs, "ratios": [ratios(runs[0], other) for other in runs[1:]],
              "load_average_after": os.getloadavg()}
    for r in report["ratios"]:
        print(f"{runs[0]['policy']} / {r['vs']}: TTFT p50 {r['ttft_p50']:.2f}x, p90 "
              f"{r['ttft_p90']:.2f}x, output tok/s {r['output_token_throughput']:.2f}x, "
              f"adapter loads/request {_fmt(r['adapter_loads_per_request'])}, slot "
              f"loads/request {_fmt(r['slot_loads_per_request'])}")
    print(f"report: {write_json(report, cfg.output_json)}")
    return 0


def _fmt(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}x"
