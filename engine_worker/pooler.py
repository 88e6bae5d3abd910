"""Embeddings: how a prompt's final hidden states become one vector (vLLM's pooler).

A pooling request is a prompt-only forward batched with the step's other work: it is prefilled
(in chunks, like any prompt) and, once its last prompt token is computed, its pooled vector is
its one output; it samples nothing. The final hidden state is the model's output after its last
norm (``LlamaForCausalLM.forward``), the same as transformers' ``last_hidden_state``.

Pooling methods, by vLLM's ``pooling_type`` names (a registry, ``POOLING_METHODS``):

- ``LAST``: the hidden state of the last prompt token (decoder embedding models);
- ``MEAN``: the mean over every prompt position;
- ``CLS``: the hidden state of the first prompt position.

Prefix cache: a cached prefix skips computing its positions, so their hidden states never
exist. ``MEAN`` and ``CLS`` need positions a cached prefix would skip, so their requests do
not *read* the prefix cache (they still fill it, for later generation or ``LAST`` requests);
``LAST`` needs only the last position, which is always computed, so it reads the cache.

A chunked prompt is pooled across chunks: ``MEAN`` keeps a running fp32 sum per request, and
the other methods copy the row they keep (a step's hidden states may live in a reused buffer).
"""

from __future__ import annotations

import torch

from engine_worker.pooler_config import POOLING_TYPES, PoolerConfig


class _Last:
    needs_every_position = False

    @staticmethod
    def update(acc, rows: torch.Tensor, first_position: int, completes: bool):
        # rows: [num_chunk_tokens, hidden_size], the request's rows of this step
        return rows[-1].float().clone() if completes else acc

    @staticmethod
    def finish(acc: torch.Tensor, num_prompt_tokens: int) -> torch.Tensor:
        return acc


class _Mean:
    needs_every_position = True

    @staticmethod
    def update(acc, rows: torch.Tensor, first_position: int, completes: bool):
        chunk = rows.float().sum(dim=0)
        return chunk if acc is None else acc + chunk

    @staticmethod
    def finish(acc: torch.Tensor, num_prompt_tokens: int) -> torch.Tensor:
        return acc / num_prompt_tokens


class _Cls:
    needs_every_position = True  # position 0 is in every cached prefix

    @staticmethod
    def update(acc, rows: torch.Tensor, first_position: int, completes: bool):
        return rows[0].float().clone() if first_position == 0 else acc

    @staticmethod
    def finish(acc: torch.Tensor, num_prompt_tokens: int) -> torch.Tensor:
        return acc


POOLING_METHODS = {"LAST": _Last, "MEAN": _Mean, "CLS": _Cls}
assert tuple(POOLING_METHODS) == POOLING_TYPES


class Pooler:
    """One engine's pooling: its method and whether vectors are L2-normalised by default."""

    def __init__(self, config: PoolerConfig) -> None:
        self.config = config
        self.method = POOLING_METHODS[config.pooling_type]

    @property
    def needs_every_position(self) -> bool:
        return self.method.needs_every_position

    def finish(self, acc: torch.Tensor, num_prompt_tokens: int, normalize: bool) -> torch.Tensor:
        # acc: [hidden_size] fp32 -> the embedding [hidden_size] fp32
        pooled = self.method.finish(acc, num_prompt_tokens)
        return torch.nn.functional.normalize(pooled, dim=-1) if normalize else pooled
