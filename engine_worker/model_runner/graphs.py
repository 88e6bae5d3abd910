"""Graph-ready decode steps: fixed-capacity inputs, batches padded to capture sizes, and CUDA
graphs captured once per size.

A CUDA graph replays the kernels it recorded on the *same* memory, so a decode step that can
be captured must (1) read its inputs from buffers allocated once, (2) have a batch size from a
fixed set, and (3) never read a device value on the host (no ``.item()``, ``.tolist()``,
``int(t)``) between its kernels. ``DecodeBuffers`` gives (1) and (2): a decode-only step of
``n`` requests is copied into the first ``n`` rows and padded to the next capture size with
rows that write nothing (slot -1) and attend to one key of block 0. (3) holds for the model's
forward with the Triton attention backend, whose launch shapes come from tensor shapes; the
tests run a padded decode under ``FakeTensorMode``, which raises on any data-dependent host
read. Prefill steps and steps over the largest capture size run eagerly.
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from engine_worker.attention.metadata import AttentionMetadata
from engine_worker.model_runner.inputs import decode_arrays

logger = logging.getLogger(__name__)


def capture_sizes(max_num_seqs: int, largest: int = 256) -> tuple[int, ...]:
    """Batch sizes captured: 1, 2, 4, then every multiple of 8 up to ``max_num_seqs`` (at most
    ``largest``), and ``max_num_seqs`` itself where it is below ``largest``. Padding a batch
    wastes at most 7 rows."""
    top = min(max_num_seqs, largest)
    sizes = {s for s in (1, 2, 4) if s <= top} | set(range(8, top + 1, 8)) | {top}
    return tuple(sorted(sizes))


def padded_batch_size(num_seqs: int, sizes: Sequence[int]) -> int | None:
    """The smallest capture size holding ``num_seqs`` rows; None past the largest."""
    i = bisect.bisect_left(sizes, num_seqs)
    return sizes[i] if i < len(sizes) else None


@dataclass(frozen=True, slots=True)
class DecodeStep:
    """A decode-only step in the buffers: its padded size and the views the model reads."""

    num_seqs: int
    padded: int
    input_ids: torch.Tensor  # [padded] int64
    positions: torch.Tensor  # [padded] int64
    meta: AttentionMetadata
    token_slots: torch.Tensor  # [padded] int64: each row's LoRA slot (0: the base model)
    lora: bool = False  # some row runs an adapter: the graphs that record the LoRA deltas


class DecodeBuffers:
    """Inputs of a decode-only step at fixed addresses, sized once for the largest batch.

    The varlen fields (``query_start_loc``, ``seq_lens``, ``block_tables``, ``slot_mapping``)
    are what the Triton backend reads. The reference backend's decode fields are filled too, so
    the same step also runs eagerly on it (its ``decode_max_seq_len`` is a host int, which a
    captured graph would freeze: graphs are only captured with the Triton backend)."""

    def __init__(self, max_batch: int, max_blocks_per_seq: int, device: torch.device) -> None:
        self.max_batch = max_batch
        self.max_blocks_per_seq = max_blocks_per_seq
        self.device = device
        self.input_ids = torch.zeros(max_batch, dtype=torch.int64, device=device)
        self.positions = torch.zeros(max_batch, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((max_batch,), -1, dtype=torch.int64, device=device)
        self.seq_lens = torch.ones(max_batch, dtype=torch.int64, device=device)
        # a decode row is one query token: query_start_loc is fixed at 0, 1, ..., max_batch
        self.query_start_loc = torch.arange(max_batch + 1, dtype=torch.int64, device=device)
        self.block_tables = torch.zeros(max_batch, max_blocks_per_seq, dtype=torch.int32,
                                        device=device)
        self.token_slots = torch.zeros(max_batch, dtype=torch.int64, device=device)
        self._pin = device.type == "cuda"

    def fill(self, token_ids: np.ndarray, positions: np.ndarray, block_tables: np.ndarray,
             block_size: int, padded: int, token_slots: Sequence[int] | None = None
             ) -> DecodeStep:
        """Copy one decode step (``n`` requests: their next input token, its position, their
        block tables and, under LoRA, their adapter slots, all host values) into the buffers,
        padded to ``padded`` rows (padding rows and base requests: slot 0)."""
        n = len(token_ids)
        if not n <= padded <= self.max_batch:
            raise ValueError(f"batch: {n} rows padded to {padded}, capacity {self.max_batch}")
        if block_tables.shape[1] > self.max_blocks_per_seq:
            raise ValueError(f"block_tables: {block_tables.shape[1]} blocks per sequence, "
                             f"capacity {self.max_blocks_per_seq}")
        positions = positions.astype(np.int64)
        tables = np.zeros((padded, self.max_blocks_per_seq), dtype=np.int32)
        tables[:n, :block_tables.shape[1]] = block_tables
        slots = np.full(padded, -1, dtype=np.int64)  # padding rows write no K/V
        slots[:n] = (tables[np.arange(n), positions // block_size].astype(np.int64) * block_size
                     + positions % block_size)
        ids = np.zeros(padded, dtype=np.int64)
        ids[:n] = token_ids
        pos = np.zeros(padded, dtype=np.int64)
        pos[:n] = positions
        lens = np.ones(padded, dtype=np.int64)  # padding rows attend to one key of block 0
        lens[:n] = positions + 1
        copies = [(self.input_ids, ids), (self.positions, pos), (self.slot_mapping, slots),
                  (self.seq_lens, lens), (self.block_tables, tables)]
        if token_slots is not None:  # a base-only step's graph never reads the slots
            lora_slots = np.zeros(padded, dtype=np.int64)
            lora_slots[:n] = token_slots
            copies.append((self.token_slots, lora_slots))
        for dst, src in copies:
            host = torch.from_numpy(src)
            dst[:padded].copy_(host.pin_memory() if self._pin else host, non_blocking=self._pin)
        return self.step(n, padded, decode_max_seq_len=int(lens.max()),
                         lora=token_slots is not None)

    def step(self, num_seqs: int, padded: int, decode_max_seq_len: int,
             lora: bool = False) -> DecodeStep:
        """Views of the first ``padded`` rows (the same memory on every call)."""
        tables = self.block_tables[:padded]
        meta = AttentionMetadata(
            slot_mapping=self.slot_mapping[:padded], num_decode_tokens=padded,
            decode_block_tables=tables.long(), decode_seq_lens=self.seq_lens[:padded],
            decode_max_seq_len=decode_max_seq_len, prefills=(),
            query_start_loc=self.query_start_loc[:padded + 1], seq_lens=self.seq_lens[:padded],
            block_tables=tables)
        return DecodeStep(num_seqs, padded, self.input_ids[:padded], self.positions[:padded],
                          meta, self.token_slots[:padded], lora)


Forward = Callable[..., torch.Tensor]  # (input_ids, positions, kv_caches, meta[, lora])
# a fixed token_slots buffer -> the LoRA view a graph records (LoRAManager.graph_batch)
LoRAView = Callable[[torch.Tensor], Any]


@dataclass(frozen=True, slots=True)
class CudaGraphChoice:
    """Whether decode steps replay CUDA graphs, and why (or why not), said at start."""

    enabled: bool
    reason: str
    sizes: tuple[int, ...] = ()

    def describe(self) -> str:
        """``on (35 batch sizes, 1 to 256)`` or ``off (cpu)``."""
        return f"{'on' if self.enabled else 'off'} ({self.reason})"


def choose_cuda_graphs(*, device: torch.device, enforce_eager: bool, attention: str,
                       fused_layers: bool, max_num_seqs: int,
                       max_num_batched_tokens: int) -> CudaGraphChoice:
    """Graphs need a GPU, a forward whose launches depend on tensor shapes only (the Triton
    attention; the reference one sizes its decode gather from a host int, which a graph
    would freeze) and no ``enforce_eager``. A decode batch holds at most ``max_num_seqs``
    requests and ``max_num_batched_tokens`` tokens, so no larger size is captured."""
    if device.type != "cuda":
        return CudaGraphChoice(False, device.type)
    if enforce_eager:
        return CudaGraphChoice(False, "enforce_eager")
    if attention != "triton" or fused_layers:
        what = "a fused layer stack" if fused_layers else f"{attention} attention"
        return CudaGraphChoice(False, f"{what} is not graph-ready; only triton attention is")
    sizes = capture_sizes(min(max_num_seqs, max_num_batched_tokens))
    return CudaGraphChoice(True, f"{len(sizes)} batch sizes, {sizes[0]} to {sizes[-1]}", sizes)


class CudaGraphDecoder:
    """Decode-only forward passes replayed from CUDA graphs, one per capture size.

    ``prepare`` copies a decode-only step into the buffers (None when the step is not one,
    or is larger than the largest size: it runs eagerly); ``capture`` records ``eager`` (the
    model's forward on the buffers, returning hidden states) once per size, largest first,
    sharing one memory pool; ``run`` replays the graph of a step's padded size and returns its
    hidden rows. The graphs hold the KV cache tensors' addresses, so they are captured after
    the cache is allocated; ``measure_bytes`` captures against a throwaway cache first, so the
    engine can count their memory before it sizes the real cache. With ``lora_view`` (a
    graph-ready LoRA pair) each size has a second graph that records the adapters' deltas over
    the buffers' token slots, so decode steps of any mix of adapters replay too (base rows:
    slot 0, which the kernels skip), while steps of the base model alone replay the graph
    without them (vLLM's ``cudagraph_specialize_lora``)."""

    def __init__(self, forward: Forward, buffers: DecodeBuffers, sizes: Sequence[int],
                 block_size: int, lora_view: LoRAView | None = None) -> None:
        self.forward = forward
        self.lora_view = lora_view
        self.buffers = buffers
        self.sizes = tuple(sorted(sizes))
        self.block_size = block_size
        self.kv_caches: list[torch.Tensor] = []
        # (padded size, with LoRA) -> its graph and output rows
        self.graphs: dict[tuple[int, bool], torch.cuda.CUDAGraph] = {}
        self.outputs: dict[tuple[int, bool], torch.Tensor] = {}

    @property
    def takes_lora(self) -> bool:
        return self.lora_view is not None

    def prepare(self, states: Sequence, counts: Sequence[int],
                token_slots: Sequence[int] | None = None) -> DecodeStep | None:
        """``states`` (``token_ids``, ``block_ids``, ``num_computed_tokens``) in step order;
        ``token_slots``: their LoRA slots (only where ``takes_lora``)."""
        assert token_slots is None or self.takes_lora
        if any(n != 1 for n in counts):
            return None
        padded = padded_batch_size(len(states), self.sizes)
        if padded is None:
            return None
        token_ids, positions, tables = decode_arrays(states)
        if tables.shape[1] > self.buffers.max_blocks_per_seq:
            return None
        return self.buffers.fill(token_ids, positions, tables, self.block_size, padded,
                                 token_slots)

    def eager(self, step: DecodeStep, kv_caches: list[torch.Tensor]) -> torch.Tensor:
        """The forward a graph records: hidden states [step.padded, hidden_size]."""
        if not step.lora:
            return self.forward(step.input_ids, step.positions, kv_caches, step.meta)
        return self.forward(step.input_ids, step.positions, kv_caches, step.meta,
                            self.lora_view(step.token_slots))

    @torch.inference_mode()
    def capture(self, kv_caches: list[torch.Tensor]) -> None:
        # the buffers hold padding rows (slot -1, one key of block 0): neither the warm-up
        # nor the recording writes the cache
        self.kv_caches = kv_caches
        pool = None
        for lora in (False, True) if self.takes_lora else (False,):
            for size in reversed(self.sizes):
                step = self.buffers.step(size, size, decode_max_seq_len=1, lora=lora)
                stream = torch.cuda.Stream()
                stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(stream):  # warm-up: autotuning, lazy init off the graph
                    self.eager(step, kv_caches)
                torch.cuda.current_stream().wait_stream(stream)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self.outputs[size, lora] = self.eager(step, kv_caches)
                pool = graph.pool()
                self.graphs[size, lora] = graph
        torch.cuda.synchronize()

    def run(self, step: DecodeStep) -> torch.Tensor:
        """Replay ``step``'s graph: hidden states [step.num_seqs, hidden_size]. The rows are
        the graph's output buffer, valid until the next replay."""
        self.graphs[step.padded, step.lora].replay()
        return self.outputs[step.padded, step.lora][:step.num_seqs]

    @staticmethod
    def measure_bytes(make: Callable[[], CudaGraphDecoder],
                      scratch_caches: list[torch.Tensor]) -> int:
        """Device memory the graphs of ``make()`` hold (their buffers included), captured
        over scratch caches."""
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        before = torch.cuda.memory_reserved()
        decoder = make()
        decoder.capture(scratch_caches)
        used = torch.cuda.memory_reserved() - before
        del decoder
        torch.cuda.empty_cache()
        return max(0, used)


def build_graph_decoder(model: Forward, sizes: Sequence[int], max_model_len: int,
                        block_size: int, device: torch.device,
                        lora_view: LoRAView | None = None) -> CudaGraphDecoder:
    """The decoder the engine wires into its runner: buffers for the largest size and the
    longest sequence, over the model's forward."""
    buffers = DecodeBuffers(max_batch=max(sizes),
                            max_blocks_per_seq=-(-max_model_len // block_size), device=device)
    return CudaGraphDecoder(model, buffers, sizes, block_size, lora_view)
