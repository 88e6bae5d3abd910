"""Flat step inputs from the runner's request states: token ids, positions, attention metadata.

Requests come in step order (decodes first, see ``attention.metadata``); request i schedules
``counts[i]`` tokens starting at its ``num_computed_tokens``.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from engine_worker.attention.metadata import AttentionMetadata, PrefillChunk
from engine_worker.platform import to_device


def block_tables(states: Sequence) -> np.ndarray:
    """[num_seqs, max_num_blocks] int32: every request's block table, padded with block 0."""
    tables = np.zeros((len(states), max(len(s.block_ids) for s in states)), dtype=np.int32)
    for i, state in enumerate(states):
        tables[i, :len(state.block_ids)] = state.block_ids
    return tables


def decode_arrays(states: Sequence) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A step of one token per request, as host arrays: each request's input token [n], its
    position [n] and the block tables [n, max_num_blocks] (what ``DecodeBuffers.fill`` takes)."""
    n = len(states)
    positions = np.fromiter((s.num_computed_tokens for s in states), np.int64, n)
    token_ids = np.fromiter((s.token_ids[s.num_computed_tokens] for s in states), np.int64, n)
    return token_ids, positions, block_tables(states)


def build_step_inputs(states: Sequence, counts: Sequence[int], block_size: int,
                      device: torch.device
                      ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int]]:
    """-> input_ids [num_tokens], positions [num_tokens], metadata, each request's first row.
    ``states`` need ``token_ids``, ``block_ids`` and ``num_computed_tokens``."""
    if all(n == 1 for n in counts):
        return decode_step_inputs(states, block_size, device)
    return mixed_step_inputs(states, counts, block_size, device)


def mixed_step_inputs(states: Sequence, counts: Sequence[int], block_size: int,
                      device: torch.device
                      ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int]]:
    """``build_step_inputs`` for any step (prefill chunks, drafts, decodes), in numpy."""
    num_seqs = len(states)
    starts = np.zeros(num_seqs + 1, dtype=np.int64)
    np.cumsum(counts, out=starts[1:])
    computed = np.fromiter((s.num_computed_tokens for s in states), np.int64, num_seqs)
    seq_lens = computed + np.asarray(counts, dtype=np.int64)
    tables = block_tables(states)
    # the step's tokens: request i's positions computed[i] .. seq_lens[i] - 1
    rows = np.repeat(np.arange(num_seqs), counts)
    positions = np.arange(starts[-1]) - np.repeat(starts[:-1] - computed, counts)
    slots = (tables[rows, positions // block_size].astype(np.int64) * block_size
             + positions % block_size)
    ids = np.fromiter((t for s, n in zip(states, counts)
                       for t in s.token_ids[s.num_computed_tokens:s.num_computed_tokens + n]),
                      np.int64, int(starts[-1]))
    to_dev = lambda a: to_device(torch.from_numpy(np.ascontiguousarray(a)), device)
    num_decodes = next((i for i, n in enumerate(counts) if n != 1), num_seqs)
    tables_dev = to_dev(tables)
    prefills = tuple(
        PrefillChunk(query_start=int(starts[i]), query_len=counts[i],
                     context_len=int(computed[i]),
                     block_table=tables_dev[i, :len(states[i].block_ids)].long())
        for i in range(num_decodes, num_seqs))
    decode_lens = to_dev(seq_lens[:num_decodes])
    meta = AttentionMetadata(
        slot_mapping=to_dev(slots), num_decode_tokens=num_decodes,
        decode_block_tables=tables_dev[:num_decodes].long(), decode_seq_lens=decode_lens,
        decode_max_seq_len=int(seq_lens[:num_decodes].max(initial=0)), prefills=prefills,
        query_start_loc=to_dev(starts), seq_lens=to_dev(seq_lens), block_tables=tables_dev)
    return to_dev(ids), to_dev(positions), meta, starts[:-1].tolist()


def decode_step_inputs(states: Sequence, block_size: int, device: torch.device
                       ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int]]:
    """``build_step_inputs`` for a step of one token per request: the same tensors, from
    Python ints. Inside a decode loop the streamed weights leave every cache cold, and there
    each torch or numpy call costs tens of microseconds: the mixed path's two dozen took
    200-300 us for one request, this 75-140 (Zen 4)."""
    n = len(states)
    positions = [s.num_computed_tokens for s in states]
    ids = [s.token_ids[p] for s, p in zip(states, positions)]
    slots = [s.block_ids[p // block_size] * block_size + p % block_size
             for s, p in zip(states, positions)]
    seq_lens = [p + 1 for p in positions]
    ids_t, positions_t, slots_t, seq_lens_t, starts_t = (
        to_device(torch.from_numpy(np.array(a, dtype=np.int64)), device)
        for a in (ids, positions, slots, seq_lens, range(n + 1)))
    tables = to_device(torch.from_numpy(block_tables(states)), device)
    meta = AttentionMetadata(
        slot_mapping=slots_t, num_decode_tokens=n, decode_block_tables=tables.long(),
        decode_seq_lens=seq_lens_t, decode_max_seq_len=max(seq_lens), prefills=(),
        query_start_loc=starts_t, seq_lens=seq_lens_t, block_tables=tables)
    return ids_t, positions_t, meta, list(range(n))


class DecodeInputs:
    """``decode_step_inputs`` into tensors kept from step to step (the CPU path): a decode
    loop's step fills the same few arrays in place, where building them anew costs a few
    dozen numpy and torch calls on cold caches (one request on a Zen 4: 65-96 -> 31-34 us a
    step). A row's block table is written where it changed: a request's ``block_ids`` only
    grow in place or are replaced by a new list (``ModelRunner._apply_diffs``), so the list
    each row was written from and its length then say which blocks are new. The tensors it
    returns are overwritten by the next call: a step's inputs live for that step only, which
    is how the runner uses them (the KV cache, not the inputs, carries state to the next
    step). One owner each (a runner), never shared."""

    def __init__(self) -> None:
        self._rows = -1
        self._width = -1

    def build(self, states: Sequence, block_size: int
              ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int]]:
        n = len(states)
        width = max(len(s.block_ids) for s in states)
        if n != self._rows:
            self._rows, self._width = n, -1
            # ids, positions, slots, seq_lens: one array, its rows as the step's tensors
            self._host = np.zeros((4, n), dtype=np.int64)
            self._tensors = tuple(torch.from_numpy(self._host)[i] for i in range(4))
            self._starts = torch.arange(n + 1, dtype=torch.int64)
            self._first_rows = list(range(n))
        if width != self._width:  # a table's width is the step's (the kernels' row stride)
            self._width = width
            self._tables = np.zeros((n, width), dtype=np.int32)
            self._tables_long = np.zeros((n, width), dtype=np.int64)
            self._tables_t = torch.from_numpy(self._tables)
            self._tables_long_t = torch.from_numpy(self._tables_long)
            self._written: list[tuple[list[int] | None, int]] = [(None, 0)] * n
        host, tables, tables_long, written = self._host, self._tables, self._tables_long, \
            self._written
        max_len = 0
        for i, state in enumerate(states):
            p = state.num_computed_tokens
            blocks = state.block_ids
            host[:, i] = (state.token_ids[p], p,
                          blocks[p // block_size] * block_size + p % block_size, p + 1)
            max_len = max(max_len, p + 1)
            source, done = written[i]
            if source is not blocks or done > len(blocks):  # another list: the whole row
                source, done = blocks, 0
                tables[i] = 0
                tables_long[i] = 0
            if done < len(blocks):
                tables[i, done:len(blocks)] = blocks[done:]
                tables_long[i, done:len(blocks)] = tables[i, done:len(blocks)]
                written[i] = (blocks, len(blocks))
        ids, positions, slots, seq_lens = self._tensors
        meta = AttentionMetadata(
            slot_mapping=slots, num_decode_tokens=n, decode_block_tables=self._tables_long_t,
            decode_seq_lens=seq_lens, decode_max_seq_len=max_len, prefills=(),
            query_start_loc=self._starts, seq_lens=seq_lens, block_tables=self._tables_t)
        return ids, positions, meta, self._first_rows
