"""Where an engine step's time goes, and decode throughput against batch size.

``StepProfiler`` wraps, on one engine instance only, the callables whose time it reports:
the whole step, the model runner's ``execute``, the model's forward, every layer's attention
backend and the runner's sampling. Nothing in the engine knows about it, so the serving path
carries no timing code. Where the decoder layers run as one kernel call (``layer_stack``),
Python cannot see attention inside it: the profiler hands that call a counter, into which the
kernel adds its cache-write and attention time. The split of one step::

    step ── scheduling (schedule, update, detokenize, outputs)
       └─ execute ── inputs (building the flat step inputs, copying block tables)
             ├─ forward ── attention (KV write + paged attention, every layer)
             │        └─ model (linear layers, norms, RoPE, activations, embeddings)
             └─ sampling (logits projection, sampler, bookkeeping)
"""

from __future__ import annotations

import dataclasses
import gc
import random
import sys
import time
from collections import defaultdict
from dataclasses import dataclass

import torch

from quire_cli.bench.prompts import random_prompt

PARTS = ("model", "attention", "sampling", "inputs", "scheduling")


class _TimedStack:
    """A fused layer stack that adds its attention time to ``attention_ns``; otherwise the
    stack itself (what it runs, LoRA included)."""

    def __init__(self, stack, attention_ns) -> None:
        self._stack = stack
        self._attention_ns = attention_ns

    def __call__(self, *args, **kwargs):
        return self._stack(*args, attention_ns=self._attention_ns, **kwargs)

    def __getattr__(self, name: str):
        return getattr(self._stack, name)


class _Timed:
    """A callable that adds its own wall time to ``totals[key]``."""

    def __init__(self, fn, totals: dict[str, float], key: str) -> None:
        self.fn, self.totals, self.key = fn, totals, key

    def __call__(self, *args, **kwargs):
        start = time.perf_counter()
        try:
            return self.fn(*args, **kwargs)
        finally:
            self.totals[self.key] += time.perf_counter() - start


class _TimedBackend:
    def __init__(self, inner, totals: dict[str, float]) -> None:
        self.name = inner.name
        self.forward = _Timed(inner.forward, totals, "attention")


class StepProfiler:
    """Attach to an ``LLMEngine``; ``split_ms()`` gives mean milliseconds per forward pass by
    part: per step where each step is one pass, and per pass of a multi-step run
    (``num_scheduler_steps``), whose scheduling is then shared by its passes."""

    def __init__(self, engine) -> None:
        self.totals: dict[str, float] = defaultdict(float)
        self.num_steps = 0
        self.num_passes = 0
        runner, model = engine.runner, engine.runner.model
        step, forward = engine.step, model.forward

        def counted_step():
            self.num_steps += 1
            return step()

        def counted_forward(*args, **kwargs):
            self.num_passes += 1
            return forward(*args, **kwargs)

        engine.step = _Timed(counted_step, self.totals, "step")
        runner.execute = _Timed(runner.execute, self.totals, "execute")
        runner._sample = _Timed(runner._sample, self.totals, "sampling")
        model.forward = _Timed(counted_forward, self.totals, "forward")
        backends = {}
        for layer in model.layers:
            inner = layer.self_attn.attention
            backends.setdefault(id(inner), _TimedBackend(inner, self.totals))
            layer.self_attn.attention = backends[id(inner)]
        self.stack_attention_ns = torch.zeros(1, dtype=torch.int64)
        stack = model.layer_stack
        if stack is not None:
            model.layer_stack = _TimedStack(stack, self.stack_attention_ns)

    def reset(self) -> None:
        self.totals.clear()
        self.stack_attention_ns.zero_()
        self.num_steps = self.num_passes = 0

    def split_ms(self) -> dict[str, float]:
        t = self.totals
        attention = t["attention"] + self.stack_attention_ns.item() / 1e9
        parts = {
            "attention": attention,
            "model": t["forward"] - attention,
            "sampling": t["sampling"],
            "inputs": t["execute"] - t["forward"] - t["sampling"],
            "scheduling": t["step"] - t["execute"],
        }
        n = max(self.num_passes, 1)
        return {k: round(v / n * 1000, 3) for k, v in parts.items()}


@dataclass(frozen=True, slots=True)
class SweepPoint:
    batch_size: int
    num_steps: int  # engine steps: a multi-step run is one
    num_passes: int  # forward passes: one a decode token of every request
    elapsed_s: float
    output_tokens_per_s: float
    # mean per decode pass (a decode step of one pass, or a pass of a multi-step run), by part
    decode_step_ms: dict[str, float]


def _prompts(batch_size: int, prompt_len: int, vocab_size: int, seed: int):
    rng = random.Random(seed)
    return [{"prompt_token_ids": random_prompt(rng, prompt_len, vocab_size)}
            for _ in range(batch_size)]


def sweep_batch_sizes(engine_args, sizes, *, prompt_len: int, output_len: int,
                      vocab_size: int) -> list[SweepPoint]:
    """For each size: that many requests at once (max_num_seqs = size); prefill all, then time
    ``output_len - 1`` decode steps of the full batch with the step split."""
    from engine_worker import LLM, SamplingParams
    from engine_worker.sampling_params import RequestOutputKind

    points = []
    for size in sizes:
        print(f"batch-size sweep: {size}", file=sys.stderr)
        llm = LLM(**dataclasses.asdict(dataclasses.replace(
            engine_args, max_num_seqs=size, enable_prefix_caching=False)))
        engine = llm.engine
        params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True,
                                output_kind=RequestOutputKind.FINAL_ONLY)
        llm.generate(_prompts(size, prompt_len, vocab_size, 1), SamplingParams(
            temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False)  # warm-up
        for i, prompt in enumerate(_prompts(size, prompt_len, vocab_size, 2)):
            engine.add_request(f"sweep-{i}", prompt, params)
        # prefill everyone, untimed: until nothing waits and every running request has only
        # its last sampled token left to compute
        stats = engine.stats().scheduler
        while stats.num_waiting or stats.num_queued_tokens > stats.num_running:
            stats = engine.step().stats.scheduler
        profiler = StepProfiler(engine)
        start = time.perf_counter()
        produced = 0
        while engine.has_unfinished_requests():
            produced += sum(len(o.outputs[0].token_ids) for o in engine.step().outputs
                            if o.finished)
        elapsed = time.perf_counter() - start
        # every request had its first token from the prefill; the rest came from these steps
        decoded = produced - size
        points.append(SweepPoint(size, profiler.num_steps, profiler.num_passes,
                                 round(elapsed, 3),
                                 round(decoded / elapsed, 1), profiler.split_ms()))
        del llm, engine, profiler
        gc.collect()
    return points
