"""A GGUF of k-quants (Q4_K, Q5_K, Q6_K, mixed as in Q4_K_M) read natively and served.

The file is written here by the ``gguf`` package, which writes these types' bytes but cannot
quantize into them: its blocks are random bytes with sane scales (any bytes are a valid block),
the values they stand for are gguf's own ``dequantize`` of them. A tiny random Llama (hidden 256,
so every K is whole super-blocks): Q/K/O in Q4_K, gate/up in Q5_K, V, down and the tied
embedding in Q6_K. (llama.cpp's quantizer makes real files: scripts/install-llama-cpp.sh.)

- the loader keeps every k-quant linear weight as the file's blocks;
- an engine on the GGUF (native blocks) against one on a safetensors copy of the de-quantized
  values in fp32: prompt logprobs within fp32 noise, greedy tokens equal.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as QT  # noqa: E402
from gguf.quants import dequantize  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

from engine_worker.weights.gguf_weights import _unpermute_rows, read_gguf_state  # noqa: E402
from tests.conftest import float_checkpoint  # noqa: E402
from tests.unit.test_gguf_weights import _gguf_name  # noqa: E402

NATIVE = frozenset({"Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"})
HEADS, KV_HEADS = 4, 2


def _type_of(gguf_name: str) -> QT:
    if any(p in gguf_name for p in (".attn_v.", ".ffn_down.", "token_embd")):
        return QT.Q6_K
    return QT.Q5_K if (".ffn_gate." in gguf_name or ".ffn_up." in gguf_name) else QT.Q4_K


def _random_blocks(rows: int, cols: int, qtype: QT, rng) -> np.ndarray:
    """Random super-blocks, scales set so the weights stay within about +-0.1."""
    type_bytes = gguf.GGML_QUANT_SIZES[qtype][1]
    raw = rng.integers(0, 256, size=(rows, cols // 256, type_bytes), dtype=np.uint8)

    def halves(scale: float) -> np.ndarray:
        values = (rng.uniform(0.5, 1.5, size=raw.shape[:2]) * scale).astype(np.float16)
        return values.view(np.uint8).reshape(*raw.shape[:2], 2)

    if qtype == QT.Q6_K:
        raw[..., 208:210] = halves(2e-5)
    else:
        raw[..., 0:2], raw[..., 2:4] = halves(1e-4), halves(1e-4)
    return raw.reshape(rows, -1)


def write_kquant_gguf(hf_dir: Path, path: Path) -> dict[str, torch.Tensor]:
    """``hf_dir``'s architecture as a llama GGUF of random k-quant blocks (norms F32 as
    written there). Returns {our name: the values, in transformers' row order}."""
    cfg = json.loads((hf_dir / "config.json").read_text())
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    writer.add_rope_freq_base(cfg.get("rope_theta", 10000.0))
    writer.add_vocab_size(cfg["vocab_size"])
    rng = np.random.default_rng(0)
    values = {}
    for hf_name, tensor in load_file(str(hf_dir / "model.safetensors")).items():
        name, ours = _gguf_name(hf_name), hf_name.removeprefix("model.")
        if tensor.dim() == 1:
            w = tensor.float().numpy()
            writer.add_tensor(name, w)
            values[ours] = torch.from_numpy(w)
            continue
        qtype = _type_of(name)
        raw = _random_blocks(*tensor.shape, qtype, rng)
        writer.add_tensor(name, raw, raw_dtype=qtype)
        w = torch.from_numpy(dequantize(raw, qtype).astype(np.float32))
        if ".attn_q." in name or ".attn_k." in name:  # the file's rows are llama.cpp's order
            w = _unpermute_rows(w, HEADS if ".attn_q." in name else KV_HEADS)
        values[ours] = w.contiguous()
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return values


@pytest.fixture(scope="module")
def tiny_hf_dir(tmp_path_factory, embedded_model_dir) -> Path:
    from tests.conftest import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny-k"), embedded_model_dir,
                            hidden_size=256, num_layers=2)


def test_the_loader_keeps_k_quant_blocks(tiny_hf_dir, tmp_path):
    path = tmp_path / "k.gguf"
    values = write_kquant_gguf(tiny_hf_dir, path)
    state = read_gguf_state(path, dtype=torch.float32, native_types=NATIVE, strict=True,
                            num_heads=HEADS, num_kv_heads=KV_HEADS)
    assert {"Q4_K", "Q5_K", "Q6_K"} <= set(state.type_counts)
    assert state.dequantized_types == ()
    for name, bytes_ in (("layers.0.self_attn.o_proj.weight", 144),
                         ("layers.1.mlp.up_proj.weight", 176),
                         ("layers.1.mlp.down_proj.weight", 210)):
        blocks = state.tensors[name]
        assert blocks.dtype == torch.uint8 and blocks.shape[2] == bytes_, name
    assert state.tied_logits is not None and state.tied_logits.shape[2] == 210
    torch.testing.assert_close(state.tensors["embed_tokens.weight"],
                               values["embed_tokens.weight"], rtol=0, atol=0)


def test_an_engine_on_k_quant_blocks_matches_the_dequantized_weights(tiny_hf_dir, tmp_path,
                                                                     monkeypatch):
    from engine_worker.llm import LLM
    from engine_worker.sampling_params import SamplingParams
    from tests.conftest import use_cpu_variant

    monkeypatch.setenv("QUIRE_CACHE_DIR", str(tmp_path / "cache"))
    use_cpu_variant(monkeypatch, "avx2")
    path = tmp_path / "k.gguf"
    values = write_kquant_gguf(tiny_hf_dir, path)
    reference_dir = float_checkpoint(tiny_hf_dir, tmp_path / "dequantized", values)
    common = dict(dtype="float32", kernels="cpu-avx2", kv_cache_memory_bytes=1 << 24)
    native = LLM(str(path), tokenizer=str(tiny_hf_dir), quantization="gguf", **common)
    assert native.info.quantization == "gguf"
    assert "Q4_K" in native.info.quantization_summary
    reference = LLM(str(reference_dir), **common)
    prompts = [[1, 400, 2000, 37, 9000, 12], [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15]]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, prompt_logprobs=0)
    got = native.generate([{"prompt_token_ids": p} for p in prompts], params)
    want = reference.generate([{"prompt_token_ids": p} for p in prompts], params)
    for g, w, p in zip(got, want, prompts):
        for gl, wl, token in zip(g.prompt_logprobs[1:], w.prompt_logprobs[1:], p[1:]):
            # x is rounded to int8 per block of 32 wherever a linear takes at most 8 rows
            # (csrc/cpu/quant_linear.cpp, bounded there): logprobs of about -12 move by
            # thousandths (seen up to 4.4e-3); a wrong block or scale moves them by whole units
            assert abs(gl[token].logprob - wl[token].logprob) < 1e-2
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
