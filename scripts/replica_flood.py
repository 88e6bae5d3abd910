"""Two router replicas over one engine (#30): a heavy tenant floods both (48 clients looping
96-token completions, half through each router, as a Service would spread them); a light
tenant sends a 2-token completion every 2 s through the first. Prints the light tenant's
latency over 60 s. Flow control on (8 slots an engine, the gradient limit off, so that only
how the replicas share the engine differs between two checkouts).

    python scripts/replica_flood.py CHECKOUT OUT_PREFIX

CHECKOUT: the source tree to run (its packages put first on PYTHONPATH, this interpreter's
site-packages after), e.g. this repository or a `git worktree` of an older commit."""
import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
import urllib.request

code = sys.argv[1]          # a checkout to run
out = sys.argv[2]
env = dict(os.environ, PYTHONPATH=code)
py = sys.executable
procs = []
def start(args, log):
    p = subprocess.Popen([py, "-m", "quire_cli", *args], env=env, cwd=code,
                         stdout=open(log, "w"), stderr=subprocess.STDOUT)
    procs.append(p)
    return p

def wait_http(port, path="/health", timeout=300):
    end = time.time() + timeout
    while time.time() < end:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=2).read()
            return
        except Exception:
            time.sleep(1)
    raise SystemExit(f"port {port} never came up")

def post(port, body, tenant, timeout=300):
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions",
                                 data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json",
                                          "x-tenant-id": tenant})
    t = time.perf_counter()
    with urllib.request.urlopen(req, timeout=timeout) as r:
        r.read()
    return time.perf_counter() - t

try:
    start(["engine", "--port", "50161", "--max-num-seqs", "8", "--num-threads", "2"],
          f"{out}-engine.log")
    time.sleep(5)
    routers = [(50171, 8171), (50172, 8172)]
    for gp, hp in routers:
        start(["router", "--engines", "127.0.0.1:50161", "--port", str(gp), "--http-port", str(hp),
               "--tenant-header", "x-tenant-id", "--flow-control", "true", "--engine-slots", "8",
               "--gradient-limit", "off"], f"{out}-router{hp}.log")
    for _, hp in routers:
        wait_http(hp)
    model = json.load(urllib.request.urlopen("http://127.0.0.1:8171/v1/models"))["data"][0]["id"]
    post(8171, {"model": model, "prompt": "warm", "max_tokens": 4}, "warm")
    stop = threading.Event()
    def heavy(port, k):
        i = 0
        while not stop.is_set():
            try:
                post(port, {"model": model, "prompt": f"Story {k}-{i}: once upon a time " * 6,
                            "max_tokens": 96, "ignore_eos": True, "temperature": 1.0}, "heavy")
            except Exception:
                time.sleep(0.5)
            i += 1
    threads = [threading.Thread(target=heavy, args=(routers[k % 2][1], k), daemon=True)
               for k in range(48)]
    for t in threads: t.start()
    time.sleep(10)  # the flood settles
    light = []
    end = time.time() + 60
    while time.time() < end:
        light.append(post(8171, {"model": model, "prompt": "Hi", "max_tokens": 2}, "light"))
        time.sleep(2)
    stop.set()
    q = statistics.quantiles(light, n=10)
    res = {"code": code, "light_n": len(light), "p50": statistics.median(light), "p90": q[8],
           "max": max(light), "light": light}
    print(json.dumps({k: v for k, v in res.items() if k != "light"}))
    json.dump(res, open(f"{out}.json", "w"), indent=1)
finally:
    for p in procs:
        p.send_signal(signal.SIGTERM)
    for p in procs:
        try: p.wait(20)
        except Exception: p.kill()
