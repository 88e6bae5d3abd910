"""The offline API's contract: sampling options, stops, logprobs, n, and clear errors."""

from __future__ import annotations

import json

import pytest
import torch
import transformers

from engine_worker import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm(tiny_model_dir) -> LLM:
    return LLM(str(tiny_model_dir), dtype="float32", kv_cache_memory_bytes=1 << 24)


@pytest.fixture(scope="module")
def hf_model(tiny_model_dir):
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    model.generation_config.eos_token_id = None
    return model.eval()


PROMPT = list(range(300, 320))


def _tokens(llm, params, prompt=PROMPT):
    return llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0].outputs[0]


def test_a_prefaulted_cache_generates_as_the_lazy_one_and_says_so(llm, tiny_model_dir):
    """``kv_cache_prefault`` (a server's default) faults the cache in at start; the tokens are
    those of the lazily mapped cache, preemption and prefix reuse included (a small cache)."""
    prefaulted = LLM(str(tiny_model_dir), dtype="float32", kv_cache_memory_bytes=1 << 24,
                     kv_cache_prefault=True)
    total = prefaulted.info.kv_cache_bytes / 2**30
    assert prefaulted.info.kv_cache_pages.startswith(
        f"faulted in at start, {total:.2f} of {total:.2f} GiB in ")
    prompts = [{"prompt_token_ids": [300 + i + j for j in range(40)]} for i in range(6)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    ours = [o.outputs[0].token_ids for o in prefaulted.generate(prompts, params, use_tqdm=False)]
    lazy = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert ours == lazy


def test_repetition_penalty_matches_transformers(llm, hf_model):
    ours = _tokens(llm, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True,
                                       repetition_penalty=1.5))
    ref = hf_model.generate(torch.tensor([PROMPT]), max_new_tokens=30, do_sample=False,
                            repetition_penalty=1.5, pad_token_id=0)[0, len(PROMPT):].tolist()
    assert ours.token_ids == ref
    plain = _tokens(llm, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    assert plain.token_ids != ours.token_ids  # the penalty changed something


def test_presence_and_frequency_penalties_discourage_repeats(llm):
    plain = _tokens(llm, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    penalized = _tokens(llm, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True,
                                            presence_penalty=2.0, frequency_penalty=2.0))
    assert len(set(penalized.token_ids)) > len(set(plain.token_ids))


def test_seeded_sampling_is_reproducible_and_batch_independent(llm):
    params = SamplingParams(temperature=1.0, top_k=50, min_p=0.01, seed=7, max_tokens=25,
                            ignore_eos=True)
    alone = _tokens(llm, params).token_ids
    others = [{"prompt_token_ids": list(range(500 + i, 530 + i))} for i in range(5)]
    batch = llm.generate([{"prompt_token_ids": PROMPT}] + others,
                         [params] + [SamplingParams(temperature=1.0, max_tokens=25)] * 5,
                         use_tqdm=False)
    assert batch[0].outputs[0].token_ids == alone
    other_seed = _tokens(llm, params.clone(seed=8)).token_ids
    assert other_seed != alone


def test_top_k_one_is_greedy(llm):
    greedy = _tokens(llm, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    top1 = _tokens(llm, SamplingParams(temperature=1.5, top_k=1, max_tokens=20, ignore_eos=True))
    tiny_p = _tokens(llm, SamplingParams(temperature=1.5, top_p=1e-6, max_tokens=20,
                                         ignore_eos=True))
    assert top1.token_ids == greedy.token_ids == tiny_p.token_ids


def test_n_samples_are_distinct_and_indexed(llm):
    out = llm.generate({"prompt_token_ids": PROMPT},
                       SamplingParams(n=4, temperature=1.0, seed=3, max_tokens=12,
                                      ignore_eos=True), use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2, 3]
    assert len({tuple(c.token_ids) for c in out.outputs}) == 4
    assert all(len(c.token_ids) == 12 and c.finish_reason == "length" for c in out.outputs)


def test_stop_strings_are_left_out_and_reported(llm):
    tokenizer = llm.engine.tokenizer
    free = _tokens(llm, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    text = free.text
    stop = text[len(text) // 2: len(text) // 2 + 3]
    assert stop.strip(), "need a visible stop string"
    cut = _tokens(llm, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop=[stop]))
    assert cut.text == text[: text.index(stop)]
    assert cut.finish_reason == "stop" and cut.stop_reason == stop
    assert stop in tokenizer.decode(cut.token_ids)  # the token is generated, the text left out
    kept = _tokens(llm, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True,
                                       stop=[stop], include_stop_str_in_output=True))
    assert kept.text == text[: text.index(stop) + len(stop)]


def test_stop_token_ids_min_tokens_and_eos(llm):
    free = _tokens(llm, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)).token_ids
    target = free[10]
    first = free.index(target)
    stopped = _tokens(llm, SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[target]))
    assert stopped.token_ids == free[: first + 1] and stopped.finish_reason == "stop"
    assert stopped.stop_reason == target
    delayed = _tokens(llm, SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[target],
                                          min_tokens=first + 2))
    assert target not in delayed.token_ids[: first + 2]
    assert len(delayed.token_ids) > first + 1


def test_eos_stops_unless_ignored(llm, tiny_model_dir):
    eos = min(llm.engine.tokenizer.eos_token_ids)
    free = _tokens(llm, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)).token_ids
    # make some generated token the EOS of a second engine on the same weights
    target = free[6]
    config_path = tiny_model_dir / "generation_config.json"
    original = config_path.read_text()
    try:
        config_path.write_text(json.dumps({**json.loads(original), "eos_token_id": [eos, target]}))
        llm2 = LLM(str(tiny_model_dir), dtype="float32", kv_cache_memory_bytes=1 << 22)
    finally:
        config_path.write_text(original)
    out = _tokens(llm2, SamplingParams(temperature=0, max_tokens=30))
    assert out.token_ids == free[: free.index(target) + 1] and out.finish_reason == "stop"
    ignored = _tokens(llm2, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    assert ignored.token_ids == free and ignored.finish_reason == "length"


def test_prompt_logprobs_match_transformers(llm, hf_model):
    out = llm.generate({"prompt_token_ids": PROMPT},
                       SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=2),
                       use_tqdm=False)[0]
    logits = hf_model(torch.tensor([PROMPT])).logits[0]
    ref = torch.log_softmax(logits.float(), dim=-1)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(PROMPT)
    for pos in range(1, len(PROMPT)):
        entry = out.prompt_logprobs[pos]
        assert entry[PROMPT[pos]].logprob == pytest.approx(ref[pos - 1, PROMPT[pos]].item(),
                                                            abs=1e-4)
        assert set(ref[pos - 1].topk(2).indices.tolist()) <= set(entry)


def test_prompt_logprobs_survive_chunked_prefill(tiny_model_dir, llm):
    chunked = LLM(str(tiny_model_dir), dtype="float32", kv_cache_memory_bytes=1 << 22,
                  max_num_batched_tokens=6)
    params = SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=1, logprobs=1)
    a = llm.generate({"prompt_token_ids": PROMPT}, params, use_tqdm=False)[0]
    b = chunked.generate({"prompt_token_ids": PROMPT}, params, use_tqdm=False)[0]
    assert len(b.prompt_logprobs) == len(PROMPT)
    for x, y in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:]):
        assert x.keys() == y.keys()
        assert all(x[t].logprob == pytest.approx(y[t].logprob, abs=1e-4) for t in x)
    assert a.outputs[0].token_ids == b.outputs[0].token_ids


def test_logprobs_rank_and_cumulative(llm):
    out = _tokens(llm, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=2))
    assert len(out.logprobs) == 10
    total = 0.0
    for token_id, entry in zip(out.token_ids, out.logprobs):
        assert entry[token_id].rank == 1  # greedy picks the most likely token
        assert len(entry) == 2  # the chosen token is also the top-1
        total += entry[token_id].logprob
    assert out.cumulative_logprob == pytest.approx(total, abs=1e-5)


def test_text_equals_full_decode_with_multibyte_characters(llm):
    tokenizer = llm.engine.tokenizer
    prompt = tokenizer.encode("Emoji and accents: 🎉 café 世界 ")
    out = _tokens(llm, SamplingParams(temperature=1.0, seed=11, max_tokens=60, ignore_eos=True),
                  prompt=prompt)
    assert out.text == tokenizer.decode(out.token_ids)
    assert "\ufffd" not in out.text or "\ufffd" in tokenizer.decode(out.token_ids)


def test_chat_applies_the_template(llm):
    out = llm.chat([{"role": "user", "content": "hi"}],
                   SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)[0]
    assert out.prompt.startswith("<|im_start|>") and out.prompt.endswith("assistant\n")


@pytest.mark.parametrize("kwargs, field", [
    (dict(max_tokens=0), "max_tokens"), (dict(temperature=-0.1), "temperature"),
    (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p"), (dict(n=0), "n"),
    (dict(top_k=-3), "top_k"), (dict(min_p=2.0), "min_p"), (dict(logprobs=-1), "logprobs"),
    (dict(stop=[""]), "stop"), (dict(min_tokens=5, max_tokens=2), "min_tokens"),
])
def test_bad_sampling_params_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=rf"^{field}:"):
        SamplingParams(**kwargs)


def test_bad_prompts_name_the_field_and_spare_others(llm):
    with pytest.raises(ValueError, match=r"^prompt:"):
        llm.generate("", SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match=r"^prompt_token_ids:"):
        llm.generate({"prompt_token_ids": [1, 10**9]}, SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match=r"^prompt_token_ids:"):
        llm.generate([[1, 2], [-5]], SamplingParams(max_tokens=2))
    out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2, ignore_eos=True),
                       use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 2
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.stats().kv_cache.num_free_blocks == llm.info.num_kv_blocks


def test_unknown_model_path_and_architecture(tmp_path):
    with pytest.raises(ValueError, match=r"^model:"):
        LLM(str(tmp_path / "nowhere"))
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["FooForCausalLM"]}))
    with pytest.raises(ValueError, match=r"^model: architecture"):
        LLM(str(tmp_path))
    with pytest.raises(ValueError, match=r"^max_num_seqs:"):
        LLM(str(tmp_path), max_num_seqs=0)
    with pytest.raises(ValueError, match=r"^not_an_arg:"):
        LLM(str(tmp_path), not_an_arg=1)


def test_stop_strings_wait_for_min_tokens(llm):
    free = _tokens(llm, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    tokenizer = llm.engine.tokenizer
    first_piece = tokenizer.decode(free.token_ids[:1])
    assert first_piece.strip()
    early = _tokens(llm, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True,
                                        stop=[first_piece]))
    assert early.text == "" and early.finish_reason == "stop"
    late = _tokens(llm, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True,
                                       stop=[first_piece], min_tokens=5))
    assert len(late.token_ids) > 5 or late.finish_reason == "length"
    assert late.text.startswith(first_piece)


def test_limits_on_logprobs_and_sample_ids(llm):
    with pytest.raises(ValueError, match="^logprobs: must be >= 0 and <= 20"):
        llm.generate([[1, 2]], SamplingParams(logprobs=21))
    with pytest.raises(ValueError, match="^prompt_logprobs: must be >= 0 and <= 20"):
        llm.generate([[1, 2]], SamplingParams(prompt_logprobs=1000))
    engine = llm.engine
    engine.add_request("1_x", {"prompt_token_ids": [1, 2, 3]}, SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="^request_id: 'x' would reuse the live sample id"):
        engine.add_request("x", {"prompt_token_ids": [1, 2, 3]}, SamplingParams(n=2))
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.stats().kv_cache.num_free_blocks == engine.info.num_kv_blocks


def test_delta_outputs_of_parallel_samples_carry_only_news(llm):
    from engine_worker import RequestOutputKind

    engine = llm.engine
    params = SamplingParams(n=3, temperature=1.0, seed=5, ignore_eos=True,
                            output_kind=RequestOutputKind.DELTA)
    params.max_tokens = 4
    engine.add_request("d", {"prompt_token_ids": PROMPT}, params)
    pieces: dict[int, list[int]] = {0: [], 1: [], 2: []}
    finishes: dict[int, int] = {0: 0, 1: 0, 2: 0}
    while engine.has_unfinished_requests():
        for out in engine.step().outputs:
            for c in out.outputs:
                assert c.token_ids, "a sample without news was sent"
                pieces[c.index] += c.token_ids
                finishes[c.index] += c.finish_reason is not None
    assert all(len(v) == 4 for v in pieces.values()) and set(finishes.values()) == {1}
    full = llm.generate({"prompt_token_ids": PROMPT}, SamplingParams(
        n=3, temperature=1.0, seed=5, max_tokens=4, ignore_eos=True), use_tqdm=False)[0]
    assert [pieces[i] for i in range(3)] == [c.token_ids for c in full.outputs]


@pytest.mark.slow  # starts engine processes
def test_the_backend_is_said_once_at_start_and_loudly_when_a_fallback(tiny_model_dir):
    """``LLM(...)`` with logging left unconfigured, as a user runs it: a fallback to the
    reference ops shows on stderr in one block, once; the fast path stays quiet."""
    import subprocess
    import sys

    from engine_worker.backends import select_backend

    code = ("from engine_worker import LLM\n"
            f"LLM({str(tiny_model_dir)!r}, dtype='float32', kv_cache_memory_bytes=1 << 24)\n")
    stderr = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            check=True, timeout=600).stderr
    lines = [line for line in stderr.splitlines() if "Backend: " in line]
    choice = select_backend("auto", torch.device("cpu"))  # what the child chose
    if not choice.fallback:
        assert lines == []
    else:
        assert lines == [f"  Backend: {choice.describe()}"]
        assert stderr.count("Engine ready in ") == 1


def test_start_shows_progress_and_one_summary_of_the_choices(tiny_model_dir, caplog):
    import logging

    caplog.set_level(logging.INFO, logger="engine_worker")
    llm = LLM(str(tiny_model_dir), dtype="float32", kernels="torch", max_model_len=512,
              kv_cache_memory_bytes=1 << 24)
    messages = [r.getMessage() for r in caplog.records]
    for step in ("Loading weights from", "Packing weights for the torch backend",
                 "Loading the tokenizer", "Allocating the KV cache"):
        assert any(m.startswith(step) and ": done in " in m for m in messages), step
    summaries = [r for r in caplog.records if r.getMessage().startswith("Engine ready in ")]
    assert len(summaries) == 1 and summaries[0].levelno == logging.INFO
    num_blocks = llm.info.num_kv_blocks
    assert llm.info.host_malloc  # what the engine did with malloc, glibc or not
    block_bytes = 3 * 2 * 2 * 16 * 16 * 4  # layers, K and V, kv heads, head dim, tokens, fp32
    assert summaries[0].getMessage().splitlines()[1:] == [
        "  Device: cpu, %d threads, dtype float32" % torch.get_num_threads(),
        "  Backend: torch (reference ops): requested (kernels=torch)",
        "  Layers: per-layer (one Python call per op: the backend fuses none of this model's "
        "stack here, slower on a CPU)",
        "  CUDA graphs: off (cpu)",
        f"  KV cache: {num_blocks} blocks x 16 tokens = {num_blocks * 16} tokens, "
        f"{num_blocks * block_bytes / 2**30:.2f} GiB ({block_bytes // 16} bytes a token)",
        f"  Host malloc: {llm.info.host_malloc}",
        "  KV cache pages: mapped lazily: pages fault in as steps first use them "
        "(kv_cache_prefault off)",
        f"  Max model len: 512 tokens ({num_blocks * 16 / 512:.2f} full-length sequences "
        f"fit at once)"]
