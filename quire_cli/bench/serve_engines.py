"""The engines ``quire bench serve`` routes to, one class per engine kind (``ENGINE_KINDS``).

Each is a context manager over the whole benchmark whose ``fresh()`` gives the engines of one
run, cold and warmed up, as ``RunEngines``:

- ``quire``: fresh ``quire engine`` processes for every run (a cold cache is a new process).
- ``vllm``: vLLM servers started once (vLLM's first start compiles for minutes) or already
  running (``--engines vllm://...``); before every run each gets one warm-up request, then its
  prefix cache is emptied with vLLM's ``POST /reset_prefix_cache``, which vLLM serves only in
  dev mode (``VLLM_SERVER_DEV_MODE=1``: the servers the bench starts have it; running ones
  must). vLLM's own prefix-cache counters are read around each run.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import tempfile
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from quire_cli.bench.harness import (FIRST_SAFE_TOKEN_ID, EngineControl, engine_processes,
                                     model_info, warm_up)
from quire_cli.bench.serve_config import ServeBenchConfig

# vLLM's counters of prompt tokens looked up in its prefix cache, and of those found there
VLLM_QUERIES, VLLM_HITS = "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total"


@dataclass(frozen=True, slots=True)
class RunEngines:
    """The engines of one run, as the router and the report name them."""

    urls: tuple[str, ...]  # the router's engine list entries
    engine_ids: tuple[str, ...]  # the ids the router reports (its initial metadata)
    max_model_len: int
    vocab_size: int
    router_options: dict = field(default_factory=dict)  # tokenizer, placement
    control: EngineControl | None = None  # kill / restart an engine (Quire engines only)


class QuireEngines:
    """Fresh ``quire engine`` processes per run; ``flags`` are their changed engine flags."""

    kind = "quire"

    def __init__(self, cfg: ServeBenchConfig, flags: list[str], model_dir: Path) -> None:
        self.cfg = cfg
        self.flags = flags

    def __enter__(self) -> QuireEngines:
        return self

    def __exit__(self, *exc) -> None:
        return None

    @contextlib.asynccontextmanager
    async def fresh(self) -> AsyncIterator[RunEngines]:
        cfg = self.cfg
        with engine_processes(cfg.num_engines, self.flags, cfg.startup_timeout_s) as control:
            addresses = [engine.address for engine in control.engines]
            info = await model_info(addresses[0])
            await warm_up(addresses, cfg.prompt_len, 2, cfg.request_timeout_s)
            yield RunEngines(tuple(addresses), tuple(addresses), info.max_model_len,
                             info.vocab_size, control=control)

    async def cache_counters(self) -> dict[str, dict[str, float]] | None:
        return None  # a Quire engine's hits are the usage's cached tokens, already counted

    def describe(self) -> dict:
        return {"kind": self.kind}


# Engine flags a vLLM server is started with (the rest are Quire's own and refused).
VLLM_ENGINE_FLAGS = ("model", "tokenizer", "dtype", "max_model_len", "seed")


class VllmEngines:
    """vLLM servers: started here (``cfg.vllm_python``) or already running (``cfg.engines``)."""

    kind = "vllm"

    def __init__(self, cfg: ServeBenchConfig, flags: list[str], model_dir: Path) -> None:
        changed = {f[2:].replace("-", "_") for f in flags[::2]}
        unknown = sorted(changed - set(VLLM_ENGINE_FLAGS))
        if unknown:
            raise ValueError(f"engine_kind: vllm takes only the engine flags "
                             f"{', '.join(VLLM_ENGINE_FLAGS)}; got {unknown}")
        self.cfg = cfg
        self.model_dir = model_dir
        values = dict(zip((f[2:].replace("-", "_") for f in flags[::2]), flags[1::2]))
        self.dtype = values.get("dtype", "auto")
        self.max_model_len = int(values.get("max_model_len", 2048))
        self.seed = int(values.get("seed", 0))
        self.tokenizer = values.get("tokenizer") or str(model_dir)  # the router's
        self.servers: list = []
        self.urls: tuple[str, ...] = cfg.engine_urls
        self._workdir: tempfile.TemporaryDirectory | None = None

    def __enter__(self) -> VllmEngines:
        if self.urls:
            return self
        from quire_cli.bench.vllm_server import VllmServerSpec, start_servers

        cfg = self.cfg
        # vLLM's "auto" takes the checkpoint's dtype: bf16 for SmolLM2, emulated (and far
        # slower) on CPUs without AVX-512 BF16
        spec = VllmServerSpec(python=cfg.vllm_python, model_dir=self.model_dir,
                              served_model_name=self.model_dir.name,
                              dtype="float32" if self.dtype == "auto" else self.dtype,
                              max_model_len=self.max_model_len,
                              block_size=cfg.vllm_block_size, num_kv_blocks=cfg.vllm_kv_blocks,
                              dev_mode=True, seed=self.seed)
        self._workdir = tempfile.TemporaryDirectory(prefix="quire-bench-vllm-")
        print(f"starting {cfg.num_engines} vLLM servers (the first start compiles for "
              f"minutes; logs in {self._workdir.name})", flush=True)
        self.servers = start_servers([spec] * cfg.num_engines, Path(self._workdir.name),
                                     timeout_s=cfg.startup_timeout_s)
        self.urls = tuple(s.url for s in self.servers)
        return self

    def __exit__(self, *exc) -> None:
        for server in self.servers:
            server.kill()
        if self._workdir is not None:
            self._workdir.cleanup()

    def describe(self) -> dict:
        """What the report keeps: the kind, vLLM's version (its /version), how it was run."""
        from quire_cli.bench.vllm_server import get_json

        return {"kind": self.kind, "started_here": bool(self.servers),
                "vllm_version": get_json(f"http://{self.addresses[0]}/version").get("version"),
                "dtype": self.servers[0].spec.dtype if self.servers else None,
                "num_kv_blocks": self.cfg.vllm_kv_blocks or None,
                "block_size": self.cfg.vllm_block_size, "urls": list(self.urls)}

    @property
    def addresses(self) -> tuple[str, ...]:
        from router.endpoint import parse_engine

        return tuple(parse_engine(url).address for url in self.urls)

    @contextlib.asynccontextmanager
    async def fresh(self) -> AsyncIterator[RunEngines]:
        from quire_cli.bench.vllm_server import completion, reset_prefix_cache, served_model

        cfg, addresses = self.cfg, self.addresses
        models = await asyncio.gather(*(asyncio.to_thread(served_model, a) for a in addresses))
        prompt = [FIRST_SAFE_TOKEN_ID - 1 - i % 500 for i in range(cfg.prompt_len)]
        await asyncio.gather(*(asyncio.to_thread(completion, a, m["id"], prompt, 2,
                                                 timeout_s=cfg.request_timeout_s)
                               for a, m in zip(addresses, models)))
        await asyncio.gather(*(asyncio.to_thread(reset_prefix_cache, a) for a in addresses))
        # vLLM publishes the reset's AllBlocksCleared with its next scheduler step, so one
        # token more (no full block: nothing cached) sends it before the router replays the
        # history; without it the router would start from the last run's blocks.
        await asyncio.gather(*(asyncio.to_thread(completion, a, m["id"], prompt[:1], 1)
                               for a, m in zip(addresses, models)))
        options = {"tokenizer": self.tokenizer,
                   "placement": {"vllm_block_size": cfg.vllm_block_size}}
        yield RunEngines(self.urls, addresses, min(m["max_model_len"] for m in models),
                         _vocab_size(self.model_dir), options)

    async def cache_counters(self) -> dict[str, dict[str, float]]:
        """vLLM's own prefix-cache counters per engine address (cumulative)."""
        from quire_cli.bench.vllm_server import metric_value, read_metrics

        texts = await asyncio.gather(*(asyncio.to_thread(read_metrics, a)
                                       for a in self.addresses))
        return {a: {"queries": metric_value(t, VLLM_QUERIES), "hits": metric_value(t, VLLM_HITS)}
                for a, t in zip(self.addresses, texts)}


def _vocab_size(model_dir: Path) -> int:
    """From the checkpoint's config.json (vLLM's API does not report it)."""
    config = json.loads((model_dir / "config.json").read_text())
    return int(config.get("text_config", config)["vocab_size"])


def counter_deltas(before: dict[str, dict[str, float]] | None,
                   after: dict[str, dict[str, float]] | None,
                   engine_ids: Sequence[str]) -> dict | None:
    """The engines' own cache counters over one run: per engine and in all, with the hit rate
    (hits / queries, in prompt tokens)."""
    if before is None or after is None:
        return None
    per_engine = {}
    for i, engine_id in enumerate(engine_ids):
        queries = after[engine_id]["queries"] - before[engine_id]["queries"]
        hits = after[engine_id]["hits"] - before[engine_id]["hits"]
        per_engine[f"engine-{i}"] = {"queries": queries, "hits": hits}
    queries = sum(e["queries"] for e in per_engine.values())
    hits = sum(e["hits"] for e in per_engine.values())
    return {"queries": queries, "hits": hits, "hit_rate": hits / queries if queries else 0.0,
            "per_engine": per_engine}


ENGINE_KINDS = {"quire": QuireEngines, "vllm": VllmEngines}
