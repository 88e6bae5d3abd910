"""Graph-ready decode steps on the CPU: capture sizes and padding, fixed buffers whose padded
rows change nothing, the function a graph records (``CudaGraphDecoder.eager`` of the decoder
the engine builds) under FakeTensorMode, which raises on any data-dependent host read (what a
CUDA graph capture cannot contain), and the runner's wiring: decode-only steps go through the
decoder's buffers and ``run``, everything else eagerly. Capturing and replaying real CUDA
graphs needs a GPU: tests/gpu/test_triton_cuda.py and tests/gpu/test_cuda_engine.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch._subclasses.fake_tensor import DataDependentOutputException, FakeTensorMode

pytest.importorskip("triton")

from engine_worker.backends.reference import TorchAttentionBackend  # noqa: E402
from engine_worker.backends import BACKENDS  # noqa: E402
from engine_worker.model_runner.graphs import (CudaGraphDecoder, DecodeBuffers,  # noqa: E402
                                               build_graph_decoder, capture_sizes,
                                               choose_cuda_graphs, padded_batch_size)
from engine_worker.model_runner.inputs import build_step_inputs  # noqa: E402
from engine_worker.model_runner.runner import RunnerRequestState  # noqa: E402
from engine_worker.weights.loader import load_model  # noqa: E402

BLOCK_SIZE = 16


def test_capture_sizes_and_padding():
    assert capture_sizes(256) == (1, 2, 4, *range(8, 257, 8))
    assert capture_sizes(5) == (1, 2, 4, 5)
    assert capture_sizes(1000)[-1] == 256
    sizes = capture_sizes(64)
    assert [padded_batch_size(n, sizes) for n in (1, 2, 3, 5, 8, 9, 63, 64)] == \
        [1, 2, 4, 8, 8, 16, 64, 64]
    assert padded_batch_size(65, sizes) is None  # larger batches run eagerly


def test_fill_pads_with_rows_that_write_nothing():
    buffers = DecodeBuffers(max_batch=8, max_blocks_per_seq=4, device=torch.device("cpu"))
    tables = np.array([[3, 1], [2, 0], [5, 6]], dtype=np.int32)
    step = buffers.fill(np.array([7, 8, 9]), np.array([17, 0, 31]), tables, BLOCK_SIZE,
                        padded=4)
    assert (step.num_seqs, step.padded) == (3, 4)
    assert step.input_ids.tolist() == [7, 8, 9, 0]
    assert step.meta.slot_mapping.tolist() == [1 * 16 + 1, 2 * 16 + 0, 6 * 16 + 15, -1]
    assert step.meta.seq_lens.tolist() == [18, 1, 32, 1]
    assert step.meta.query_start_loc.tolist() == [0, 1, 2, 3, 4]
    assert step.meta.decode_max_seq_len == 32
    # the same memory every step: what a captured graph reads
    again = buffers.fill(np.array([1]), np.array([0]), tables[:1], BLOCK_SIZE, padded=1)
    assert again.input_ids.data_ptr() == step.input_ids.data_ptr()
    with pytest.raises(ValueError, match="capacity"):
        buffers.fill(np.zeros(9), np.zeros(9), np.zeros((9, 1), np.int32), BLOCK_SIZE, 9)


@pytest.fixture(scope="module")
def triton_model(tiny_model_dir):
    return load_model(tiny_model_dir, dtype=torch.float32, device=torch.device("cpu"),
                      backend=BACKENDS["triton"].resolve(torch.device("cpu")),
                      max_model_len=256).model


def _caches(model, num_blocks=8):
    cfg = model.cfg
    torch.manual_seed(0)
    return [torch.randn(2, num_blocks, BLOCK_SIZE, cfg.num_kv_heads, cfg.head_dim)
            for _ in range(cfg.num_layers)]


def _state(token_ids, block_ids):
    return RunnerRequestState(req_id=str(block_ids), token_ids=token_ids,
                              num_prompt_tokens=len(token_ids), params=None,
                              block_ids=block_ids, num_computed_tokens=len(token_ids) - 1,
                              generator=None)


def test_padded_decode_equals_unpadded_reference(triton_model):
    """Three decodes padded to four rows through the Triton backend (interpreter) give the
    reference backend's hidden states for the three, and the same cache contents."""
    states = [_state(list(range(1, 20)), [3, 1]), _state([5], [2]),
              _state(list(range(40, 72)), [5, 6])]
    caches = _caches(triton_model)
    ref_caches = [c.clone() for c in caches]
    before = [c.clone() for c in caches]
    buffers = DecodeBuffers(max_batch=8, max_blocks_per_seq=4, device=torch.device("cpu"))
    step = buffers.fill(np.array([s.token_ids[-1] for s in states]),
                        np.array([len(s.token_ids) - 1 for s in states]),
                        np.array([[3, 1], [2, 0], [5, 6]], np.int32), BLOCK_SIZE, padded=4)
    with torch.inference_mode():
        got = triton_model(step.input_ids, step.positions, caches, step.meta)[:3]
        ids, pos, meta, _ = build_step_inputs(states, [1, 1, 1], BLOCK_SIZE,
                                              torch.device("cpu"))
        # the reference: the layers one by one (not the backend's fused stack), torch attention
        triton_attention = triton_model.layers[0].self_attn.attention
        stack, triton_model.layer_stack = triton_model.layer_stack, None
        for layer in triton_model.layers:
            layer.self_attn.attention = TorchAttentionBackend()
        try:
            want = triton_model(ids, pos, ref_caches, meta)
        finally:
            triton_model.layer_stack = stack
            for layer in triton_model.layers:
                layer.self_attn.attention = triton_attention
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    written = [1 * 16 + 2, 2 * 16 + 0, 6 * 16 + 15]  # each request's new slot
    untouched = [i for i in range(8 * BLOCK_SIZE) if i not in written]
    for c, r, b in zip(caches, ref_caches, before):
        # the same K/V (rows of a 4-row matmul against a 3-row one: last-bit differences)
        torch.testing.assert_close(c, r, atol=1e-5, rtol=1e-5)
        # and nothing else: the padding row (slot -1) wrote no slot
        flat, orig = c.view(2, -1, *c.shape[3:]), b.view(2, -1, *b.shape[3:])
        assert torch.equal(flat[:, untouched], orig[:, untouched])


def test_the_recorded_decode_has_no_data_dependent_host_reads(triton_model):
    """The decoder the engine wires in, on a step its ``prepare`` filled: ``eager`` is exactly
    what ``capture`` records, and it runs under FakeTensorMode."""
    decoder = build_graph_decoder(triton_model, capture_sizes(8), max_model_len=64,
                                  block_size=BLOCK_SIZE, device=torch.device("cpu"))
    states = [_state(list(range(1, 19)), [3, 1]), _state([5], [2]),
              _state(list(range(40, 72)), [5, 6])]
    step = decoder.prepare(states, [1, 1, 1])
    assert (step.num_seqs, step.padded) == (3, 4)
    caches = _caches(triton_model)
    with torch.inference_mode(), FakeTensorMode(allow_non_fake_inputs=True):
        hidden = decoder.eager(step, caches)
        logits = triton_model.compute_logits(hidden)
        tokens = logits.argmax(dim=-1)
        assert tokens.shape == (4,)
        # the check has teeth: a host read of a device value raises in this mode
        with pytest.raises(DataDependentOutputException):
            int(step.meta.seq_lens.max())


def test_prepare_takes_decode_only_steps_that_fit():
    decoder = build_graph_decoder(lambda *a: None, (1, 2, 4), max_model_len=64,
                                  block_size=BLOCK_SIZE, device=torch.device("cpu"))
    assert decoder.buffers.max_batch == 4 and decoder.buffers.max_blocks_per_seq == 4
    decodes = [_state(list(range(1, 19)), [3, 1]), _state([5], [2])]
    assert decoder.prepare(decodes, [1, 1]).padded == 2
    assert decoder.prepare(decodes, [1, 2]) is None  # a prefill chunk: eager
    assert decoder.prepare(decodes * 3, [1] * 6) is None  # above the largest size: eager
    assert decoder.prepare([_state([1], [0, 1, 2, 3, 4])], [1]) is None  # wider than the buffers
    step = decoder.prepare([decodes[0]], [1])
    assert (step.input_ids.tolist(), step.positions.tolist()) == ([18], [17])


def test_graphs_are_chosen_only_where_they_can_run():
    cuda = torch.device("cuda")  # a device name only: nothing runs on it here
    args = {"enforce_eager": False, "attention": "triton", "fused_layers": False,
            "max_num_seqs": 256, "max_num_batched_tokens": 2048}
    assert choose_cuda_graphs(device=torch.device("cpu"), **args).describe() == "off (cpu)"
    assert choose_cuda_graphs(device=cuda, **args | {"enforce_eager": True}).describe() == \
        "off (enforce_eager)"
    off = choose_cuda_graphs(device=cuda, **args | {"attention": "torch"})
    assert not off.enabled and "torch attention" in off.reason
    on = choose_cuda_graphs(device=cuda, **args)
    assert on.enabled and on.sizes == capture_sizes(256)
    assert on.describe() == "on (35 batch sizes, 1 to 256)"
    # a decode batch is at most max_num_batched_tokens rows
    assert choose_cuda_graphs(device=cuda, **args | {"max_num_batched_tokens": 20}).sizes == \
        (1, 2, 4, 8, 16, 20)


class _EagerReplay(CudaGraphDecoder):
    """A decoder whose "replay" runs the recorded function eagerly on the buffers: the
    runner's graph path end to end on a CPU, graphs aside."""

    def capture(self, kv_caches):
        self.kv_caches = kv_caches
        self.replayed: list[tuple[int, int]] = []

    def run(self, step):
        self.replayed.append((step.num_seqs, step.padded) + ((True,) if step.lora else ()))
        return self.eager(step, self.kv_caches)[:step.num_seqs]


def test_the_runner_replays_decode_steps_and_runs_the_rest_eagerly(tiny_model_dir):
    from engine_worker import LLM, SamplingParams

    def generate(llm):
        params = [SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                  SamplingParams(temperature=0.8, seed=5, max_tokens=8, ignore_eos=True,
                                 logprobs=1),
                  SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)]
        prompts = [{"prompt_token_ids": list(range(3, 3 + n))} for n in (20, 7, 33)]
        return [(o.outputs[0].token_ids, [tuple(lp) for lp in o.outputs[0].logprobs or []])
                for o in llm.generate(prompts, params, use_tqdm=False)]

    # the configuration graphs run in: Triton attention (the interpreter here), whose cache
    # write skips the padding rows' slot -1
    llm = LLM(str(tiny_model_dir), dtype="float32", kernels="torch", attention_backend="triton",
              max_model_len=128, kv_cache_memory_bytes=1 << 22, enable_prefix_caching=False)
    eager = generate(llm)
    runner = llm.engine.runner
    decoder = _EagerReplay(runner.model, DecodeBuffers(4, 8, torch.device("cpu")), (1, 2, 4),
                           BLOCK_SIZE)
    decoder.capture(runner.kv_caches)
    runner.graphs = decoder
    got = generate(llm)
    assert [tokens for tokens, _ in got] == [tokens for tokens, _ in eager]
    for (_, lps), (_, want) in zip(got, eager):
        assert [list(d) for d in lps] == [list(d) for d in want]  # same tokens ranked
    # 3 decodes padded to 4, then 2 padded to 2 once the short request is done
    assert (3, 4) in decoder.replayed and (2, 2) in decoder.replayed
    assert len(decoder.replayed) == 7  # the prefill step (first tokens) ran eagerly


def test_lora_decode_steps_replay_through_the_fused_triton_stack(tiny_model_dir,
                                                                 tmp_path_factory):
    """LoRA under graphs: the Triton backend (the interpreter here) with the Triton LoRA pair,
    whose graph view reads each row's slot from the decoder's fixed buffer. A batch mixing two
    adapters and the base decodes through the graph path (the fused stack adding each
    adapter's delta) token-identical to transformers + PEFT; the recorded function with the
    LoRA view has no host read of a device value."""
    from engine_worker import LLM, LoRARequest, SamplingParams
    from tests.e2e.lora_adapters import make_adapter
    from tests.e2e.test_lora import MAX_TOKENS, PROMPTS, _hf_greedy

    root = tmp_path_factory.mktemp("lora-graphs")
    loras = [LoRARequest(f"a{i}", i + 1, make_adapter(tiny_model_dir, root / f"a{i}", r=8,
                                                      seed=10 + i)) for i in range(2)]
    cases = [(loras[0], 0), (None, 3), (loras[1], 2)]  # short prompts: the interpreter is slow
    want = [_hf_greedy(tiny_model_dir, lora)[i] for lora, i in cases]
    llm = LLM(str(tiny_model_dir), dtype="float32", kernels="triton", max_model_len=128,
              kv_cache_memory_bytes=1 << 22, enable_prefix_caching=False, enable_lora=True,
              max_loras=2, max_lora_rank=8)
    manager = llm.engine._lora
    assert manager.ops.name == "triton" and manager.graph_ready
    runner = llm.engine.runner
    assert runner.model.layer_stack.takes_lora(manager.graph_batch(torch.zeros(1).long()))
    decoder = _EagerReplay(runner.model, DecodeBuffers(8, 8, torch.device("cpu")), (1, 2, 4, 8),
                           BLOCK_SIZE, lora_view=manager.graph_batch)
    decoder.capture(runner.kv_caches)
    runner.graphs = decoder
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": PROMPTS[i]} for _, i in cases], params,
                           use_tqdm=False, lora_request=[lora for lora, _ in cases])
    assert [o.outputs[0].token_ids for o in outputs] == want
    assert (3, 4, True) in decoder.replayed  # the mixed decodes replayed, padded with base rows

    states = [_state(list(range(1, 19)), [3, 1]), _state([5], [2]),
              _state(list(range(40, 72)), [5, 6])]
    step = decoder.prepare(states, [1, 1, 1], token_slots=[1, 0, 2])
    assert step.token_slots.tolist() == [1, 0, 2, 0] and step.lora
    assert not decoder.prepare(states, [1, 1, 1]).lora  # the base alone: the graphs without
    with torch.inference_mode(), FakeTensorMode(allow_non_fake_inputs=True):
        assert decoder.eager(step, _caches(runner.model)).shape[0] == 4
