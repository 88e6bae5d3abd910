"""The same engine code on CUDA. These machines (and CI) have no GPU, so this module is skipped
there; it runs wherever torch sees one (`pytest -m gpu`)."""

from __future__ import annotations

import pytest
import torch

from engine_worker import LLM, SamplingParams
from tests.e2e.test_hf_parity import TINY_PROMPTS, hf_greedy

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU here")]


def test_cuda_greedy_matches_cpu_reference(tiny_model_dir):
    import transformers

    hf_model = transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir,
                                                                 dtype=torch.float32).eval()
    llm = LLM(str(tiny_model_dir), dtype="float32", device="cuda",
              kv_cache_memory_bytes=1 << 26)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in TINY_PROMPTS], params,
                           use_tqdm=False)
    for prompt, output in zip(TINY_PROMPTS, outputs):
        assert output.outputs[0].token_ids == hf_greedy(hf_model, prompt, 24)[0]


def test_cuda_seeded_sampling_and_preemption(tiny_model_dir):
    params = [SamplingParams(temperature=0.9, seed=i, max_tokens=30, ignore_eos=True)
              for i in range(len(TINY_PROMPTS))]
    roomy = LLM(str(tiny_model_dir), dtype="float32", device="cuda",
                kv_cache_memory_bytes=1 << 26)
    tight = LLM(str(tiny_model_dir), dtype="float32", device="cuda",
                kv_cache_memory_bytes=10 * 3 * 2 * 16 * 2 * 16 * 4)
    a = roomy.generate([{"prompt_token_ids": p} for p in TINY_PROMPTS], params, use_tqdm=False)
    b = tight.generate([{"prompt_token_ids": p} for p in TINY_PROMPTS], params, use_tqdm=False)
    assert tight.engine.stats().scheduler.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in b]
