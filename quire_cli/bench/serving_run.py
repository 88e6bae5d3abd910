"""One run of ``quire bench serving`` from a validated config (``serving.run_from_args``):
both servers and Quire's offline engine up, every scenario against each server in alternating
order with its offline run beside Quire's, then the report."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import resource
import sys
from pathlib import Path

from quire_cli.bench import cpu_time
from quire_cli.bench.harness import wait_until_quiet
from quire_cli.bench.report import write_json
from quire_cli.bench.serving import (SYSTEMS, Scenario, ServingBenchConfig, choose_dtypes,
                                     client_argv, cpu_slug, git_commit, scenarios, warmup)
from quire_cli.bench.serving_report import format_table, repeated_report, write_plot
from quire_cli.bench.serving_systems import (OfflineEngine, OfflineScenario, Server,
                                             quire_server, requests_digest, run_client,
                                             vllm_server)

SERVER_NOTES = {
    "quire": "quire up (router + engines) with --num-engines engines of --num-threads torch "
             "threads each; prefix caching as --enable-prefix-caching says (on by default)",
    "vllm": "vLLM's OpenAI server with its defaults for this machine: its CPU build binds its "
            "threads itself and, on a 2-core machine, reduces torch to one thread for serving "
            "('Reducing Torch threads from 2 to 1'); prefix caching on; no KV events",
}


def _quire(cfg: ServingBenchConfig, engine_args, dtypes: dict, model_dir: Path, workdir: Path):
    from quire_cli.stack import changed_engine_flags

    return quire_server(["--num-engines", str(cfg.num_engines)],
                        changed_engine_flags(engine_args), workdir, cfg.startup_timeout_s)


def _vllm(cfg: ServingBenchConfig, engine_args, dtypes: dict, model_dir: Path, workdir: Path):
    from quire_cli.bench.vllm_server import VllmServerSpec

    spec = VllmServerSpec(python=cfg.vllm_python, model_dir=model_dir,
                          served_model_name=model_dir.name, dtype=dtypes["vllm"],
                          max_model_len=cfg.vllm_max_model_len,
                          kv_cache_space_gib=cfg.vllm_kv_cache_gib, seed=engine_args.seed,
                          kv_events=False, enforce_eager=cfg.vllm_enforce_eager)
    return vllm_server(spec, workdir, cfg.startup_timeout_s)


SERVERS = {"quire": _quire, "vllm": _vllm}
OFFLINE = OfflineEngine  # (engine_args, warm-up requests, ignore_eos) -> context manager
WARMUP = "warm-up"
OFFLINE_STEP = "offline"  # the offline run's place in a scenario's order
assert tuple(SERVERS) == SYSTEMS


def _run_scenario(cfg: ServingBenchConfig, scenario: Scenario, system: str, server: Server,
                  tokenizer: str, workdir: Path, tag: str = "") -> tuple[dict, list[dict]]:
    """The client against ``server`` for one scenario -> (the run's record, the requests it
    sent). Its files are named by system and ``tag`` (default: the scenario's name)."""
    stem = f"{system}-{tag or scenario.name.replace('/', '-')}"
    result_path, requests_path = workdir / f"{stem}.json", workdir / f"{stem}-requests.json"
    argv = client_argv(cfg, scenario, base_url=server.base_url, model=server.model,
                       tokenizer=tokenizer,
                       label=system, result_path=result_path, requests_path=requests_path)
    print(f"{system}: {tag or scenario.name}", file=sys.stderr, flush=True)
    # the other server (or this one) may still be busy from the run before: each run starts
    # on a quiet machine
    quiet = wait_until_quiet(timeout_s=cfg.quiet_timeout_s)
    before = os.getloadavg()
    cpu_before = cpu_time.snapshot(server.pid) if server.pid else None
    client_before = resource.getrusage(resource.RUSAGE_CHILDREN)
    run_client(cfg.vllm_python, argv, workdir / f"{stem}-client.log", cfg.client_timeout_s)
    client_after = resource.getrusage(resource.RUSAGE_CHILDREN)
    server_cpu = None if cpu_before is None else \
        cpu_time.cpu_used(cpu_before, cpu_time.snapshot(server.pid), server.pid)
    after = os.getloadavg()
    requests = json.loads(requests_path.read_text())
    return ({"client_result": json.loads(result_path.read_text()), "client_argv": argv,
             "loadavg_before": list(before), "loadavg_after": list(after),
             "quiet_before": quiet, "server_cpu": server_cpu,
             # the whole client process, its start (imports, drawing the requests) included
             "client_cpu_s": round(client_after.ru_utime + client_after.ru_stime
                                   - client_before.ru_utime - client_before.ru_stime, 2),
             "requests_sha256": requests_digest(requests)}, requests)


def _run_key(scenario: Scenario, repeat: int, repeats: int) -> str:
    """A run's name: the scenario's, with the repeat's number when there are several."""
    return scenario.name if repeats == 1 else f"{scenario.name}#{repeat + 1}"


def _keyed_runs(cfg: ServingBenchConfig) -> list[tuple[Scenario, int, str]]:
    """(scenario, repeat, run key) of every run, in the order they ran."""
    return [(scenario, repeat, _run_key(scenario, repeat, cfg.repeats))
            for repeat in range(cfg.repeats) for scenario in scenarios(cfg, repeat)]


def report_entries(cfg: ServingBenchConfig, runs: dict[str, list[dict]],
                   offline: dict[str, dict]) -> tuple[list[dict], dict[str, bool]]:
    """The report's scenario entries (``repeated_report``: medians over the repeats) and, by
    run key, whether every system got the same requests."""
    entries = [repeated_report(s.name, runs[s.name],
                               [offline.get(_run_key(s, r, cfg.repeats))
                                for r in range(cfg.repeats)])
               for s in scenarios(cfg)]
    same = {key: len({r["requests_sha256"] for r in runs[s.name][repeat].values()}) == 1
            for s, repeat, key in _keyed_runs(cfg)}
    return entries, same


def _run_order(systems: tuple[str, ...], first_index: int, offline: bool) -> list[str]:
    """Who runs a scenario, in order: the systems, the first alternating with ``first_index``
    (ABBA), and the offline run right after Quire's serving run (it replays the requests the
    client sent there), so that the two figures of serving / offline are neighbours in
    time."""
    order = list(systems if first_index % 2 == 0 else systems[::-1])
    if offline:
        order.insert(order.index("quire") + 1, OFFLINE_STEP)
    return order


def _run_offline(engine, cfg: ServingBenchConfig, scenario: Scenario, key: str,
                 requests: list[dict]) -> dict:
    """The requests Quire's server got in this run, through the offline engine."""
    print(f"quire offline: {key}", file=sys.stderr, flush=True)
    quiet = wait_until_quiet(timeout_s=cfg.quiet_timeout_s)
    return {**engine.run(OfflineScenario(key, requests, scenario.temperature,
                                         cfg.num_warmups)), "quiet_before": quiet}


def _serve_all(cfg: ServingBenchConfig, engine_args, dtypes: dict, model_dir: Path,
               workdir: Path):
    """Every system's server up at once (the idle one waits on its socket), and Quire's
    offline engine unless ``skip_offline``; then each scenario against each system back to
    back, which one goes first alternating (ABBA) between scenarios and between a scenario's
    repeats, with its offline run next to Quire's (``_run_order``): the machines here run in
    fast and slow phases of minutes, and one server's whole run after the other's (or the
    offline leg after all the serving) let a phase fall on one side only. ``cfg.repeats``
    times the whole plan, each time on fresh seeds -> (runs by scenario: one {system: run} a
    repeat, the first system's requests by run key, server info by system, offline results
    by run key)."""
    runs: dict[str, list[dict]] = {s.name: [] for s in scenarios(cfg)}
    requests: dict[str, list[dict]] = {}
    servers: dict[str, dict] = {}
    offline: dict[str, dict] = {}
    systems = SYSTEMS[:1] if cfg.skip_vllm else SYSTEMS
    with contextlib.ExitStack() as stack:
        live: dict[str, Server] = {}
        for system in systems:
            print(f"starting {system} (logs in {workdir})", file=sys.stderr, flush=True)
            live[system] = stack.enter_context(
                SERVERS[system](cfg, engine_args, dtypes, model_dir, workdir))
            servers[system] = {**live[system].info, "note": SERVER_NOTES[system]}
        warm_cfg, warm = warmup(cfg)
        for system in systems:
            _, sent = _run_scenario(warm_cfg, warm, system, live[system], str(model_dir),
                                    workdir, WARMUP)
            requests.setdefault(WARMUP, sent)
        engine = None
        if not cfg.skip_offline:
            print("starting quire offline (LLM)", file=sys.stderr, flush=True)
            engine = stack.enter_context(OFFLINE(engine_args, requests[WARMUP],
                                                 cfg.ignore_eos))
        for repeat in range(cfg.repeats):
            for i, scenario in enumerate(scenarios(cfg, repeat)):
                key = _run_key(scenario, repeat, cfg.repeats)
                by_system: dict[str, dict] = {}
                for position, system in enumerate(_run_order(systems, i + repeat,
                                                             engine is not None)):
                    if system == OFFLINE_STEP:
                        offline[key] = _run_offline(engine, cfg, scenario, key, requests[key])
                        continue
                    run, sent = _run_scenario(cfg, scenario, system, live[system],
                                              str(model_dir), workdir,
                                              key.replace("/", "-").replace("#", "-run"))
                    by_system[system] = {**run, "ran_first": position == 0}
                    requests.setdefault(key, sent)
                runs[scenario.name].append({system: by_system[system] for system in systems})
    return runs, requests, servers, offline


def run(cfg: ServingBenchConfig, engine_args) -> int:
    from engine_worker.weights.resolve import resolve_model_dir
    from quire_cli.bench.compare import cpu_facts

    env = cpu_facts()
    dtypes, why = choose_dtypes(cfg.dtypes, env["kernel_variant_for_this_cpu"])
    engine_args = dataclasses.replace(engine_args, dtype=dtypes["quire"])
    model_dir = resolve_model_dir(engine_args.model)
    out = Path(cfg.out or f"bench_results/serving-{cpu_slug(env['cpu_model'])}.json")
    workdir = out.with_name(out.stem + "-logs")
    workdir.mkdir(parents=True, exist_ok=True)
    env.update(model_dir=str(model_dir), dtypes=dtypes, dtype_choice=why, git=git_commit(),
               loadavg_at_start=list(os.getloadavg()))
    runs, _, servers, offline = _serve_all(cfg, engine_args, dtypes, model_dir, workdir)
    env["loadavg_at_end"] = list(os.getloadavg())
    entries, same = report_entries(cfg, runs, offline)
    report = {"config": dataclasses.asdict(cfg), "engine": dataclasses.asdict(engine_args),
              "environment": env, "servers": servers, "same_requests": same,
              "scenarios": entries}
    print(format_table(entries))
    if not all(same.values()):
        print(f"warning: the systems got different requests: {same}", file=sys.stderr)
    print(f"wrote {write_json(report, out)}")
    plot = Path(cfg.plot) if cfg.plot else out.with_suffix(".png")
    title = (f"quire up vs vLLM's OpenAI server, vllm bench serve, {cfg.num_prompts} requests "
             f"{cfg.input_len} in / {cfg.output_len} out; {env['cpu_model']} "
             f"({env['cpu_count']} cores), {dtypes}"
             + (f"; medians of {cfg.repeats} runs" if cfg.repeats > 1 else ""))
    if write_plot(plot, entries, title):
        print(f"wrote {plot}")
    return 0
