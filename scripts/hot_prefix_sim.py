"""A model (not a measurement) of #30's hot-prefix workload: which placement rule could give a
lower TTFT p90 than least_loaded on two like engines?

The workload is `quire bench serve --workloads hot_prefix`'s: Poisson arrivals, 80 % of the
requests share one 512-token system prompt and add 32 tokens of their own, the rest are cold
544-token prompts, 16 output tokens each. Each engine is modelled as the engine's step loop:
a step runs every running sequence's decode and the waiting prompts' prefills (short prompts
first: a prompt that would more than double its step waits one step, once), and lasts
``BASE_S + PREFILL_S_PER_TOKEN * prefill tokens + DECODE_S_PER_SEQ * decodes``. A prompt's
first token comes at the end of its prefill's step. The constants are fitted by hand to the
Zen 5 runs of 2026-11-30 at 12 requests/s (least_loaded TTFT p90 497-611 ms there, this model
about 540 ms); they are not measured per step.

The rules, each a pure function of the engines' state when a request arrives:

- ``least_loaded``: fewest uncached prompt tokens in flight (the router's own count);
- ``prefix_aware``: decode step + (tokens in flight + own uncached tokens) / prefill rate, the
  decode step being each engine's decayed mean time per streamed token, as the router measures
  it (stalls behind other prompts' prefills included);
- ``prefix_aware_exact_step``: the same with no decode-step term;
- ``prefix_affinity``: most cached tokens, least_loaded's load breaking ties;
- ``oracle``: the engine that gives this request its first token soonest, found by running
  each engine's exact future steps forward (it knows what no router can);
- ``cold_packing``: cold prompts join an engine that already has cold work while its queue is
  under 0.2 s, so the other stays free for hot requests (a hand threshold, for comparison).

Run: ``python scripts/hot_prefix_sim.py --seeds 30 --rate 12``. It prints each rule's median
TTFT p90 over the seeds, on how many seeds it beat least_loaded, and the quartiles of
least_loaded's p90 over its own, seed by seed (above 1: the rule is better).
"""

from __future__ import annotations

import argparse
import random
import statistics

BASE_S, PREFILL_S_PER_TOKEN, DECODE_S_PER_SEQ = 0.025, 0.0006, 0.003
OUTPUT_LEN, SYSTEM_LEN, QUESTION_LEN, HOT_SHARE = 16, 512, 32, 0.8
DECAY = 1.0 - 1.0 / 16  # the router's decayed sums (router/engine_rates.py)


def arrivals(seed: int, num_requests: int, rate: float) -> list[tuple[float, bool]]:
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(num_requests):
        t += rng.expovariate(rate)
        out.append((t, rng.random() < HOT_SHARE))
    return out


class Request:
    def __init__(self, arrival_s: float, hot: bool) -> None:
        self.arrival_s, self.hot = arrival_s, hot
        self.need = 0  # uncached prompt tokens on its engine
        self.left = OUTPUT_LEN - 1  # decode steps after the first token
        self.deferred = False
        self.first_s = 0.0


class Engine:
    def __init__(self, index: int) -> None:
        self.index = index
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        # the step running: (its end, its prefills, its decodes)
        self.step: tuple[float, list[Request], list[Request]] | None = None
        self.hot_cached = False
        self.inflight = 0  # uncached tokens sent that have no first token yet
        self.decode_num = self.decode_den = 0.0  # decayed stream seconds / tokens

    def uncached(self, request: Request) -> int:
        return QUESTION_LEN if request.hot and self.hot_cached else SYSTEM_LEN + QUESTION_LEN

    def decode_step_s(self) -> float:
        return self.decode_num / self.decode_den if self.decode_den else 0.0


def admit(waiting: list[Request], decodes: list) -> tuple[list[Request], list[Request]]:
    """Short prompts first: (this step's prefills, the prompts left waiting)."""
    chosen, kept = [], []
    for r in waiting:
        rest = len(decodes) + sum(x.need for x in waiting if x is not r and x not in kept)
        if not r.deferred and rest > 0 and r.need > rest:
            r.deferred = True
            kept.append(r)
        else:
            chosen.append(r)
    return (kept, []) if not chosen else (chosen, kept)


def step_s(prefills: list[Request], decodes: list) -> float:
    return BASE_S + PREFILL_S_PER_TOKEN * sum(r.need for r in prefills) + DECODE_S_PER_SEQ * len(
        decodes)


def start_step(engine: Engine, now: float) -> None:
    if not engine.waiting and not engine.running:
        engine.step = None
        return
    prefills, engine.waiting = admit(engine.waiting, engine.running)
    decodes = list(engine.running)
    engine.step = (now + step_s(prefills, decodes), prefills, decodes)


def first_token_s(engine: Engine, request: Request, now: float) -> float:
    """When ``request`` would get its first token on ``engine`` (no later arrivals)."""
    class Copy:
        def __init__(self, r, need, left, deferred):
            self.need, self.left, self.deferred, self.me = need, left, deferred, r is request
    waiting = [Copy(r, r.need, r.left, r.deferred) for r in engine.waiting]
    waiting.append(Copy(request, engine.uncached(request), OUTPUT_LEN - 1, False))
    running = [Copy(r, r.need, r.left, r.deferred) for r in engine.running]
    t = now
    if engine.step is not None:
        t = engine.step[0]
        running = [Copy(r, r.need, r.left - 1, r.deferred) for r in engine.step[2] if r.left > 1]
        running += [Copy(r, r.need, OUTPUT_LEN - 1, r.deferred) for r in engine.step[1]]
    while True:
        prefills, waiting = admit(waiting, running)
        t += step_s(prefills, running)
        if any(c.me for c in prefills):
            return t
        for c in running:
            c.left -= 1
        running = [c for c in running if c.left > 0] + prefills


def least_loaded(request, engines, now):
    return min(engines, key=lambda e: (e.inflight, len(e.running), e.index))


def prefix_aware(request, engines, now, decode_term=True):
    def ttft(e):
        step = e.decode_step_s() if decode_term else 0.0
        return step + (e.inflight + e.uncached(request)) * PREFILL_S_PER_TOKEN
    return min(engines, key=lambda e: (ttft(e), e.index))


def prefix_affinity(request, engines, now):
    return min(engines, key=lambda e: (e.uncached(request), e.inflight, e.index))


def oracle(request, engines, now):
    return min(engines, key=lambda e: (first_token_s(e, request, now), e.index))


def cold_packing(request, engines, now):
    if all(e.uncached(request) > 2 * QUESTION_LEN for e in engines):
        busy = max(engines, key=lambda e: (e.inflight, -e.index))
        if busy.inflight * PREFILL_S_PER_TOKEN < 0.2:
            return busy
    return least_loaded(request, engines, now)


RULES = {
    "least_loaded": least_loaded,
    "prefix_aware": prefix_aware,
    "prefix_aware_exact_step": lambda r, es, now: prefix_aware(r, es, now, decode_term=False),
    "prefix_affinity": prefix_affinity,
    "oracle": oracle,
    "cold_packing": cold_packing,
}


def simulate(trace: list[tuple[float, bool]], rule) -> list[Request]:
    engines = [Engine(0), Engine(1)]
    requests = [Request(t, hot) for t, hot in trace]
    i = 0
    while i < len(requests) or any(e.step for e in engines):
        next_end = min((e.step[0] for e in engines if e.step), default=float("inf"))
        if i < len(requests) and requests[i].arrival_s <= next_end:
            r, now = requests[i], requests[i].arrival_s
            i += 1
            e = rule(r, engines, now)
            r.need = e.uncached(r)
            e.hot_cached |= r.hot
            e.inflight += r.need
            e.waiting.append(r)
            if e.step is None:
                start_step(e, now)
            continue
        now = next_end
        for e in engines:
            if e.step is None or e.step[0] != now:
                continue
            _, prefills, decodes = e.step
            for r in prefills:
                r.first_s = now
                e.inflight -= r.need
                e.running.append(r)
            for r in decodes:
                r.left -= 1
                if r.left == 0:  # the stream's time per token after its first, decayed
                    e.decode_num = e.decode_num * DECAY + (now - r.first_s)
                    e.decode_den = e.decode_den * DECAY + (OUTPUT_LEN - 1)
            e.running = [r for r in e.running if r.left > 0]
            start_step(e, now)
    return requests


def p90(values: list[float]) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(0.9 * len(values)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=30)
    parser.add_argument("--rate", type=float, default=12.0)
    parser.add_argument("--num-requests", type=int, default=192)
    args = parser.parse_args()
    results = {name: [] for name in RULES}
    for seed in range(args.seeds):
        trace = arrivals(seed, args.num_requests, args.rate)
        for name, rule in RULES.items():
            done = simulate(trace, rule)
            results[name].append(p90([r.first_s - r.arrival_s for r in done]))
    base = results["least_loaded"]
    print(f"{args.num_requests} requests at {args.rate}/s, {args.seeds} seeds: TTFT p90 "
          f"(least_loaded's own: {1000 * min(base):.0f}-{1000 * max(base):.0f} ms over the seeds)")
    for name, values in results.items():
        wins = sum(v < b for v, b in zip(values, base))
        ratios = statistics.quantiles([b / v for v, b in zip(values, base)], n=4)
        print(f"  {name:24s} median {1000 * statistics.median(values):6.0f} ms, "
              f"below least_loaded's on {wins:2d} of {args.seeds} seeds, least_loaded / it "
              f"quartiles {ratios[0]:.2f} / {ratios[1]:.2f} / {ratios[2]:.2f}")


if __name__ == "__main__":
    main()
