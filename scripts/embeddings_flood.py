"""A light tenant's completions while a heavy tenant's /v1/embeddings request runs (issue #30's
flow control, applied to embeddings). Not a benchmark command: a measurement script.

Starts `quire up --num-engines 1 --tenant-header x-tenant-id --flow-control <on|off>`, times 5
idle 2-token completions of the light tenant, then sends the heavy tenant's request (128 inputs
of 2,000 random token ids, seed 7) and, while it runs, one light completion every 3 s. Prints
and writes JSON: the light latencies during the flood, their p50 / p90 / max, and the flood's
own status and seconds.

    python scripts/embeddings_flood.py on  --port 8400 --out flood-on.json
    python scripts/embeddings_flood.py off --port 8400 --out flood-off.json
    python scripts/embeddings_flood.py on --up-arg=--long-prefill-token-threshold=256 ...

``--up-arg`` (repeatable) passes a flag to `quire up` (an engine flag under test).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("flow_control", choices=["on", "off"])
    parser.add_argument("--port", type=int, default=8400)
    parser.add_argument("--inputs", type=int, default=128)
    parser.add_argument("--input-tokens", type=int, default=2000)
    parser.add_argument("--out", default=None)
    parser.add_argument("--up-arg", action="append", default=[],
                        help="a flag for quire up (--up-arg=--long-prefill-token-threshold=256)")
    args = parser.parse_args()
    base = f"http://127.0.0.1:{args.port}"
    log = open(f"embeddings-flood-{args.flow_control}.log", "w")
    quire = Path(sys.executable).with_name("quire")
    proc = subprocess.Popen(
        [str(quire), "up", "--num-engines", "1", "--router-port", str(args.port + 1),
         "--http-port", str(args.port), "--tenant-header", "x-tenant-id",
         "--flow-control", "true" if args.flow_control == "on" else "false", *args.up_arg],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True, cwd=ROOT)

    def post(path: str, body: dict, tenant: str) -> tuple[int, float]:
        request = urllib.request.Request(base + path, json.dumps(body).encode(), {
            "Content-Type": "application/json", "x-tenant-id": tenant})
        started = time.perf_counter()
        try:
            with urllib.request.urlopen(request, timeout=600) as response:
                response.read()
                status = response.status
        except urllib.error.HTTPError as e:
            status = e.code
        return status, time.perf_counter() - started

    try:
        model = None
        for _ in range(240):  # the router lists the engines' model once one has joined
            try:
                with urllib.request.urlopen(base + "/v1/models", timeout=2) as response:
                    model = json.loads(response.read())["data"][0]["id"]
                break
            except (OSError, ValueError, KeyError, IndexError):
                time.sleep(1)
        light = {"model": model, "prompt": "The capital of France is", "max_tokens": 2}
        idle = [post("/v1/completions", light, "light")[1] for _ in range(6)][1:]
        rng = random.Random(7)
        heavy = {"model": model, "input": [[rng.randrange(100, 49000)
                                            for _ in range(args.input_tokens)]
                                           for _ in range(args.inputs)]}
        flood: dict = {}
        thread = threading.Thread(target=lambda: flood.update(
            result=post("/v1/embeddings", heavy, "heavy")))
        thread.start()
        time.sleep(1.0)
        during = []
        while thread.is_alive():
            during.append(post("/v1/completions", light, "light"))
            time.sleep(3.0)
        thread.join()
        seconds = sorted(s for _, s in during)
        result = {"flow_control": args.flow_control, "up_args": args.up_arg, "idle_s": idle,
                  "flood": {"status": flood["result"][0], "seconds": flood["result"][1]},
                  "light_during": during,
                  "light_p50_s": seconds[len(seconds) // 2],
                  "light_p90_s": seconds[min(len(seconds) - 1, int(0.9 * len(seconds)))],
                  "light_max_s": seconds[-1]}
        print(json.dumps(result))
        if args.out:
            Path(args.out).write_text(json.dumps(result, indent=1))
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(30)


if __name__ == "__main__":
    main()
