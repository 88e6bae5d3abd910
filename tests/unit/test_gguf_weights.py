"""GGUF files read natively (engine_worker/weights/gguf_file.py, gguf_weights.py), made here from
a tiny random Llama: its weights quantized by the ``gguf`` package (Q4_0, Q4_1, Q8_0; Q5_0 for a
type without a kernel), named and Q/K-permuted as llama.cpp's converter writes them.

- every tensor read back equals gguf's own de-quantization of what was written, un-permuted
  (the name map and llama.cpp's Q/K row order, undone);
- an engine on the GGUF (native blocks) against one on a safetensors copy of the same
  de-quantized weights in fp32: prompt logprobs within fp32 noise (prefill de-quantizes
  exactly), greedy tokens equal (decode rounds activations to int8 per block of 32);
- a truncated file, a file that is not GGUF, and a type without a kernel under
  ``quantization="gguf"`` are errors naming the tensor / the type and the supported list.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as QT  # noqa: E402
from gguf.quants import dequantize, quantize  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

from engine_worker.weights.gguf_weights import dequantize_blocks, read_gguf_state  # noqa: E402
from tests.conftest import float_checkpoint  # noqa: E402

NATIVE = frozenset({"Q4_0", "Q4_1", "Q8_0"})
_LAYER_NAMES = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
                "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
                "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
                "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}


def _gguf_name(hf_name: str) -> str:
    name = hf_name.removeprefix("model.")
    if name.startswith("layers."):
        _, layer, rest = name.split(".", 2)
        module, kind = rest.rsplit(".", 1)
        return f"blk.{layer}.{_LAYER_NAMES[module]}.{kind}"
    return {"embed_tokens.weight": "token_embd.weight", "norm.weight": "output_norm.weight",
            "lm_head.weight": "output.weight"}[name]


def _llama_cpp_permute(w: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf row order for Llama's Q and K."""
    return (w.reshape(num_heads, 2, w.shape[0] // num_heads // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def write_gguf(hf_dir: Path, path: Path, qtype: QT, *, v_type: QT | None = None) -> dict:
    """``hf_dir``'s weights as a llama GGUF: 2-D weights in ``qtype`` (V in ``v_type``), norms
    F32. Returns {our name: the de-quantized values written, in transformers' row order}."""
    cfg = json.loads((hf_dir / "config.json").read_text())
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    writer.add_rope_freq_base(cfg.get("rope_theta", 10000.0))
    writer.add_vocab_size(cfg["vocab_size"])
    written = {}
    for hf_name, tensor in load_file(str(hf_dir / "model.safetensors")).items():
        w = tensor.float().numpy()
        name = _gguf_name(hf_name)
        t = v_type if (v_type is not None and ".attn_v." in name) else qtype
        if w.ndim == 1:
            writer.add_tensor(name, w)
            written[hf_name.removeprefix("model.")] = torch.from_numpy(w)
            continue
        raw = quantize(w, t)
        values = dequantize(raw, t)
        if ".attn_q." in name or ".attn_k." in name:
            n = heads if ".attn_q." in name else kv_heads
            raw = quantize(_llama_cpp_permute(w, n), t)
            values = dequantize(quantize(w, t), t)  # blocks run along rows: same values
        writer.add_tensor(name, raw, raw_dtype=t)
        written[hf_name.removeprefix("model.")] = torch.from_numpy(values)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return written


@pytest.fixture(scope="module")
def tiny_hf_dir(tmp_path_factory, embedded_model_dir) -> Path:
    from tests.conftest import build_tiny_model

    # hidden 128, intermediate 256: every K a multiple of 32
    return build_tiny_model(tmp_path_factory.mktemp("tiny-q"), embedded_model_dir,
                            hidden_size=128)


def _read(path: Path, *, strict: bool = False, native=NATIVE):
    return read_gguf_state(path, dtype=torch.float32, native_types=native, strict=strict,
                           num_heads=4, num_kv_heads=2)


@pytest.mark.parametrize("qtype", [QT.Q4_0, QT.Q4_1, QT.Q8_0], ids=lambda t: t.name)
def test_every_tensor_reads_back_as_written(tiny_hf_dir, tmp_path, qtype):
    path = tmp_path / "tiny.gguf"
    written = write_gguf(tiny_hf_dir, path, qtype)
    state = _read(path)
    assert state.type_counts == {"F32": 7, qtype.name: 22}
    assert state.tied_logits is not None and state.tied_logits.dtype == torch.uint8
    assert set(state.tensors) == set(written)
    for name, values in written.items():
        got = state.tensors[name]
        if name in state.quantized:
            assert got.dtype == torch.uint8
            got = dequantize_blocks(got, torch.float32)
        torch.testing.assert_close(got, values, rtol=0, atol=0, msg=name)
    torch.testing.assert_close(dequantize_blocks(state.tied_logits, torch.float32),
                               written["embed_tokens.weight"], rtol=0, atol=0)


def test_a_type_without_a_kernel_is_widened_or_refused(tiny_hf_dir, tmp_path):
    path = tmp_path / "mixed.gguf"
    written = write_gguf(tiny_hf_dir, path, QT.Q4_1, v_type=QT.Q5_0)
    state = _read(path)
    assert state.dequantized_types == ("Q5_0",)
    v = state.tensors["layers.0.self_attn.v_proj.weight"]
    assert v.dtype == torch.float32
    torch.testing.assert_close(v, written["layers.0.self_attn.v_proj.weight"], rtol=0, atol=0)
    with pytest.raises(ValueError, match=r"blk\.\d+\.attn_v\.weight is Q5_0, which has no "
                                         r"native kernel \(supported: Q4_0, Q4_1, Q8_0\)"):
        _read(path, strict=True)


def test_a_truncated_file_names_the_tensor(tiny_hf_dir, tmp_path):
    path = tmp_path / "tiny.gguf"
    write_gguf(tiny_hf_dir, path, QT.Q8_0)
    data = path.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[:len(data) - 1000])
    with pytest.raises(ValueError, match=r"GGUF tensor \S+ ends at byte \d+, past the end .* "
                                         r"truncated"):
        _read(cut)
    header_only = tmp_path / "header.gguf"
    header_only.write_bytes(data[:100])
    with pytest.raises(ValueError, match="ends inside its GGUF header"):
        _read(header_only)
    not_gguf = tmp_path / "not.gguf"
    not_gguf.write_bytes(b"PK\x03\x04" + data[4:200])
    with pytest.raises(ValueError, match="not a GGUF file"):
        _read(not_gguf)


@pytest.mark.parametrize("qtype", [QT.Q4_0, QT.Q4_1, QT.Q8_0], ids=lambda t: t.name)
def test_an_engine_on_native_blocks_matches_the_dequantized_weights(tiny_hf_dir, tmp_path,
                                                                    monkeypatch, qtype):
    from engine_worker.llm import LLM
    from engine_worker.sampling_params import SamplingParams
    from tests.conftest import use_cpu_variant

    monkeypatch.setenv("QUIRE_CACHE_DIR", str(tmp_path / "cache"))
    use_cpu_variant(monkeypatch, "avx2")
    path = tmp_path / "tiny.gguf"
    written = write_gguf(tiny_hf_dir, path, qtype)
    reference_dir = float_checkpoint(tiny_hf_dir, tmp_path / "dequantized", written)
    common = dict(dtype="float32", kernels="cpu-avx2", kv_cache_memory_bytes=1 << 24)
    native = LLM(str(path), tokenizer=str(tiny_hf_dir), quantization="gguf", **common)
    assert native.info.quantization == "gguf"
    reference = LLM(str(reference_dir), **common)
    assert reference.info.quantization == "none"
    prompts = [[1, 400, 2000, 37, 9000, 12], [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15]]
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, prompt_logprobs=0)
    got = native.generate([{"prompt_token_ids": p} for p in prompts], params)
    want = reference.generate([{"prompt_token_ids": p} for p in prompts], params)
    for g, w, p in zip(got, want, prompts):
        for gl, wl, token in zip(g.prompt_logprobs[1:], w.prompt_logprobs[1:], p[1:]):
            # x is rounded to int8 per block of 32 wherever a linear takes at most 8 rows
            # (csrc/cpu/quant_linear.cpp, bounded there): logprobs of about -12 move by
            # thousandths (seen up to 4.4e-3); a wrong block or scale moves them by whole units
            assert abs(gl[token].logprob - wl[token].logprob) < 1e-2
        assert g.outputs[0].token_ids == w.outputs[0].token_ids


def test_a_bf16_model_on_avx2_prefills_on_the_int8_kernel_close_to_the_dequantized_path(
        tiny_hf_dir, tmp_path, monkeypatch):
    """A bf16 model on the AVX2 kernels: prompts of more than 8 tokens stay on the int8 kernel
    (the fused stack names the model's dtype, csrc/cpu/quant_linear.cpp), as decode steps do,
    so its prompt logprobs are the de-quantized bf16 path's up to x's rounding to int8 per
    block of 32, and greedy decoding gives the same tokens."""
    from engine_worker.llm import LLM
    from engine_worker.sampling_params import SamplingParams
    from tests.conftest import use_cpu_variant

    monkeypatch.setenv("QUIRE_CACHE_DIR", str(tmp_path / "cache"))
    use_cpu_variant(monkeypatch, "avx2")
    path = tmp_path / "tiny.gguf"
    written = write_gguf(tiny_hf_dir, path, QT.Q4_1)
    reference_dir = float_checkpoint(tiny_hf_dir, tmp_path / "dequantized",
                                     {k: v.to(torch.bfloat16) for k, v in written.items()})
    common = dict(dtype="bfloat16", kernels="cpu-avx2", kv_cache_memory_bytes=1 << 24)
    native = LLM(str(path), tokenizer=str(tiny_hf_dir), quantization="gguf", **common)
    assert "int8 dot products for a bf16 model's Q4_0 / Q4_1" in native.info.backend_summary
    reference = LLM(str(reference_dir), **common)
    prompts = [list(range(3, 40)), [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 400, 2000]]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, prompt_logprobs=0)
    got = native.generate([{"prompt_token_ids": p} for p in prompts], params)
    want = reference.generate([{"prompt_token_ids": p} for p in prompts], params)
    for g, w, p in zip(got, want, prompts):
        diffs = [abs(gl[t].logprob - wl[t].logprob)
                 for gl, wl, t in zip(g.prompt_logprobs[1:], w.prompt_logprobs[1:], p[1:])]
        # x rounded to int8 per block of 32 in every linear, against bf16 weights with fp32
        # activations: logprobs of about -11 move by hundredths (seen on a Zen 4: at most
        # 0.054, 0.021 on average); a wrong block, scale or row moves them by whole units
        assert max(diffs) < 0.1 and sum(diffs) / len(diffs) < 0.05, diffs
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
