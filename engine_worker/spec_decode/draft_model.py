"""The draft-model proposer: a small model of the target's tokenizer proposes greedily.

The draft runs in the engine's process, on the engine's device, dtype and kernels, over its
own paged KV cache (``DraftKVCache``): every request it drafts for has its own block table in
it, mirroring the target's request but independent of the target's blocks (the draft's layers,
heads and head size differ). The draft keeps the K/V of a request's tokens from one step to
the next; after verification only the tokens that were accepted match the request's history,
so each proposal first finds the longest prefix of the history whose K/V it holds, computes
the rest in one forward (the target's last tokens: the bonus or corrected token, and on the
first proposal the whole prompt), then ``k - 1`` single-token forwards for the next drafts.

Why greedy: a draft chosen deterministically from the context is a proposal whose ``q`` is a
point mass, and for a point mass the rejection rule ``accept with min(1, p(x) / q(x))``,
``resample from (p - q)+`` is exactly "sample ``y`` from ``p``; accept ``x`` iff ``y == x``"
(``rejection_sampler``), which the runner already does with every sampling parameter applied.
So the output of sampled requests stays the target's distribution; only their acceptance rate
is lower than a sampled draft's would be at high temperature.

The draft's cache is small: speculation runs only while at most ``disable_by_batch_size``
requests run, so it holds that many requests of ``max_model_len`` tokens (never more blocks
than the target's cache). When it is full the least recently drafted request's blocks are
taken (it recomputes its context when it drafts again); a request that cannot fit gets no
drafts that step.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np
import torch

from engine_worker.model_runner.inputs import build_step_inputs
from engine_worker.platform import to_host


@dataclass(frozen=True, slots=True)
class DraftShape:
    """What the draft and the target must agree on, read from each at start."""

    vocab_size: int  # the logits' width: token ids pass between the two unchanged
    block_size: int  # tokens per KV block of its cache
    max_model_len: int


def check_draft(target: DraftShape, draft: DraftShape) -> None:
    """A draft the target cannot verify is an error at start, naming both values."""
    if draft.vocab_size != target.vocab_size:
        raise ValueError(f"speculative_config.model: the draft model's vocabulary has "
                         f"{draft.vocab_size} tokens, the target's {target.vocab_size}; a draft "
                         f"must share the target's tokenizer")
    if draft.block_size != target.block_size:
        raise ValueError(f"speculative_config.model: the draft's KV cache blocks hold "
                         f"{draft.block_size} tokens, the target's {target.block_size}; its "
                         f"block tables mirror the target's requests")
    if draft.max_model_len < target.max_model_len:
        raise ValueError(f"speculative_config.model: the draft model holds at most "
                         f"{draft.max_model_len} tokens, the target {target.max_model_len}; "
                         f"lower max_model_len to {draft.max_model_len} or pick another draft")


@dataclass(slots=True)
class _DraftSequence:
    """One request in the draft's cache: the tokens it has seen (the first
    ``num_computed_tokens`` of them have their K/V in ``block_ids``)."""

    token_ids: list[int] = field(default_factory=list)
    block_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0


class DraftKVCache:
    """The draft's paged KV cache: block tensors, a free list, and the requests holding
    blocks, least recently drafted first (the eviction order)."""

    def __init__(self, kv_caches: list[torch.Tensor], block_size: int) -> None:
        self.kv_caches = kv_caches  # per layer: [2, num_blocks, block_size, kv_heads, head_dim]
        self.block_size = block_size
        self.num_blocks = kv_caches[0].shape[1]
        self._free = list(range(self.num_blocks - 1, -1, -1))
        self.sequences: OrderedDict[str, _DraftSequence] = OrderedDict()

    def sequence(self, req_id: str) -> _DraftSequence:
        """The request's sequence, now the most recently drafted."""
        seq = self.sequences.pop(req_id, None) or _DraftSequence()
        self.sequences[req_id] = seq
        return seq

    def reserve(self, req_id: str, num_tokens: int) -> bool:
        """Blocks for ``num_tokens`` slots of the request, taking the least recently drafted
        requests' blocks when none are free; False when the whole cache cannot hold it."""
        seq = self.sequences[req_id]
        needed = -(-num_tokens // self.block_size) - len(seq.block_ids)
        if needed > self.num_blocks - len(seq.block_ids):
            return False
        while len(self._free) < needed:
            victim = next(r for r in self.sequences if r != req_id)
            self.free(victim)
        seq.block_ids.extend(self._free.pop() for _ in range(max(0, needed)))
        return True

    def free(self, req_id: str) -> None:
        seq = self.sequences.pop(req_id, None)
        if seq is not None:
            self._free.extend(reversed(seq.block_ids))

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)


class DraftModelProposer:
    """Proposes up to ``max_num_tokens`` tokens per request by running the draft model
    greedily over its own cache (module docstring)."""

    def __init__(self, model: torch.nn.Module, cache: DraftKVCache,
                 device: torch.device) -> None:
        self.model = model
        self.cache = cache
        self.device = device

    @torch.inference_mode()
    def propose(self, req_id: str, tokens: np.ndarray, max_num_tokens: int
                ) -> tuple[int, ...]:
        seq = self.cache.sequence(req_id)
        seq.num_computed_tokens = self._num_matching(seq, tokens)
        seq.token_ids = tokens.tolist()
        # the last draft is returned, never run: its K/V is computed next step if accepted
        if not self.cache.reserve(req_id, len(tokens) + max_num_tokens - 1):
            self.cache.free(req_id)
            return ()
        drafts: list[int] = []
        num_new = len(tokens) - seq.num_computed_tokens
        for _ in range(max_num_tokens):
            token = self._next_token(seq, num_new)
            drafts.append(token)
            seq.token_ids.append(token)
            num_new = 1
        return tuple(drafts)

    @staticmethod
    def _num_matching(seq: _DraftSequence, tokens: np.ndarray) -> int:
        """How many leading tokens of ``tokens`` have their K/V in the cache; at least one
        token is left to compute (its logits give the first draft)."""
        n = min(seq.num_computed_tokens, len(tokens) - 1)
        if n <= 0:
            return 0
        differ = np.flatnonzero(np.asarray(seq.token_ids[:n], dtype=np.int64) != tokens[:n])
        return int(differ[0]) if len(differ) else n

    def _next_token(self, seq: _DraftSequence, num_new: int) -> int:
        """Run the sequence's ``num_new`` uncomputed tokens; the argmax after the last."""
        input_ids, positions, meta, _ = build_step_inputs([seq], [num_new],
                                                          self.cache.block_size, self.device)
        hidden = self.model(input_ids, positions, self.cache.kv_caches, meta)
        seq.num_computed_tokens += num_new
        logits = self.model.compute_logits(hidden[-1:])  # [1, vocab]
        (token,) = to_host([torch.argmax(logits, dim=-1)])
        return int(token[0])

    def forget(self, req_id: str, output_token_ids: list[int]) -> None:
        self.cache.free(req_id)
