"""AWQ / GPTQ checkpoints (engine_worker/weights/int4_checkpoint.py, int4_layouts.py).

First the test checkpoints themselves: what our round-to-nearest quantizer packs
(tests/int4_checkpoints.py) de-quantizes, through the formats' own reference procedures
(AutoAWQ's reverse order, AutoGPTQ's zeros + 1), to exactly the values it quantized. Then the
engine's unpacking against those references, bit for bit, and its two native layouts (GGUF
Q4_0 / Q4_1 blocks for the CPU kernels, int32 groups for the Triton kernel) against the
neutral form. Bad configs name the field and the supported values.
"""

from __future__ import annotations

import pytest
import torch

from engine_worker.weights.gguf_weights import dequantize_blocks
from engine_worker.weights.int4_checkpoint import (Int4Groups, int4_layers, parse_int4_config,
                                                   unpack_awq, unpack_gptq)
from engine_worker.weights.int4_layouts import (LAYOUT_GGUF_BLOCKS, LAYOUT_INT4_GROUPS,
                                                dequantize_int4_groups, int4_layout,
                                                pack_layers, to_gguf_blocks, to_int4_groups)
from tests.int4_checkpoints import (pack_awq, pack_gptq, quantize_rtn, reference_awq,
                                    reference_gptq)

N, K = 48, 256


def _weight(seed: int = 0) -> torch.Tensor:
    return torch.randn(N, K, generator=torch.Generator().manual_seed(seed)) * 0.05


def _expected(codes, zeros, scales, group):
    z = zeros.float().repeat_interleave(group, dim=1)
    s = scales.float().repeat_interleave(group, dim=1)
    return (codes.float() - z) * s


def _cfg(method, **qc):
    return parse_int4_config({"quantization_config": {"quant_method": method, **qc}})


@pytest.mark.parametrize("group", [32, 128])
def test_awq_packing_round_trips_through_autoawq_reference(group):
    codes, zeros, scales = quantize_rtn(_weight(), group, sym=False)
    assert zeros.min() >= 0 and zeros.max() <= 15 and len(zeros.unique()) > 3
    packed = pack_awq(codes, zeros, scales)
    assert packed["qweight"].shape == (K, N // 8) and packed["qweight"].dtype == torch.int32
    want = _expected(codes, zeros, scales, group)
    assert torch.equal(reference_awq(packed["qweight"], packed["qzeros"], packed["scales"],
                                     group), want)
    ours = unpack_awq("l", {f"l.{k}": v for k, v in packed.items()},
                      _cfg("awq", bits=4, group_size=group, version="GEMM", zero_point=True))
    assert torch.equal(ours.codes, codes.to(torch.uint8))
    assert torch.equal(ours.zeros, zeros.to(torch.uint8))
    assert torch.equal(ours.dequantize(), want)
    # the interleave is real: reading the words in plain order gives other columns
    plain = (packed["qweight"][:, :, None] >> torch.arange(0, 32, 4)) & 0xF
    assert not torch.equal(plain.reshape(K, N).t(), codes)


@pytest.mark.parametrize("sym, v2", [(True, False), (False, False), (False, True)])
def test_gptq_packing_round_trips_through_autogptq_reference(sym, v2):
    group = 128
    codes, zeros, scales = quantize_rtn(_weight(1), group, sym=sym, min_zero=0 if v2 else 1)
    packed = pack_gptq(codes, zeros, scales, group, v2=v2)
    assert packed["qweight"].shape == (K // 8, N)
    want = _expected(codes, zeros, scales, group)
    assert torch.equal(reference_gptq(packed["qweight"], packed["qzeros"], packed["scales"],
                                      packed["g_idx"], v2=v2), want)
    if sym:
        assert torch.all(packed["qzeros"] == 0x77777777)  # zero 8 stored as 7
    cfg = _cfg("gptq", bits=4, group_size=group, desc_act=False, sym=sym,
               checkpoint_format="gptq_v2" if v2 else "gptq")
    ours = unpack_gptq("l", {f"l.{k}": v for k, v in packed.items()}, cfg)
    assert torch.equal(ours.dequantize(), want)


def test_gptq_original_format_reads_a_stored_15_as_zero_16():
    codes, zeros, scales = quantize_rtn(_weight(2), 128, sym=False, min_zero=1)
    zeros[0, 0] = 16  # what a stored nibble 15 means in the original format
    packed = pack_gptq(codes, zeros, scales, 128)
    ours = unpack_gptq("l", {f"l.{k}": v for k, v in packed.items()},
                       _cfg("gptq", group_size=128))
    assert ours.zeros[0, 0] == 16
    assert torch.equal(ours.dequantize(), reference_gptq(packed["qweight"], packed["qzeros"],
                                                         packed["scales"], packed["g_idx"]))


def test_act_order_g_idx_is_refused():
    codes, zeros, scales = quantize_rtn(_weight(), 128, sym=True)
    packed = pack_gptq(codes, zeros, scales, 128)
    packed["g_idx"] = packed["g_idx"].flip(0)
    with pytest.raises(ValueError, match="g_idx.*desc_act"):
        unpack_gptq("l", {f"l.{k}": v for k, v in packed.items()}, _cfg("gptq"))


@pytest.mark.parametrize("qc, field", [
    ({"quant_method": "gptq", "bits": 8}, "bits"),
    ({"quant_method": "awq", "bits": 3}, "bits"),
    ({"quant_method": "gptq", "group_size": 100}, "group_size"),
    ({"quant_method": "gptq", "desc_act": True}, "desc_act"),
    ({"quant_method": "awq", "version": "gemv"}, "version"),
    ({"quant_method": "awq", "zero_point": False}, "zero_point"),
    ({"quant_method": "gptq", "checkpoint_format": "marlin"}, "checkpoint_format"),
])
def test_unsupported_configs_name_the_field_and_the_supported_values(qc, field):
    with pytest.raises(ValueError, match=rf"quantization_config\.{field}: .*supported: "):
        parse_int4_config({"quantization_config": qc})


def test_configs_other_than_awq_gptq_are_not_int4():
    assert parse_int4_config({}) is None
    assert parse_int4_config({"quantization_config": {"quant_method": "fp8"}}) is None
    cfg = _cfg("gptq", bits=4, group_size=-1)
    assert cfg.groups(512) == 1 and cfg.zero_point_offset == 1


def _groups(sym: bool, group: int = 128) -> Int4Groups:
    codes, zeros, scales = quantize_rtn(_weight(3), group, sym=sym)
    return Int4Groups(codes.to(torch.uint8), zeros.to(torch.uint8), scales)


def test_symmetric_layers_become_q4_0_blocks_exactly():
    layer = _groups(sym=True)
    blocks = to_gguf_blocks(layer, symmetric=True)
    assert blocks.shape == (N, K // 32, 18) and blocks.dtype == torch.uint8
    assert torch.equal(dequantize_blocks(blocks, torch.float32), layer.dequantize())


def test_asymmetric_layers_become_q4_1_blocks_within_the_fp16_offset_rounding():
    layer = _groups(sym=False)
    blocks = to_gguf_blocks(layer, symmetric=False)
    assert blocks.shape == (N, K // 32, 20)
    got, want = dequantize_blocks(blocks, torch.float32), layer.dequantize()
    # m = -d z rounded to fp16: at most half an fp16 ulp of |d z| (2^-11 relative), constant
    # over the block; everything else exact
    bound = (layer.scales.float() * layer.zeros.float()).repeat_interleave(128, 1) * 2**-11
    assert torch.all((got - want).abs() <= bound + 1e-9)
    assert (got - want).abs().max() > 0  # the rounding is real: this is not an exact layout


@pytest.mark.parametrize("group", [32, 128])
def test_int4_groups_layout_is_exact(group):
    layer = _groups(sym=False, group=group)
    packed = to_int4_groups(layer)
    assert packed.shape == (N, K // group, group // 8 + 1) and packed.dtype == torch.int32
    assert torch.equal(dequantize_int4_groups(packed), layer.dequantize())


def test_layout_choice_and_whole_checkpoint_packing():
    assert int4_layout(frozenset({"Q4_0", "Q4_1", "Q8_0"})) == LAYOUT_GGUF_BLOCKS
    assert int4_layout(frozenset({"INT4_GROUPS"})) == LAYOUT_INT4_GROUPS
    assert int4_layout(frozenset()) is None
    codes, zeros, scales = quantize_rtn(_weight(), 128, sym=True)
    tensors = {f"a.{k}": v for k, v in pack_gptq(codes, zeros, scales, 128).items()}
    tensors["norm.weight"] = torch.ones(4)
    layers = int4_layers(tensors, _cfg("gptq", sym=True))
    assert list(tensors) == ["norm.weight"] and list(layers) == ["a"]
    assert pack_layers(layers, LAYOUT_GGUF_BLOCKS, torch.float32)["a.weight"].shape[2] == 18
    assert pack_layers(layers, None, torch.float16)["a.weight"].dtype == torch.float16
