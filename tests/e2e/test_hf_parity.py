"""Greedy output is token-identical to Hugging Face transformers' generate (fp32), and
logprobs agree within 1e-4, on tiny random Llama-family models and on the embedded SmolLM2."""

from __future__ import annotations

import pytest
import torch
import transformers

from engine_worker import LLM, SamplingParams
from engine_worker.backends import BACKENDS
from tests.conftest import CPU_BACKEND_OF_ISA, build_tiny_model, use_cpu_variant

LOGPROB_ATOL = 1e-4  # fp32; differences come from summation order in attention and matmuls

VARIANTS = {
    "llama-gqa-tied": dict(arch="llama", tie_word_embeddings=True),
    "llama-untied-llama3-rope": dict(
        arch="llama", tie_word_embeddings=False,
        rope={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
              "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "original_max_position_embeddings": 64}),
    "llama-linear-rope": dict(arch="llama", rope={"rope_type": "linear", "rope_theta": 10000.0,
                                                  "factor": 4.0}),
    "llama-yarn-rope": dict(arch="llama", rope={"rope_type": "yarn", "rope_theta": 10000.0,
                                                "factor": 4.0,
                                                "original_max_position_embeddings": 256}),
    "llama-mha": dict(arch="llama", num_kv_heads=4),
    "qwen2-qkv-bias": dict(arch="qwen2", tie_word_embeddings=False),
    "llama-attention-bias": dict(arch="llama", attention_bias=True),  # q, k, v and o_proj
    "mistral": dict(arch="mistral", num_kv_heads=1),
}

# Mixed lengths, including one longer than a block and one of a single token.
TINY_PROMPTS = [[7], [5, 100, 200, 300, 400], list(range(1000, 1100)),
                list(range(20000, 20037)), [42] * 17]


def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int):
    """transformers' own greedy generate, with EOS disabled so lengths match ours."""
    model.generation_config.eos_token_id = None
    out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=max_new_tokens,
                         do_sample=False, output_logits=True, return_dict_in_generate=True,
                         pad_token_id=0)
    tokens = out.sequences[0, len(prompt_ids):].tolist()
    logprobs = torch.log_softmax(torch.stack(out.logits)[:, 0].float(), dim=-1)
    return tokens, logprobs


def assert_matches_hf(llm: LLM, hf_model, prompts: list[list[int]], max_tokens: int) -> None:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=3)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for prompt, output in zip(prompts, outputs):
        ref_tokens, ref_logprobs = hf_greedy(hf_model, prompt, max_tokens)
        completion = output.outputs[0]
        assert completion.token_ids == ref_tokens, f"prompt of {len(prompt)} tokens diverged"
        for step, entry in enumerate(completion.logprobs):
            for token_id, lp in entry.items():
                assert lp.logprob == pytest.approx(ref_logprobs[step, token_id].item(),
                                                   abs=LOGPROB_ATOL)
            top = ref_logprobs[step].topk(3).indices.tolist()
            assert set(top) <= set(entry), "top-3 logprob tokens differ"


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_tiny_models_match_transformers(variant, tmp_path, embedded_model_dir):
    model_dir = build_tiny_model(tmp_path, embedded_model_dir, **VARIANTS[variant])
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    llm = LLM(str(model_dir), dtype="float32", kv_cache_memory_bytes=1 << 26)
    assert_matches_hf(llm, hf_model.eval(), TINY_PROMPTS, max_tokens=40)


@pytest.mark.slow  # loads the embedded SmolLM2 model
def test_smollm2_matches_transformers(embedded_model_dir):
    """The embedded model, 8 prompts of mixed lengths (chat-templated and raw), 32 tokens, on the
    weights transformers runs (its GGUF de-quantized; native 4-bit is test_quantization.py's)."""
    llm = LLM(dtype="float32", kv_cache_memory_bytes=1 << 28, quantization="dequantize")
    tokenizer = llm.engine.tokenizer
    questions = ["What is the capital of France?", "Write a haiku about the sea.",
                 "Explain what a KV cache is in one paragraph, for a software engineer who "
                 "knows databases but not machine learning."]
    raw = ["Once upon a time", "def quicksort(arr):", "The three laws of robotics are",
           "1, 2, 3, 5, 8, 13,", "Paris is"]
    prompts = [tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": q}]),
                                add_special_tokens=False) for q in questions]
    prompts += [tokenizer.encode(r) for r in raw]
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(embedded_model_dir,
                                                                 dtype=torch.float32).eval()
    assert_matches_hf(llm, hf_model, prompts, max_tokens=32)


@pytest.mark.parametrize("option", ["kernels", "attention_backend"])
def test_triton_attention_matches_transformers(option, tiny_model_dir):
    """The Triton backend end to end (under Triton's CPU interpreter here, tests/conftest.py):
    greedy tokens and top-3 logprobs equal Hugging Face's. Short prompts and outputs: the
    interpreter takes about 10 ms per tile iteration."""
    pytest.importorskip("triton")
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir,
                                                                 dtype=torch.float32)
    llm = LLM(str(tiny_model_dir), dtype="float32", kv_cache_memory_bytes=1 << 24,
              device="cpu", **{option: "triton"})
    assert llm.info.attention == "triton"
    assert_matches_hf(llm, hf_model.eval(), [[7], [5, 100, 200, 300, 400],
                                             list(range(1000, 1040))], max_tokens=6)


@pytest.mark.parametrize("variant", ["avx512", "avx512_emulated", "avx2"])
def test_every_cpu_kernel_set_matches_transformers(variant, tmp_path, embedded_model_dir,
                                                   monkeypatch):
    """Each compiled kernel set behind its backend (``cpu``: the AVX-512 set, ``cpu-avx2``),
    whichever CPU runs the suite: without AVX-512, the AVX-512 set's code runs through SIMDe's
    portable intrinsics (``avx512_emulated``), so its kernels are checked token for token on
    either machine type. fp32: the dtype where both must equal Hugging Face's tokens."""
    kernels = use_cpu_variant(monkeypatch, variant)  # skips where the variant cannot run
    model_dir = build_tiny_model(tmp_path, embedded_model_dir, arch="llama", hidden_size=128,
                                 num_heads=2, num_kv_heads=1)
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    backend = CPU_BACKEND_OF_ISA[kernels.isa]
    llm = LLM(str(model_dir), dtype="float32", kernels=backend, kv_cache_memory_bytes=1 << 26)
    assert llm.info.backend == backend
    assert BACKENDS[backend].description in llm.info.backend_summary
    assert_matches_hf(llm, hf_model.eval(), TINY_PROMPTS, max_tokens=24)
