"""``quire bench compare --peer llama.cpp``'s own arithmetic (the peer itself runs only in the
benchmark: llama-cpp-python is never installed for the tests)."""

from __future__ import annotations

import numpy as np
import pytest

from quire_cli.bench.llama_compare import (DEQUANTIZED, LLAMA, NATIVE, _best, _ratios,
                                           gguf_step_bytes, throughput_figures, turn_order)


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
