"""Every decoder layer in one call (``quire.llama_layers``) against the per-layer path.

The op runs the fused halves, the cache write and the paged-attention kernel of each layer in
the order the per-layer path calls them, so a whole generation must be bit-identical with and
without it: the same tokens and the same logprobs, over steps that mix decodes with chunked
prefills. The per-layer path is itself checked against the references in test_llama_blocks.py
and test_cpu_kernels.py.
"""

from __future__ import annotations

import pytest
import torch

from engine_worker import LLM, SamplingParams
from tests.conftest import build_tiny_model

pytestmark = pytest.mark.usefixtures("cpu_isa")  # once per variant this CPU runs
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
    model_dir = _stack_model(tmp_path_factory, embedded_model_dir, arch, attention_bias)
    # 32 tokens a step: the long prompts prefill in chunks next to the others' decodes
    llm = LLM(str(model_dir), dtype="bfloat16", kernels="cpu", max_num_batched_tokens=32,
              kv_cache_memory_bytes=1 << 24)
    model = llm.engine.runner.model
    assert model.layer_stack is not None
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


@pytest.mark.parametrize("dtype, kernels", [("float32", "cpu"), ("bfloat16", "torch")])
def test_layers_run_one_by_one_where_the_op_does_not_apply(stack_model_dir, dtype, kernels,
                                                          cpu_isa):
    if kernels == "cpu" and cpu_isa != "avx512":
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

    llm = LLM(str(stack_model_dir), dtype="bfloat16", kernels="cpu", kv_cache_memory_bytes=1 << 24)
    engine = llm.engine
    profiler = StepProfiler(engine)
    engine.add_request("a", {"prompt_token_ids": list(range(100, 140))},
                       SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    split = profiler.split_ms()
    assert set(split) == set(PARTS) and profiler.num_steps == 6
    # attention ran inside the one kernel call, and the op's own counter reported it
    assert profiler.stack_attention_ns.item() > 0
    assert split["attention"] > 0 and split["model"] > 0
    profiler.reset()
    assert profiler.stack_attention_ns.item() == 0 and profiler.num_steps == 0
