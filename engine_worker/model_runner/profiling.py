"""The start-up memory profile: how much device memory one step can take at its largest.

A dummy step runs ``max_num_batched_tokens`` tokens through the model (as long prefills, at
most ``max_model_len`` each) and then the sampler over ``max_num_seqs`` rows with every
option on (top-k/p, min-p, penalties, min_tokens bans, 20 logprobs), and the allocator's peak
over it is the activations' share (vLLM profiles the same way). It runs before the KV cache
exists, against a one-block scratch cache that every token's K/V is written over: it touches
no real cache, no block and no request, and draws from its own generator.

Memory readings come through a ``MemoryReader``, so the profile runs on a CPU in the tests
with readings injected; ``CudaMemory`` reads torch's CUDA allocator and the driver.
"""

from __future__ import annotations

from typing import Protocol

import torch

from engine_worker.kv_cache.sizing import MemoryProfile
from engine_worker.model_runner.inputs import build_step_inputs
from engine_worker.model_runner.runner import RunnerRequestState
from engine_worker.model_runner.sampling_inputs import build_sampling_metadata
from engine_worker.sampler import draw_uniforms, sample_tokens
from engine_worker.sampling_params import SamplingParams

PROFILE_LOGPROBS = 20  # OpenAI's most top_logprobs


class MemoryReader(Protocol):
    """The readings a profile takes, in bytes."""

    def synchronize(self) -> None: ...

    def empty_cache(self) -> None: ...

    def reset_peak(self) -> None: ...

    def allocated_bytes(self) -> int: ...

    def peak_allocated_bytes(self) -> int: ...

    def reserved_bytes(self) -> int: ...

    def free_and_total_bytes(self) -> tuple[int, int]: ...


class CudaMemory:
    """``MemoryReader`` of one CUDA device."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)

    def empty_cache(self) -> None:
        torch.cuda.empty_cache()

    def reset_peak(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.device)

    def allocated_bytes(self) -> int:
        return torch.cuda.memory_allocated(self.device)

    def peak_allocated_bytes(self) -> int:
        return torch.cuda.max_memory_allocated(self.device)

    def reserved_bytes(self) -> int:
        return torch.cuda.memory_reserved(self.device)

    def free_and_total_bytes(self) -> tuple[int, int]:
        free, total = torch.cuda.mem_get_info(self.device)
        return int(free), int(total)


def _dummy_states(num_tokens: int, max_model_len: int, block_size: int, params: SamplingParams
                  ) -> tuple[list[RunnerRequestState], list[int]]:
    """Whole prefills of ``num_tokens`` tokens, at most ``max_model_len`` each, every block
    table pointing at block 0 of the scratch cache."""
    lengths = [min(max_model_len, num_tokens - start)
               for start in range(0, num_tokens, max_model_len)]
    states = [RunnerRequestState(req_id=f"profile-{i}", token_ids=[0] * n, num_prompt_tokens=n,
                                 params=params, block_ids=[0] * -(-n // block_size),
                                 num_computed_tokens=0, generator=None)
              for i, n in enumerate(lengths)]
    return states, lengths


@torch.inference_mode()
def run_dummy_step(model, *, num_tokens: int, num_seqs: int, max_model_len: int,
                   block_size: int, device: torch.device) -> torch.Tensor:
    """The largest step the scheduler can send, and the sampler's largest batch. Returns the
    sampled ids (left on the device)."""
    cfg = model.cfg
    dtype = model.embed_tokens.weight.dtype
    scratch = torch.zeros(2, 1, block_size, cfg.num_kv_heads, cfg.head_dim, dtype=dtype,
                          device=device)
    params = SamplingParams(temperature=0.8, top_p=0.9, top_k=50, min_p=0.01,
                            repetition_penalty=1.1, presence_penalty=0.1,
                            frequency_penalty=0.1, min_tokens=1, max_tokens=2,
                            logprobs=PROFILE_LOGPROBS)
    states, lengths = _dummy_states(num_tokens, max_model_len, block_size, params)
    input_ids, positions, meta, _ = build_step_inputs(states, lengths, block_size, device)
    hidden = model(input_ids, positions, [scratch] * cfg.num_layers, meta)
    # the sampler's rows: the last num_seqs tokens (any rows do; their number is what counts)
    rows = torch.arange(num_tokens - min(num_seqs, num_tokens), num_tokens, device=device)
    rows = rows.repeat(-(-num_seqs // len(rows)))[:num_seqs]
    logits = model.compute_logits(hidden[rows])
    picked = [states[0]] * num_seqs
    sampling = build_sampling_metadata(picked, cfg.vocab_size, frozenset({0}), device)
    generator = torch.Generator(device=device).manual_seed(0)
    tokens, _ = sample_tokens(logits, sampling, draw_uniforms(logits, sampling, generator))
    return tokens


def profile_memory(model, memory: MemoryReader, *, num_tokens: int, num_seqs: int,
                   max_model_len: int, block_size: int, device: torch.device) -> MemoryProfile:
    """Weights (all torch holds now), the dummy step's peak above them, and the memory in
    use outside torch, with ``memory``'s readings; ``cuda_graph_bytes`` is left 0."""
    memory.synchronize()
    memory.empty_cache()
    memory.reset_peak()
    weights = memory.allocated_bytes()
    run_dummy_step(model, num_tokens=num_tokens, num_seqs=num_seqs,
                   max_model_len=max_model_len, block_size=block_size, device=device)
    memory.synchronize()
    peak = max(0, memory.peak_allocated_bytes() - weights)
    free, total = memory.free_and_total_bytes()
    non_torch = max(0, total - free - memory.reserved_bytes())
    memory.empty_cache()
    return MemoryProfile(total_bytes=total, weights_bytes=weights, peak_activation_bytes=peak,
                         non_torch_bytes=non_torch)
