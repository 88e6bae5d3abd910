"""Embeddings (pooling requests) equal transformers' final hidden states pooled the same way
(fp32, 1e-4): alone, batched with mixed lengths and chunked prefills, beside generate requests
in the same steps, with the prefix cache warm, on a tiny random Llama and the embedded SmolLM2."""

from __future__ import annotations

import pytest
import torch
import transformers

from engine_worker import LLM, PoolingParams, SamplingParams
from engine_worker.outputs import PoolingRequestOutput, RequestOutput

ATOL = 1e-4  # fp32; summation order in attention and matmuls
# mixed lengths: one token, one longer than the step budget below (chunked), repeats
PROMPTS = [[7], [5, 100, 200, 300, 400], list(range(1000, 1100)), list(range(20000, 20037)),
           [42] * 17, list(range(1000, 1050))]


def hf_embeddings(model_dir, prompts, pooling_type: str, normalize: bool = True):
    """transformers' ``last_hidden_state`` (LlamaModel: after the final norm), pooled."""
    model = transformers.AutoModel.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for prompt in prompts:
            hidden = model(torch.tensor([prompt])).last_hidden_state[0]  # [num_tokens, hidden]
            pooled = {"LAST": hidden[-1], "MEAN": hidden.mean(dim=0),
                      "CLS": hidden[0]}[pooling_type]
            out.append(torch.nn.functional.normalize(pooled, dim=-1) if normalize else pooled)
    return out


def assert_close(got, want) -> None:
    assert len(got) == len(want)
    for vector, ref in zip(got, want):
        assert torch.allclose(torch.tensor(vector), ref, atol=ATOL), \
            (torch.tensor(vector) - ref).abs().max().item()


def _llm(model_dir, pooling_type: str, **kwargs) -> LLM:
    # pooling-only steps take a wider budget than max_num_batched_tokens (on a CPU): the
    # per-request cap still chunks the 100-token prompt there
    return LLM(str(model_dir), dtype="float32", kv_cache_memory_bytes=1 << 26,
               pooler_config={"pooling_type": pooling_type}, max_num_batched_tokens=64,
               long_prefill_token_threshold=64, **kwargs)


@pytest.mark.parametrize("pooling_type", ["LAST", "MEAN", "CLS"])
def test_tiny_model_alone_and_batched(pooling_type, tiny_model_dir):
    ref = hf_embeddings(tiny_model_dir, PROMPTS, pooling_type)
    llm = _llm(tiny_model_dir, pooling_type)
    assert llm.info.pooling_type == pooling_type and llm.info.pooling_normalize
    alone = [llm.embed([{"prompt_token_ids": p}], use_tqdm=False)[0] for p in PROMPTS]
    assert_close([o.outputs.embedding for o in alone], ref)
    assert alone[2].outputs.hidden_size == 64 and alone[2].prompt_token_ids == PROMPTS[2]
    batched = llm.embed([{"prompt_token_ids": p} for p in PROMPTS], use_tqdm=False)
    assert_close([o.outputs.embedding for o in batched], ref)  # the cache is warm by now
    raw = llm.embed([{"prompt_token_ids": p} for p in PROMPTS],
                    PoolingParams(normalize=False), use_tqdm=False)
    assert_close([o.outputs.embedding for o in raw],
                 hf_embeddings(tiny_model_dir, PROMPTS, pooling_type, normalize=False))


@pytest.mark.parametrize("pooling_type", ["LAST", "MEAN"])
def test_batched_with_generate_requests_in_the_same_steps(pooling_type, tiny_model_dir):
    """Pooling and generate requests share steps (the step budget chunks the long ones); the
    generate requests' tokens equal those of a run without the pooling requests."""
    llm = _llm(tiny_model_dir, pooling_type)
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    alone = llm.generate([{"prompt_token_ids": p} for p in PROMPTS[:3]], greedy, use_tqdm=False)
    llm.engine.reset_prefix_cache()
    engine = llm.engine
    for i, prompt in enumerate(PROMPTS[:3]):
        engine.add_request(f"g{i}", {"prompt_token_ids": prompt}, greedy)
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"e{i}", {"prompt_token_ids": prompt}, PoolingParams())
    results, mixed_steps = {}, 0
    while engine.has_unfinished_requests():
        outputs = engine.step().outputs
        kinds = {type(o) for o in outputs}
        mixed_steps += kinds == {RequestOutput, PoolingRequestOutput}
        for output in outputs:
            if output.finished:
                results[output.request_id] = output
    assert mixed_steps > 0
    assert_close([results[f"e{i}"].outputs.data for i in range(len(PROMPTS))],
                 hf_embeddings(tiny_model_dir, PROMPTS, pooling_type))
    assert [results[f"g{i}"].outputs[0].token_ids for i in range(3)] == \
        [o.outputs[0].token_ids for o in alone]


def test_prefix_cache_reads_by_pooling_type(tiny_model_dir):
    """LAST reads the prefix cache (only the last position is needed); MEAN computes every
    position; both give the reference vector either way."""
    prompt = list(range(3000, 3070))
    for pooling_type, reads in (("LAST", True), ("MEAN", False)):
        llm = _llm(tiny_model_dir, pooling_type)
        ref = hf_embeddings(tiny_model_dir, [prompt], pooling_type)
        llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=1),
                     use_tqdm=False)  # fills the cache with the prompt's blocks
        engine = llm.engine
        engine.add_request("e", {"prompt_token_ids": prompt}, PoolingParams())
        output = None
        while engine.has_unfinished_requests():
            output = next((o for o in engine.step().outputs if o.finished), output)
        assert (output.num_cached_tokens > 0) is reads
        assert_close([output.outputs.data], ref)


def test_pooling_runner_refuses_generation_and_bad_params(tiny_model_dir):
    llm = LLM(str(tiny_model_dir), dtype="float32", kv_cache_memory_bytes=1 << 26,
              runner="pooling", max_model_len=128)
    assert llm.info.runner == "pooling" and llm.info.pooling_type == "LAST"
    with pytest.raises(ValueError, match="runner"):
        llm.generate("hello", SamplingParams(max_tokens=2), use_tqdm=False)
    with pytest.raises(ValueError, match="dimensions"):
        PoolingParams(dimensions=8)
    with pytest.raises(ValueError, match="prompt"):
        llm.embed([list(range(129))], use_tqdm=False)  # over max_model_len
    with pytest.raises(ValueError, match="prompt"):
        llm.embed([[]], use_tqdm=False)
    assert len(llm.embed(["still served"], use_tqdm=False)[0].outputs.embedding) == 64
    long = list(range(200, 400))
    # vLLM 0.32's sides for pooling: the first k by default, the last k with "left"
    for keep, side, kept in ((50, None, long[:50]), (50, "left", long[-50:]),
                             (-1, "right", long[:128])):
        out = llm.embed([long], PoolingParams(truncate_prompt_tokens=keep,
                                              truncation_side=side), use_tqdm=False)[0]
        assert out.prompt_token_ids == kept
        assert_close([out.outputs.embedding], hf_embeddings(tiny_model_dir, [kept], "LAST"))
    for bad in (0, -2, 1.5):
        with pytest.raises(ValueError, match="truncate_prompt_tokens"):
            PoolingParams(truncate_prompt_tokens=bad)
    with pytest.raises(ValueError, match="pooling_type"):
        LLM(str(tiny_model_dir), pooler_config={"pooling_type": "MAX"})
    with pytest.raises(ValueError, match="runner"):
        LLM(str(tiny_model_dir), runner="transcribe")


@pytest.mark.slow  # loads the embedded SmolLM2 model
def test_smollm2_matches_transformers(embedded_model_dir):
    llm = LLM(dtype="float32", kv_cache_memory_bytes=1 << 28, max_num_batched_tokens=64)
    tokenizer = llm.engine.tokenizer
    texts = ["What is the capital of France?", "def quicksort(arr):",
             "Explain what a KV cache is in one paragraph, for a software engineer who knows "
             "databases but not machine learning, with an example or two of what it saves.",
             "Paris"]
    prompts = [tokenizer.encode(t) for t in texts]
    outputs = llm.embed(texts, use_tqdm=False)
    assert [o.prompt_token_ids for o in outputs] == prompts
    assert_close([o.outputs.embedding for o in outputs],
                 hf_embeddings(embedded_model_dir, prompts, "LAST"))


def test_preempted_pooling_requests_recompute_their_vector(tiny_model_dir):
    """A KV cache too small for everything at once: a pooling request is preempted mid-prompt
    and recomputed from its first position, and its vector is still the reference's."""
    llm = LLM(str(tiny_model_dir), dtype="float32", kv_cache_memory_bytes=12 * 12288,
              pooler_config={"pooling_type": "MEAN"}, long_prefill_token_threshold=8,
              enable_prefix_caching=False)
    assert llm.info.num_kv_blocks == 12
    engine = llm.engine
    long_output = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    prompts = [list(range(4000 + 100 * i, 4000 + 100 * i + 70)) for i in range(2)]
    for i in range(2):
        engine.add_request(f"g{i}", {"prompt_token_ids": list(range(300 + i, 360 + i))},
                           long_output)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"e{i}", {"prompt_token_ids": prompt}, PoolingParams())
    results, preempted = {}, set()
    while engine.has_unfinished_requests():
        for output in engine.step().outputs:
            if output.finished:
                results[output.request_id] = output
        preempted |= {r.req_id for r in engine._scheduler.requests.values()
                      if r.pooling_params is not None and r.num_preemptions}
    assert preempted, "no pooling request was preempted: the test lost its point"
    assert_close([results[f"e{i}"].outputs.data for i in range(2)],
                 hf_embeddings(tiny_model_dir, prompts, "MEAN"))


def test_pooling_only_steps_on_a_cpu_take_the_wider_budget(tiny_model_dir):
    """Only pooling requests unfinished: one step computes every prompt (210 tokens) although
    max_num_batched_tokens is 64, and the vectors are the reference's."""
    llm = LLM(str(tiny_model_dir), dtype="float32", kv_cache_memory_bytes=1 << 26,
              max_num_batched_tokens=64)
    engine = llm.engine
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"e{i}", {"prompt_token_ids": prompt}, PoolingParams())
    results, steps = {}, 0
    while engine.has_unfinished_requests():
        steps += 1
        results.update((o.request_id, o) for o in engine.step().outputs if o.finished)
    assert steps == 1
    assert_close([results[f"e{i}"].outputs.data for i in range(len(PROMPTS))],
                 hf_embeddings(tiny_model_dir, PROMPTS, "LAST"))
