"""``quire bench compare --peer llama.cpp``'s own arithmetic (the peer itself runs only in the
benchmark: llama-cpp-python is never installed for the tests)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from quire_cli.bench.llama_compare import (DEQUANTIZED, LLAMA, NATIVE, _best, _ratios,
                                           alternate_decode, gguf_step_bytes,
                                           native_step_fit, step_fit, throughput_figures,
                                           turn_order)


def test_best_of_the_runs_and_the_ratios():
    runs = {NATIVE: _best({"decode_runs": [150.0, 180.0, 170.0], "ttft_runs_s": [1.2, 1.0, 1.1],
                           "throughput": {"output_tokens_per_s": 200.0}}),
            DEQUANTIZED: _best({"decode_runs": [80.0, 90.0], "ttft_runs_s": [1.5, 2.0],
                                "throughput": {"output_tokens_per_s": 180.0}}),
            LLAMA: _best({"decode_runs": [120.0], "ttft_runs_s": [2.0]})}
    assert runs[NATIVE]["decode_tokens_per_s"] == 180.0 and runs[NATIVE]["ttft_s"] == 1.0
    ratios = _ratios(runs)
    assert ratios["decode_native_over_dequantize"] == pytest.approx(2.0)
    assert ratios["decode_native_over_llama_cpp"] == pytest.approx(1.5)
    assert ratios["ttft_native_over_llama_cpp"] == pytest.approx(0.5)
    assert ratios["throughput_native_over_dequantize"] == pytest.approx(200 / 180)
    del runs[LLAMA]
    assert "decode_native_over_llama_cpp" not in _ratios(runs)


def test_the_step_fit_recovers_the_bandwidth_and_fixed_time_the_rates_were_made_from():
    def rate(step_bytes, gb_per_s, fixed_ms):
        return 1 / (step_bytes / (gb_per_s * 1e9) + fixed_ms / 1e3)

    native, dequantized = 96.5e6, 208.3e6
    fit = step_fit(native, rate(native, 40.0, 1.0), dequantized, rate(dequantized, 40.0, 1.0))
    assert fit["bandwidth_gb_per_s"] == pytest.approx(40.0)
    assert fit["fixed_ms"] == pytest.approx(1.0)
    assert fit["ratio_ceiling"] == pytest.approx(dequantized / native)
    # the ratio itself stays below the ceiling by what the fixed time adds to each step
    ratio = rate(native, 40.0, 1.0) / rate(dequantized, 40.0, 1.0)
    assert 1.8 < ratio < fit["ratio_ceiling"]
    # a path streaming more bytes that is not slower fits no shared bandwidth
    assert step_fit(native, 200.0, dequantized, 200.0) is None
    assert step_fit(dequantized, 100.0, native, 300.0) is None
    # the runs' form: the best rates, or the median of the turns' own fits
    turns = [(40.0, 1.0), (30.0, 1.2), (45.0, 0.9)]
    runs = {NATIVE: {"step_bytes": native, "decode_runs": [rate(native, *t) for t in turns]},
            DEQUANTIZED: {"step_bytes": dequantized,
                          "decode_runs": [rate(dequantized, *t) for t in turns]}}
    for r in runs.values():
        r["decode_tokens_per_s"] = max(r["decode_runs"])
    assert native_step_fit(runs)["bandwidth_gb_per_s"] == pytest.approx(45.0)
    paired = native_step_fit(runs, paired=True)
    assert paired["bandwidth_gb_per_s"] == pytest.approx(40.0)
    assert paired["fixed_ms"] == pytest.approx(1.0) and paired["turns"] == 3


def test_the_batched_workload_alternates_and_pairs_its_turns():
    assert [turn_order([NATIVE, DEQUANTIZED], t) for t in range(3)] == [
        [NATIVE, DEQUANTIZED], [DEQUANTIZED, NATIVE], [NATIVE, DEQUANTIZED]]

    def turn(rate):
        return {"elapsed_s": 1000 / rate, "num_output_tokens": 1000, "output_tokens_per_s": rate}

    # the machine slows in turn 2: each turn's pair says native is ahead, the medians less so
    turns = {NATIVE: [turn(600.0), turn(400.0), turn(620.0)],
             DEQUANTIZED: [turn(580.0), turn(380.0), turn(610.0)]}
    median, rates, paired = throughput_figures(turns)
    assert median[NATIVE]["output_tokens_per_s"] == 600.0
    assert median[DEQUANTIZED]["output_tokens_per_s"] == 580.0
    assert rates[DEQUANTIZED] == [580.0, 380.0, 610.0]
    assert paired == pytest.approx(600 / 580)
    # an even count: the lower middle turn, a run that happened
    median, _, paired = throughput_figures({n: t[:2] for n, t in turns.items()})
    assert median[NATIVE]["output_tokens_per_s"] == 400.0
    assert paired == pytest.approx((600 / 580 + 400 / 380) / 2)


def test_decode_turns_alternate_between_two_real_engines_and_pair_up(tiny_model_dir):
    """Each turn runs one prompt pair on each engine, the first swapping each turn; the first
    turn is a warm-up; the paired ratio is the median of the turns' ratios."""
    import statistics

    from engine_worker import LLM

    calls = []
    llms = {}
    for name in (NATIVE, DEQUANTIZED):
        llm = LLM(str(tiny_model_dir), dtype="float32", kv_cache_memory_bytes=1 << 22)
        real = llm.generate

        def spy(prompts, params, _name=name, _real=real, **kw):
            calls.append((_name, prompts[0]["prompt_token_ids"], params[0].max_tokens))
            return _real(prompts, params, **kw)

        llm.generate = spy
        llms[name] = llm
    pairs = [([1, 2], [3, 4]), ([5, 6], [7, 8]), ([9, 10], [11, 12]), ([13], [14])]
    rates, paired = alternate_decode(llms, {"decode_output_len": 6, "decode_prompt_pairs": pairs})
    first = [NATIVE, DEQUANTIZED, DEQUANTIZED, NATIVE] * 2
    assert [c[0] for c in calls[::2]] == first
    # each engine's turn: the pair's short prompt for one token, then its long one for six
    assert [(c[1], c[2]) for c in calls[:4]] == [([1, 2], 1), ([3, 4], 6)] * 2
    assert [(c[1], c[2]) for c in calls[4:8]] == [([5, 6], 1), ([7, 8], 6)] * 2
    assert len(rates[NATIVE]) == len(rates[DEQUANTIZED]) == 3
    # a number a turn; not its sign: 5 decode steps of a tiny model are a few ms, and a
    # one-token generate preempted on a loaded machine (CI runs the vLLM tests beside these)
    # can outlast the six-token one
    assert all(math.isfinite(r) for rs in rates.values() for r in rs)
    assert paired == pytest.approx(statistics.median(
        a / b for a, b in zip(rates[NATIVE], rates[DEQUANTIZED])))


def test_a_step_streams_every_tensor_of_the_file(tmp_path):
    gguf = pytest.importorskip("gguf")
    from gguf.quants import quantize

    path = tmp_path / "t.gguf"
    writer = gguf.GGUFWriter(path, "llama")
    w = np.random.default_rng(0).standard_normal((8, 64)).astype(np.float32)
    raw = quantize(w, gguf.GGMLQuantizationType.Q4_1)
    writer.add_tensor("blk.0.attn_q.weight", raw, raw_dtype=gguf.GGMLQuantizationType.Q4_1)
    writer.add_tensor("output_norm.weight", np.ones(64, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert gguf_step_bytes(path) == 8 * 2 * 20 + 64 * 4
