"""``quire engine``: serve one engine over gRPC (quire.v1.EngineService)."""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from engine_worker.arg_utils import add_server_engine_args
    from engine_worker.server.config import ServerConfig
    from quire.config_args import add_dataclass_args

    add_dataclass_args(parser, ServerConfig, "server")
    add_server_engine_args(parser)


def main(ns: argparse.Namespace) -> int:
    import asyncio
    import logging
    import os

    from engine_worker.server.app import serve
    from engine_worker.server.config import ServerConfig
    from engine_worker.server.model_thread import ModelThread
    from engine_worker.server.threads import ThreadPlan
    from quire.config_args import dataclass_from_namespace
    from quire.ports import check_ports_free
    from quire_cli.offline import build_engine

    cfg = dataclass_from_namespace(ServerConfig, ns)
    # before the model loads: a busy port is one line now, not a traceback minutes later
    check_ports_free([(cfg.host, cfg.port, "port"), (cfg.host, cfg.metrics_port, "metrics_port")])
    plan = ThreadPlan(cfg.omp_wait_policy)
    os.environ.update(plan.environment())  # libgomp reads these when torch loads it, below
    # built on the thread that will step it: one OpenMP pool (server/model_thread.py)
    model_thread = ModelThread()
    engine = model_thread.submit(lambda: build_engine(ns)).result()
    import torch

    # asked on the model thread: libgomp keeps the thread count per thread, and the main
    # thread's is the machine's default, not the engine's --num-threads
    num_threads = model_thread.submit(torch.get_num_threads).result()
    logging.getLogger("engine_worker.server.threads").info(
        "Threads: %s", plan.describe(num_threads))
    try:
        asyncio.run(serve(engine, cfg, model_thread))
    finally:
        engine.shutdown()  # tensor-parallel workers stop with the engine
    return 0
