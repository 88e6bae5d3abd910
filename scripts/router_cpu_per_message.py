"""Router-process CPU time per streamed message: `quire up` (router in process) under 32 streams.

    python scripts/router_cpu_per_message.py <source tree> <free port>

Run it on two trees in turn (e.g. a worktree of an older commit and this one) to compare."""
import asyncio, json, os, subprocess, sys, time, urllib.request
import aiohttp

tree, port = sys.argv[1], int(sys.argv[2])
env = dict(os.environ, PYTHONPATH=tree)
proc = subprocess.Popen([sys.executable, "-m", "quire_cli", "up", "--num-engines", "1",
                         "--http-port", str(port), "--router-port", str(port + 1), "--once", "false",
                         "--num-threads", "1"], cwd=tree, env=env,
                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
def cpu():
    f = open(f"/proc/{proc.pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")
deadline = time.time() + 300
while True:
    try:
        m = json.load(urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=2))
        if m["data"] and m["data"][0]["id"] != "quire":
            break
    except Exception:
        pass
    if time.time() > deadline:
        sys.exit("no stack")
    time.sleep(1)
model = m["data"][0]["id"]

async def one(session, i):
    n = 0
    body = {"model": model, "prompt": f"Story number {i}: once upon a time", "max_tokens": 64,
            "ignore_eos": True, "stream": True, "temperature": 1.0, "seed": i}
    async with session.post(f"http://127.0.0.1:{port}/v1/completions", json=body) as r:
        async for line in r.content:
            if line.startswith(b"data: {"):
                n += 1
    return n

async def main():
    async with aiohttp.ClientSession() as s:
        await one(s, 0)
        c0, t0 = cpu(), time.time()
        counts = await asyncio.gather(*(one(s, i) for i in range(32)))
        c1, t1 = cpu(), time.time()
    n = sum(counts)
    print(json.dumps({"tree": tree, "messages": n, "router_cpu_s": round(c1 - c0, 3),
                      "router_cpu_ms_per_message": round(1000 * (c1 - c0) / n, 3),
                      "wall_s": round(t1 - t0, 1)}))

try:
    asyncio.run(main())
finally:
    proc.terminate(); proc.wait(30)
