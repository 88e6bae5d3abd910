"""A step reads the device once: every host read of a tensor in ``ModelRunner.execute`` falls
inside ``_to_host``, which makes the one ``platform.to_host`` copy (then reads host tensors).

On a GPU each host read outside it would be a sync that waits out the queued kernels; on
the CPU there is no device, so the test counts the reads themselves with a TorchFunctionMode
(``.tolist()``, ``.item()``, ``int(t)``, ``bool(t)``, ``.numpy()`` ...), with every sampling
option on: seeds, greedy and random rows, top-k/p, min-p, penalties, min_tokens, logprobs,
prompt logprobs and n > 1.

The top-p draw runs as it does on a GPU (pivot rounds, then the sorted floor, no early stop):
on the CPU it reads one flag a round on the host to stop early (``pivot_rounds_for``), which
is no device read there."""

from __future__ import annotations

import pytest
import torch

from engine_worker import LLM, SamplingParams
from engine_worker.model_runner import runner as runner_module
from engine_worker.model_runner import sampling_inputs
from engine_worker.sampling_draw import PivotRounds

HOST_READS = {"tolist", "item", "__bool__", "__int__", "__float__", "__index__", "numpy"}


class _HostReads(torch.overrides.TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.reads: list[str] = []
        self.allowed = 0  # > 0 inside ModelRunner._to_host

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in HOST_READS and not self.allowed:
            self.reads.append(name)
        return func(*args, **(kwargs or {}))


@pytest.fixture(scope="module", params=[1, 4], ids=["one-pass-steps", "multi-step"])
def llm(tiny_model_dir, request):
    return LLM(str(tiny_model_dir), dtype="float32", kernels="torch", max_model_len=256,
               kv_cache_memory_bytes=1 << 24, max_num_batched_tokens=64,
               num_scheduler_steps=request.param)


def test_a_step_reads_the_device_once(llm, monkeypatch):
    """Once a forward pass: a multi-step decode reads each pass's samples to feed them to the
    next pass, which is one read per pass as well."""
    runner = llm.engine.runner
    mode = _HostReads()
    copies: list[int] = []
    executed: list[bool] = []
    passes: list[int] = []
    execute, to_host_step, forward = runner.execute, runner._to_host, runner._forward

    def counted_execute(out):
        executed.append(not out.is_empty)
        with mode:
            return execute(out)

    def allowed_to_host(*args):
        mode.allowed += 1
        try:
            return to_host_step(*args)
        finally:
            mode.allowed -= 1

    real_to_host = runner_module.to_host

    def counted_to_host(tensors):
        copies.append(len(tensors))
        return real_to_host(tensors)

    def counted_forward(*args):
        passes.append(1)
        return forward(*args)

    monkeypatch.setattr(runner, "_forward", counted_forward)
    monkeypatch.setattr(runner, "execute", counted_execute)
    monkeypatch.setattr(runner, "_to_host", allowed_to_host)
    monkeypatch.setattr(runner_module, "to_host", counted_to_host)
    monkeypatch.setattr(sampling_inputs, "pivot_rounds_for",
                        lambda device: PivotRounds(max_rounds=4, stop_early=False))
    params = [SamplingParams(temperature=0, max_tokens=6, logprobs=2, prompt_logprobs=1),
              SamplingParams(temperature=0.9, seed=3, top_k=20, top_p=0.9, min_p=0.01,
                             repetition_penalty=1.2, presence_penalty=0.5,
                             frequency_penalty=0.2, min_tokens=3, max_tokens=6, n=2),
              SamplingParams(temperature=1.0, max_tokens=6, logprobs=0)]
    prompts = [{"prompt_token_ids": list(range(5, 5 + n))} for n in (70, 9, 3)]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert [len(c.token_ids) for o in outputs for c in o.outputs] == [6, 6, 6, 6]
    assert outputs[0].outputs[0].logprobs and outputs[0].prompt_logprobs
    assert mode.reads == []  # no host read outside the one copy
    assert len(copies) == len(passes) > 6  # one copy per forward pass
    steps = llm.engine.config.scheduler.num_scheduler_steps
    assert (len(passes) > sum(executed)) == (steps > 1)  # multi-step ran where it is on
    with mode:  # and the counter has teeth
        torch.ones(2).sum().item()
    assert mode.reads == ["item"]
