"""LoRA inside the one-call layer stack (``llama_layers`` with ``lora_weights`` and
``lora_slots``, csrc/cpu/llama_block.cpp) against the per-layer path under the same adapters
(the same kernels in the same order: bit for bit) and against the reference backend's model
with the reference LoRA pair; over a step of decodes (the kernels' vector tiles) and a mixed
step whose prefills give slots many tokens (their matmul path), base tokens between."""

from __future__ import annotations

import random

import pytest
import torch

from engine_worker.backends.base import stack_takes_lora
from engine_worker.backends.reference import REFERENCE
from engine_worker.layers.rotary import RopeConfig
from engine_worker.lora.adapter import LoRAAdapter, LoRAModule
from engine_worker.lora.ops import REFERENCE_OPS, cpu_kernel_ops
from engine_worker.lora.slots import LoRASlots
from engine_worker.models.llama import LlamaConfig, LlamaForCausalLM
from tests.attention_steps import STEPS, make_step
from tests.unit.ops.onednn import skip_without_onednn_bf16
from tests.unit.ops.weights import weights_to

pytestmark = pytest.mark.usefixtures("cpu_kernels")

NUM_BLOCKS = 96
SEQ_SLOTS = [1, 2, 1, 0, 3]  # the step's sequences' adapter slots (0: the base model)


def _tiny_llama(backend) -> LlamaForCausalLM:
    # head_dim 32, every output size a multiple of 16: shapes both sets' stacks take
    cfg = LlamaConfig(vocab_size=512, hidden_size=192, intermediate_size=256, num_layers=3,
                      num_heads=6, num_kv_heads=2, head_dim=32, rms_norm_eps=1e-5,
                      rope=RopeConfig(head_dim=32, theta=10000.0, max_position_embeddings=1024),
                      tie_word_embeddings=True)
    return LlamaForCausalLM(cfg, backend, 1024, torch.device("cpu"))


def _adapter(model: LlamaForCausalLM, name: str, rank: int, seed: int,
             modules: tuple[str, ...] | None = None) -> LoRAAdapter:
    g = torch.Generator().manual_seed(seed)
    sizes = {m: (i, o) for mods in model.lora_projections().values() for m, i, o in mods}
    return LoRAAdapter(name, f"/{name}", rank, {
        (layer, m): LoRAModule(torch.randn(rank, sizes[m][0], generator=g) / sizes[m][0] ** 0.5,
                               torch.randn(sizes[m][1], rank, generator=g) * 0.2, 2.0)
        for layer in range(model.cfg.num_layers) for m in (modules or sizes)})


def _batch(model, adapters, token_slots, ops, dtype):
    slots = LoRASlots(model.lora_projections(), model.cfg.num_layers, len(adapters), 8, dtype,
                      torch.device("cpu"), ops.b_rank_major)
    slot_of = slots.activate(adapters)
    assert [slot_of[a.name] for a in adapters] == [1, 2, 3]
    return slots.batch(token_slots, ops, torch.device("cpu"))


def _run(model, meta, input_ids, positions, caches, lora):
    caches = [c.clone() for c in caches]
    with torch.no_grad():
        return model(input_ids, positions, caches, meta, lora), caches


@pytest.mark.cpu_ops("lora_shrink", "lora_expand")
@pytest.mark.parametrize("step", ["decodes", "mixed"])
def test_lora_in_the_one_call_layers(cpu_kernels, step):
    # the stack's activation dtype: fp32 models on the AVX2 set, bf16 on the AVX-512 set
    dtype = torch.float32 if cpu_kernels.isa == "avx2" else torch.bfloat16
    if dtype == torch.bfloat16:
        skip_without_onednn_bf16()  # the AVX-512 stack takes oneDNN's packed weights
    torch.manual_seed(4)
    reference = _tiny_llama(REFERENCE)
    with torch.no_grad():
        for p in reference.parameters():
            p.copy_(torch.randn_like(p) / p.shape[-1] ** 0.5 + (1 if p.dim() == 1 else 0))
        for p in reference.parameters():  # both sides start from the same (rounded) weights
            p.copy_(p.to(dtype).float())
    reference.pack_weights()
    model = weights_to(_tiny_llama(cpu_kernels.backend), dtype)
    model.load_state_dict(reference.state_dict())
    model.pack_weights()
    assert model.layer_stack is not None and model.layer_stack.lora_dtype == dtype

    rng = random.Random(7)
    meta = make_step(rng, STEPS[step], 16, NUM_BLOCKS)
    num_tokens = int(meta.query_start_loc[-1])
    input_ids = torch.randint(0, 512, (num_tokens,))
    positions = torch.cat([torch.arange(int(n) - int(e - s), int(n)) for n, s, e in zip(
        meta.seq_lens, meta.query_start_loc[:-1], meta.query_start_loc[1:])])
    token_slots = [slot for slot, s, e in zip(SEQ_SLOTS, meta.query_start_loc[:-1],
                                              meta.query_start_loc[1:])
                   for _ in range(int(e - s))]
    caches = [torch.randn(2, NUM_BLOCKS, 16, 2, 32).to(dtype) for _ in range(3)]
    adapters = [_adapter(model, "a", 8, 1), _adapter(model, "b", 4, 2),
                _adapter(model, "c", 8, 3, modules=("q_proj", "v_proj", "down_proj"))]

    kernel_batch = _batch(model, adapters, token_slots,
                          cpu_kernel_ops("under-test", cpu_kernels.ops), dtype)
    assert stack_takes_lora(model.layer_stack, kernel_batch)
    stacked, stacked_caches = _run(model, meta, input_ids, positions, caches, kernel_batch)
    base, _ = _run(model, meta, input_ids, positions, caches, None)
    stack = model.layer_stack
    model.layer_stack = None
    per_layer, per_layer_caches = _run(model, meta, input_ids, positions, caches, kernel_batch)
    model.layer_stack = stack
    assert torch.equal(stacked, per_layer)
    assert all(torch.equal(a, b) for a, b in zip(stacked_caches, per_layer_caches))

    want, _ = _run(reference, meta, input_ids, positions, [c.float() for c in caches],
                   _batch(reference, adapters, token_slots, REFERENCE_OPS, torch.float32))
    if dtype == torch.float32:
        torch.testing.assert_close(stacked, want, atol=1e-3, rtol=1e-3)
    else:
        # bf16 with these strong adapters (deltas the size of the projections) drifts from
        # fp32 by up to 0.22 in the mixed step in any implementation: the reference backend's
        # own bf16 run is the yardstick, the stack no more than twice its distance from fp32
        reference16 = weights_to(_tiny_llama(REFERENCE), dtype)
        reference16.load_state_dict(reference.state_dict())
        reference16.pack_weights()
        want16, _ = _run(reference16, meta, input_ids, positions, caches,
                         _batch(reference16, adapters, token_slots, REFERENCE_OPS, dtype))
        drift = (want16.float() - want).abs().max().item()
        assert drift < 0.5
        torch.testing.assert_close(stacked.float(), want, atol=2 * drift, rtol=0)
    # the base tokens are the base model's, the others moved by their adapters
    is_base = torch.tensor(token_slots) == 0
    assert torch.equal(stacked[is_base], base[is_base])
    assert not torch.allclose(stacked[~is_base].float(), base[~is_base].float(), atol=1e-2)
