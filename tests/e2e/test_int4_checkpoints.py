"""AWQ and GPTQ checkpoints end to end: a tiny random Llama (hidden 128, so a group of 128
columns is a whole row of the attention layers) quantized here by our own round-to-nearest
quantizer and packed as AutoAWQ / AutoGPTQ write them (tests/int4_checkpoints.py, checked
against the formats' reference de-quantization in tests/unit/test_int4_checkpoint.py).

- ``auto`` runs each natively (CPU: repacked into GGUF Q4_0 / Q4_1 blocks), says so in
  ``info.quantization`` (the engine's cache identity, GetModelInfo) and the start summary;
- teacher-forced perplexity of a fixed English text through ``prompt_logprobs``: native within
  1 % of ``quantization="dequantize"`` on the same checkpoint (fp32); greedy continuations
  equal on most prompts (decode rounds activations to int8 per block; the test prints which
  differ);
- the Triton backend (its int4 kernel, under Triton's CPU interpreter here) on the AWQ
  checkpoint: greedy tokens and prompt logprobs against the de-quantized path;
- bad input: an unsupported config names the field, a method that is not the checkpoint's names
  both.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest

from engine_worker.llm import LLM
from engine_worker.sampling_params import SamplingParams
from tests.conftest import build_tiny_model
from tests.int4_checkpoints import quantize_checkpoint

TEXT = (Path(__file__).parent / "data" / "perplexity_text.txt").read_text()
PROMPTS = ["The capital of France is", "Once upon a time, in a small village,",
           "def fibonacci(n):", "The three primary colours are", "Water boils at",
           "A list of fruits: apple, banana,"]
KINDS = {"awq": dict(method="awq"), "gptq-sym": dict(method="gptq", sym=True),
         "gptq-asym": dict(method="gptq", sym=False)}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, embedded_model_dir) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("int4")
    base = build_tiny_model(root / "float", embedded_model_dir, hidden_size=128, num_heads=4,
                            num_kv_heads=2, num_layers=2, seed=3)
    return {kind: quantize_checkpoint(base, root / kind, **kw) for kind, kw in KINDS.items()}


def _engine(path: Path, kv_cache_memory_bytes: int = 1 << 24, **kw) -> LLM:
    return LLM(str(path), dtype="float32", kv_cache_memory_bytes=kv_cache_memory_bytes, **kw)


def _perplexity(llm: LLM, token_ids: list[int]) -> float:
    out = llm.generate([{"prompt_token_ids": token_ids}],
                       SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0))[0]
    logprobs = [entry[token].logprob for entry, token in zip(out.prompt_logprobs[1:],
                                                             token_ids[1:])]
    return math.exp(-sum(logprobs) / len(logprobs))


def _greedy(llm: LLM, prompts=PROMPTS, max_tokens: int = 16) -> list[list[int]]:
    outs = llm.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0,
                                                ignore_eos=True))
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.mark.slow  # two engines a checkpoint
@pytest.mark.parametrize("kind", list(KINDS))
def test_native_int4_matches_the_dequantized_checkpoint(kind, checkpoints):
    method = KINDS[kind]["method"]
    native = _engine(checkpoints[kind])  # quantization="auto", the CPU backend auto picks
    assert native.info.quantization == method  # the cache identity says how weights are held
    assert "GGUF Q4_0/Q4_1 blocks" in native.info.quantization_summary
    token_ids = native.engine.tokenizer.encode(TEXT)
    assert len(token_ids) > 300
    ppl_native, greedy_native = _perplexity(native, token_ids), _greedy(native)
    del native
    widened = _engine(checkpoints[kind], quantization="dequantize")
    assert widened.info.quantization == "dequantize"
    ppl_widened, greedy_widened = _perplexity(widened, token_ids), _greedy(widened)
    print(f"{kind}: perplexity native {ppl_native:.3f}, dequantized {ppl_widened:.3f}")
    assert abs(ppl_native / ppl_widened - 1) < 0.01
    differ = [p for p, a, b in zip(PROMPTS, greedy_native, greedy_widened) if a != b]
    print(f"{kind}: greedy continuations that differ: {differ}")
    assert len(differ) <= 1


@pytest.mark.slow  # starts a worker process
@pytest.mark.parametrize("kind", ["awq", "gptq-sym"])
def test_native_int4_splits_across_two_tensor_parallel_ranks(kind, checkpoints):
    # each rank keeps its rows of q/k/v and gate/up and whole blocks of o's and down's input
    # columns, in the backend's native layout; compared with one process by vLLM's rule
    from tests.e2e.test_tensor_parallel import assert_parallel_equal

    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=5)
    expected = _engine(checkpoints[kind]).generate(PROMPTS, params, use_tqdm=False)
    with _engine(checkpoints[kind], tensor_parallel_size=2, num_threads=1) as llm:
        assert llm.info.quantization == KINDS[kind]["method"]
        assert_parallel_equal(expected, llm.generate(PROMPTS, params, use_tqdm=False))


@pytest.mark.slow  # ~45 s: two engines under the Triton interpreter
def test_triton_int4_kernel_end_to_end_under_the_interpreter(checkpoints):
    """Short prompts and outputs: the interpreter takes about 10 ms per tile iteration."""
    pytest.importorskip("triton")
    native = _engine(checkpoints["awq"], kernels="triton", device="cpu", quantization="awq")
    assert native.info.quantization == "awq"
    assert "Triton int4 kernel" in native.info.quantization_summary
    prompts = PROMPTS[:2]
    tokens = native.engine.tokenizer.encode(PROMPTS[1])
    ppl_native, greedy_native = _perplexity(native, tokens), _greedy(native, prompts, 4)
    del native
    widened = _engine(checkpoints["awq"], kernels="triton", device="cpu",
                      quantization="dequantize")
    ppl_widened, greedy_widened = _perplexity(widened, tokens), _greedy(widened, prompts, 4)
    assert abs(ppl_native / ppl_widened - 1) < 1e-3  # exact weights: fp32 summation only
    assert greedy_native == greedy_widened


@pytest.mark.slow  # re-quantizes SmolLM2 and loads it twice
def test_requantized_smollm2_awq_perplexity_native_vs_dequantized(embedded_model_dir, tmp_path):
    """A real model, so the perplexity means something: the embedded SmolLM2's de-quantized
    weights re-quantized as AWQ (group 64: its widths, 576 and 1536, are not multiples of 128),
    native (Q4_1 blocks) against de-quantized, on the shipped English text."""
    awq = quantize_checkpoint(embedded_model_dir, tmp_path / "smollm2-awq", "awq", group_size=64)
    native = _engine(awq, kv_cache_memory_bytes=1 << 27)
    assert native.info.quantization == "awq"
    token_ids = native.engine.tokenizer.encode(TEXT)
    ppl_native, greedy_native = _perplexity(native, token_ids), _greedy(native)
    del native
    widened = _engine(awq, kv_cache_memory_bytes=1 << 27, quantization="dequantize")
    ppl_widened, greedy_widened = _perplexity(widened, token_ids), _greedy(widened)
    print(f"SmolLM2 AWQ g64: perplexity native {ppl_native:.4f}, dequantized {ppl_widened:.4f}")
    assert 5 < ppl_widened < 50  # a real text under a real model
    assert abs(ppl_native / ppl_widened - 1) < 0.01
    differ = [p for p, a, b in zip(PROMPTS, greedy_native, greedy_widened) if a != b]
    print(f"SmolLM2 AWQ g64: greedy continuations that differ: {differ}")
    assert len(differ) <= 2


def _with_config(src: Path, dst: Path, **changes) -> Path:
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg["quantization_config"].update(changes)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


@pytest.mark.parametrize("changes, message", [
    ({"desc_act": True}, r"quantization_config\.desc_act: True is not supported \(supported: "
                         r"false"),
    ({"bits": 8}, r"quantization_config\.bits: 8 is not supported \(supported: 4\)"),
    ({"group_size": 48}, r"quantization_config\.group_size: 48 is not supported"),
])
def test_unsupported_gptq_configs_are_clear_errors(changes, message, checkpoints, tmp_path):
    bad = _with_config(checkpoints["gptq-sym"], tmp_path / "bad", **changes)
    with pytest.raises(ValueError, match=message):
        _engine(bad)


def test_a_method_that_is_not_the_checkpoints_is_refused(checkpoints):
    with pytest.raises(ValueError, match=r"quantization: 'gptq' needs a GPTQ checkpoint .*"
                                         r"this checkpoint is AWQ"):
        _engine(checkpoints["awq"], quantization="gptq")
    with pytest.raises(ValueError, match=r"quantization: 'awq' needs an AWQ checkpoint .*"
                                         r"not quantized"):
        _engine(checkpoints["awq"].parent / "float", quantization="awq")
