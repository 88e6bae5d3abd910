"""Every decoder layer in one call (``llama_layers``) against the per-layer path.

The op runs the fused halves, the cache write and the paged-attention kernel of each layer in
the order the per-layer path calls them, so a whole generation must be bit-identical with and
without it: the same tokens and the same logprobs, over steps that mix decodes with chunked
prefills (``cpu``, bf16; and on a model's native GGUF blocks, each set), and a whole model's
logits and caches (``cpu-avx2``, fp32). The per-layer path is itself checked against the
references in test_llama_blocks.py and test_cpu_kernels.py.
"""

from __future__ import annotations

import random

import pytest
import torch

from engine_worker import LLM, SamplingParams
from engine_worker.backends.reference import REFERENCE
from engine_worker.layers.rotary import RopeConfig
from engine_worker.models.llama import LlamaConfig, LlamaForCausalLM
from tests.attention_steps import STEPS, make_step
from tests.conftest import build_tiny_model
from tests.unit.ops.onednn import skip_without_onednn_bf16

pytestmark = pytest.mark.usefixtures("cpu_kernels")  # once per variant this CPU runs
# bf16 through kernels.py's cpu path: the AVX-512 packed-weight layouts (the AVX2 kernels pack
# bf16 weights their own way)
PACKED_BF16 = pytest.mark.cpu_ops("pack_coded", "pack_skinny", "skinny_linear_packed")


def _stack_model(tmp_path_factory, embedded_model_dir, arch, attention_bias=False):
    # head_dim 64 and hidden 128: shapes the one-call path takes (multiples of 32)
    return build_tiny_model(tmp_path_factory.mktemp(f"tiny-stack-{arch}"), embedded_model_dir,
                            arch=arch, hidden_size=128, num_heads=2, num_kv_heads=1,
                            num_layers=3, attention_bias=attention_bias)


@pytest.fixture(scope="module")
def stack_model_dir(tmp_path_factory, embedded_model_dir):
    return _stack_model(tmp_path_factory, embedded_model_dir, "llama")


def _generate(llm: LLM):
    prompts = [{"prompt_token_ids": list(range(100 + i, 100 + i + n))}
               for i, n in enumerate((3, 40, 17, 90, 9))]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=3)
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in llm.generate(prompts, params)]


@PACKED_BF16
# qwen2: a bias on q, k and v; llama with attention_bias: on q, k, v and o_proj
@pytest.mark.parametrize("arch, attention_bias", [("llama", False), ("qwen2", False),
                                                  ("llama", True)])
def test_one_call_layers_are_the_per_layer_path_bit_for_bit(tmp_path_factory,
                                                            embedded_model_dir, arch,
                                                            attention_bias):
    skip_without_onednn_bf16()  # the one-call stack takes oneDNN's packed weights
    model_dir = _stack_model(tmp_path_factory, embedded_model_dir, arch, attention_bias)
    # 32 tokens a step: the long prompts prefill in chunks next to the others' decodes
    llm = LLM(str(model_dir), dtype="bfloat16", kernels="cpu", max_num_batched_tokens=32,
              kv_cache_memory_bytes=1 << 24)
    model = llm.engine.runner.model
    assert model.layer_stack is not None
    # the embedding lookup and the final norm run inside the stack's call (the folded ends)
    assert model._stack_ends is not None
    qkv = model.layers[0].self_attn.qkv_proj
    assert (qkv.bias is not None) == (arch == "qwen2" or attention_bias)
    assert (model.layers[0].self_attn.o_proj.bias is not None) == attention_bias
    assert qkv.packed.skinny.dtype == torch.uint8  # the decodes stream the coded layout
    with_stack = _generate(llm)
    assert llm.engine.reset_prefix_cache()  # the second run computes every prompt again
    model.layer_stack = None
    per_layer = _generate(llm)
    assert with_stack == per_layer
    assert all(len(tokens) == 12 for tokens, _ in with_stack)


@pytest.mark.parametrize("qtype", ["Q4_1", "Q8_0"])
def test_one_call_layers_on_native_gguf_blocks_are_the_per_layer_path_bit_for_bit(
        stack_model_dir, tmp_path, monkeypatch, cpu_kernels, qtype):
    # the model's GGUF blocks multiplied natively (quant_linear.cpp) inside the stack: the
    # decode steps (5 rows) on the int8 kernel, the steps with a prefill chunk too (a bf16 or
    # fp32 model keeps its Q4_1 / Q8_0 linears there at every size). fp32 on the AVX2 set,
    # whose stack carries a bf16 model in fp32 where its per-layer path does not.
    from gguf import GGMLQuantizationType

    from tests.conftest import CPU_BACKEND_OF_ISA
    from tests.unit.test_gguf_weights import write_gguf

    monkeypatch.setenv("QUIRE_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "stack.gguf"
    write_gguf(stack_model_dir, path, GGMLQuantizationType[qtype])
    llm = LLM(str(path), tokenizer=str(stack_model_dir), quantization="gguf",
              dtype="bfloat16" if cpu_kernels.isa == "avx512" else "float32",
              kernels=CPU_BACKEND_OF_ISA[cpu_kernels.isa], max_num_batched_tokens=32,
              kv_cache_memory_bytes=1 << 24)
    model = llm.engine.runner.model
    assert model.layer_stack is not None and model._stack_ends is not None
    with_stack = _generate(llm)
    assert llm.engine.reset_prefix_cache()
    model.layer_stack = None
    per_layer = _generate(llm)
    assert with_stack == per_layer
    assert all(len(tokens) == 12 for tokens, _ in with_stack)


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_native_gguf_decodes_run_as_one_team_on_more_threads(stack_model_dir, tmp_path,
                                                            monkeypatch, cpu_kernels, threads):
    # llama_block.cpp's team path (one parallel region a layer, the linears' rows shared out
    # between its members) takes the decode steps of an all-Q4_1 stack on two threads or
    # more, not on one; either way the tokens are the per-layer path's
    from gguf import GGMLQuantizationType

    from tests.conftest import CPU_BACKEND_OF_ISA
    from tests.unit.test_gguf_weights import write_gguf

    monkeypatch.setenv("QUIRE_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "stack.gguf"
    write_gguf(stack_model_dir, path, GGMLQuantizationType.Q4_1)
    llm = LLM(str(path), tokenizer=str(stack_model_dir), quantization="gguf",
              dtype="bfloat16" if cpu_kernels.isa == "avx512" else "float32",
              kernels=CPU_BACKEND_OF_ISA[cpu_kernels.isa], num_threads=threads,
              max_num_batched_tokens=32, kv_cache_memory_bytes=1 << 24)
    calls = cpu_kernels.ops.layer_team_calls
    before = calls()
    with_stack = _generate(llm)
    assert (calls() > before) == (threads > 1)
    assert llm.engine.reset_prefix_cache()
    llm.engine.runner.model.layer_stack = None
    assert _generate(llm) == with_stack


@pytest.fixture(scope="module")
def three_kv_heads_gguf(tmp_path_factory, embedded_model_dir):
    # SmolLM2's grouping at a small size: 3 kv heads of 2 query heads each, head_dim 64
    from gguf import GGMLQuantizationType

    from tests.unit.test_gguf_weights import write_gguf

    model_dir = build_tiny_model(tmp_path_factory.mktemp("tiny-kv3"), embedded_model_dir,
                                 hidden_size=384, num_heads=6, num_kv_heads=3, num_layers=2)
    path = model_dir / "model-q4_1.gguf"
    write_gguf(model_dir, path, GGMLQuantizationType.Q4_1)
    return model_dir, path


def _team_llm(three_kv_heads_gguf, tmp_path, monkeypatch, cpu_kernels):
    from tests.conftest import CPU_BACKEND_OF_ISA

    model_dir, path = three_kv_heads_gguf
    monkeypatch.setenv("QUIRE_CACHE_DIR", str(tmp_path / "cache"))
    return LLM(str(path), tokenizer=str(model_dir), quantization="gguf",
               dtype="bfloat16" if cpu_kernels.isa == "avx512" else "float32",
               kernels=CPU_BACKEND_OF_ISA[cpu_kernels.isa], num_threads=2,
               max_num_batched_tokens=64, kv_cache_memory_bytes=1 << 24)


def test_team_attention_is_the_per_layer_paths_past_every_split(three_kv_heads_gguf, tmp_path,
                                                                monkeypatch, cpu_kernels):
    # A lone decode on the team path: its attention's work items shared by the members, its 3
    # kv heads as items of their own from 32 keys (one item below: 10 keys), and past 128 keys
    # each kv head's keys split in parts merged after (on AVX-512 BF16's kernel and on the
    # fp32 path): every token and logprob the per-layer path's
    llm = _team_llm(three_kv_heads_gguf, tmp_path, monkeypatch, cpu_kernels)
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=3)

    def generate():
        return [(o.outputs[0].token_ids, o.outputs[0].logprobs)
                for n in (10, 40, 150) for o in
                llm.generate([{"prompt_token_ids": list(range(200, 200 + n))}], params)]

    before = cpu_kernels.ops.layer_team_calls()
    team = generate()
    assert cpu_kernels.ops.layer_team_calls() - before >= 3 * 9  # every decode step
    assert llm.engine.reset_prefix_cache()
    llm.engine.runner.model.layer_stack = None
    assert generate() == team


def _recorded_decode(llm):
    """One request's greedy tokens, the stack's last one-row call recorded on the way:
    -> (tokens, prompt, params, that call's (x, positions, kv_caches, meta))."""
    model = llm.engine.runner.model
    stack, seen = model.layer_stack, []

    def recording(x, positions, kv_caches, meta, **kwargs):
        if x.shape[0] == 1:
            seen.append((x.clone(), positions.clone(), kv_caches, meta))
        return stack(x, positions, kv_caches, meta, **kwargs)

    model.layer_stack = recording
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    prompt = {"prompt_token_ids": list(range(300, 340))}
    try:
        tokens = llm.generate([prompt], params)[0].outputs[0].token_ids
    finally:
        model.layer_stack = stack
    return tokens, prompt, params, seen[-1]


def test_a_bad_cache_slot_in_the_team_is_an_error_and_the_engine_goes_on(
        three_kv_heads_gguf, tmp_path, monkeypatch, cpu_kernels):
    # the cache write runs inside the team's one parallel region: its error (a slot past the
    # cache) must come out after the region as an exception, not end the process
    import dataclasses

    llm = _team_llm(three_kv_heads_gguf, tmp_path, monkeypatch, cpu_kernels)
    stack = llm.engine.runner.model.layer_stack
    first, prompt, params, (x, positions, kv_caches, meta) = _recorded_decode(llm)
    num_slots = kv_caches[0].shape[1] * kv_caches[0].shape[2]
    bad = dataclasses.replace(meta, slot_mapping=torch.tensor([num_slots + 5]))
    before = cpu_kernels.ops.layer_team_calls()
    with pytest.raises(RuntimeError, match="slot out of range"):
        stack(x, positions, kv_caches, bad)
    assert cpu_kernels.ops.layer_team_calls() == before + 1  # it was the team path
    assert llm.engine.reset_prefix_cache()
    assert llm.generate([prompt], params)[0].outputs[0].token_ids == first


def test_the_stack_keeps_its_caches_and_decode_buffers_across_calls(
        three_kv_heads_gguf, tmp_path, monkeypatch, cpu_kernels):
    # llama_layers holds the engine's KV caches (handed over once; a call passes none) and a
    # decode's buffers (kept from call to call): an output the caller holds is never a kept
    # buffer, the same input gives the same bits call after call, a change of thread count
    # makes the team's buffers again, and caches that do not fit the stack are refused
    llm = _team_llm(three_kv_heads_gguf, tmp_path, monkeypatch, cpu_kernels)
    model = llm.engine.runner.model
    stack = model.layer_stack
    first, prompt, params, (_, positions, kv_caches, meta) = _recorded_decode(llm)
    assert len(stack.held_caches) == len(kv_caches)
    assert all(a is b for a, b in zip(stack.held_caches, llm.engine.runner.kv_caches))
    gen = torch.Generator().manual_seed(0)
    hidden = model.cfg.hidden_size
    x1, x2 = (torch.randn(1, hidden, generator=gen).to(stack.activation_dtype)
              for _ in range(2))
    # without the folded ends the call returns the last layer's rows, the buffer the team
    # writes: the caller gets its own copy
    teams = cpu_kernels.ops.layer_team_calls
    before = teams()
    out1 = stack(x1, positions, kv_caches, meta)
    held = out1.clone()
    out2 = stack(x2, positions, kv_caches, meta)
    assert teams() == before + 2  # both ran as the team (two threads)
    assert torch.equal(out1, held) and not torch.equal(out1, out2)
    assert torch.equal(stack(x1, positions, kv_caches, meta), held)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)  # the per-linear path: the same bits
        assert torch.equal(stack(x1, positions, kv_caches, meta), held)
        torch.set_num_threads(2)  # the team again, on buffers made for two members
        assert torch.equal(stack(x1, positions, kv_caches, meta), held)
        assert teams() == before + 4
    finally:
        torch.set_num_threads(threads)
    with pytest.raises(RuntimeError, match="one KV cache a layer"):
        stack.weights.set_kv_caches(kv_caches[:-1])
    odd = [kv_caches[0], kv_caches[1][:, :-1].contiguous()]
    with pytest.raises(RuntimeError, match="shaped and typed alike"):
        stack.weights.set_kv_caches(odd)
    assert llm.engine.reset_prefix_cache()  # the refusals left the held caches as they were
    assert llm.generate([prompt], params)[0].outputs[0].token_ids == first


@pytest.mark.parametrize("dtype, kernels", [("float32", "cpu"), ("bfloat16", "torch")])
def test_layers_run_one_by_one_where_the_op_does_not_apply(stack_model_dir, dtype, kernels,
                                                          cpu_kernels):
    if kernels == "cpu" and cpu_kernels.isa != "avx512":
        pytest.skip("the cpu backend is the AVX-512 set (cpu-avx2 fuses fp32 layers too)")
    llm = LLM(str(stack_model_dir), dtype=dtype, kernels=kernels, kv_cache_memory_bytes=1 << 24)
    assert llm.engine.runner.model.layer_stack is None
    tokens, _ = _generate(llm)[0]
    assert len(tokens) == 12


@PACKED_BF16
def test_head_size_the_op_does_not_take_runs_one_by_one(tiny_model_dir):
    llm = LLM(str(tiny_model_dir), dtype="bfloat16", kernels="cpu", kv_cache_memory_bytes=1 << 24)
    assert llm.engine.runner.model.cfg.head_dim % 32 != 0
    assert llm.engine.runner.model.layer_stack is None


@PACKED_BF16
def test_step_profiler_reads_attention_time_from_the_one_call_layers(stack_model_dir):
    from quire_cli.bench.step_profile import PARTS, StepProfiler

    skip_without_onednn_bf16()

    llm = LLM(str(stack_model_dir), dtype="bfloat16", kernels="cpu", kv_cache_memory_bytes=1 << 24)
    engine = llm.engine
    profiler = StepProfiler(engine)
    engine.add_request("a", {"prompt_token_ids": list(range(100, 140))},
                       SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    split = profiler.split_ms()
    # the prefill's pass, then one multi-step run of 5 (LLM's num_scheduler_steps is 8)
    assert set(split) == set(PARTS) and profiler.num_passes == 6 and profiler.num_steps == 2
    # attention ran inside the one kernel call, and the op's own counter reported it
    assert profiler.stack_attention_ns.item() > 0
    assert split["attention"] > 0 and split["model"] > 0
    profiler.reset()
    assert profiler.stack_attention_ns.item() == 0 and profiler.num_steps == 0
    assert profiler.num_passes == 0


# ---------------------------------------------------------------- cpu-avx2: fp32 activations

NUM_BLOCKS = 96


def _tiny_llama(backend, bias: bool) -> LlamaForCausalLM:
    # head_dim 32, every output size a multiple of 16 (the panels')
    cfg = LlamaConfig(vocab_size=512, hidden_size=192, intermediate_size=256, num_layers=3,
                      num_heads=6, num_kv_heads=2, head_dim=32, rms_norm_eps=1e-5,
                      rope=RopeConfig(head_dim=32, theta=10000.0, max_position_embeddings=1024),
                      tie_word_embeddings=True, qkv_bias=bias, o_bias=bias)
    return LlamaForCausalLM(cfg, backend, 1024, torch.device("cpu"))


def _run(model, meta, input_ids, positions, caches):
    caches = [c.clone() for c in caches]
    with torch.no_grad():
        hidden = model(input_ids, positions, caches, meta)
        return model.compute_logits(hidden), caches


@pytest.mark.cpu_ops("pack_bf16w", "linear_bf16w")
@pytest.mark.parametrize("bias", [False, True])
def test_llama_on_avx2_kernels(bias, cpu_kernels):
    """A whole model on this set: in fp32 the one-call layers are the per-layer path bit for
    bit, and both the reference's result; a bf16 model (bf16 weights and cache, its layers'
    activations in fp32) is the fp32 model of its bf16 values up to the cache's rounding."""
    torch.manual_seed(3)
    reference = _tiny_llama(REFERENCE, bias)
    with torch.no_grad():
        for p in reference.parameters():
            p.copy_(torch.randn_like(p) / p.shape[-1] ** 0.5 + (1 if p.dim() == 1 else 0))
    rng = random.Random(5)
    meta = make_step(rng, STEPS["mixed"], 16, NUM_BLOCKS)
    num_tokens = int(meta.query_start_loc[-1])
    input_ids = torch.randint(0, 512, (num_tokens,))
    positions = torch.cat([torch.arange(int(n) - int(e - s), int(n)) for n, s, e in zip(
        meta.seq_lens, meta.query_start_loc[:-1], meta.query_start_loc[1:])])
    caches = [torch.randn(2, NUM_BLOCKS, 16, 2, 32) for _ in range(3)]
    reference.pack_weights()
    want, want_caches = _run(reference, meta, input_ids, positions, caches)

    model = _tiny_llama(cpu_kernels.backend, bias)
    model.load_state_dict(reference.state_dict())
    model.pack_weights()
    assert model.layer_stack is not None
    stacked, stacked_caches = _run(model, meta, input_ids, positions, caches)
    model.layer_stack = None
    per_layer, per_layer_caches = _run(model, meta, input_ids, positions, caches)
    assert torch.equal(stacked, per_layer)
    assert all(torch.equal(a, b) for a, b in zip(stacked_caches, per_layer_caches))
    torch.testing.assert_close(stacked, want, atol=1e-3, rtol=1e-3)

    # bf16: the reference in fp32 over the bf16-rounded weights and cache
    with torch.no_grad():
        for p in reference.parameters():
            p.copy_(p.bfloat16().float())
    reference.pack_weights()
    bf16_caches = [c.bfloat16() for c in caches]
    want, _ = _run(reference, meta, input_ids, positions,
                   [c.float() for c in bf16_caches])
    model = _tiny_llama(cpu_kernels.backend, bias).to(torch.bfloat16)
    model.load_state_dict(reference.state_dict())
    model.pack_weights()
    assert model.layer_stack is not None
    assert model.layers[0].self_attn.qkv_proj.packed is not None
    got, _ = _run(model, meta, input_ids, positions, bf16_caches)
    # logits rounded to bf16 (the model's dtype) at the end: one bf16 step of logits ~10
    torch.testing.assert_close(got.float(), want, atol=0.05, rtol=0.02)
