"""Progress lines for the steps a user waits on at start."""

from __future__ import annotations

import logging
import time

import pytest

from engine_worker.progress import progress, start_summary

LOGGER = logging.getLogger("tests.progress")


def test_a_step_says_when_it_starts_while_it_runs_and_when_it_ends(caplog):
    caplog.set_level(logging.INFO, logger=LOGGER.name)
    with progress(LOGGER, "Converting the model", expect="first start only",
                  heartbeat_s=0.05):
        time.sleep(0.3)
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0] == "Converting the model (first start only)..."
    assert lines[-1].startswith("Converting the model: done in 0.")
    beats = lines[1:-1]
    assert len(beats) >= 2 and all(b.startswith("Converting the model: still running, ")
                                   for b in beats)


def test_a_failing_step_stops_its_heartbeat_and_says_nothing_done(caplog):
    caplog.set_level(logging.INFO, logger=LOGGER.name)
    with pytest.raises(RuntimeError):
        with progress(LOGGER, "Building", heartbeat_s=0.01):
            raise RuntimeError("no compiler")
    count = len(caplog.records)
    time.sleep(0.05)
    assert len(caplog.records) == count  # no ticker left running
    assert not any("done in" in r.getMessage() for r in caplog.records)


def test_the_start_block_says_what_runs_from_the_engine_facts():
    from tests.unit.engine_infos import engine_info

    info = engine_info()
    assert start_summary(info, elapsed_s=3.4).splitlines() == [
        "Engine ready in 3.4 s: tiny-llama (LlamaForCausalLM)",
        "  Device: cpu, 2 threads, dtype float32",
        "  Backend: torch (reference ops): requested (kernels=torch)",
        "  Layers: per-layer (one Python call per op: the backend fuses none of this model's "
        "stack here, slower on a CPU)",
        "  CUDA graphs: off (cpu)",
        "  KV cache: 64 blocks x 16 tokens = 1024 tokens, 0.00 GiB (1536 bytes a token)",
        "  Max model len: 512 tokens (2.00 full-length sequences fit at once)"]


def test_the_start_block_says_how_a_quantized_checkpoint_runs():
    from tests.unit.engine_infos import engine_info

    summary = "gguf: the checkpoint's own format runs natively (61 F32, 210 Q4_1, 1 Q8_0)"
    info = engine_info(quantization="gguf", quantization_summary=summary)
    assert start_summary(info, elapsed_s=1.0).splitlines()[3] == f"  Quantization: {summary}"


def test_the_start_block_on_a_profiled_gpu_shows_the_memory_and_no_threads():
    import torch

    from tests.unit.engine_infos import engine_info

    info = engine_info(device=torch.device("cuda", 0), dtype=torch.bfloat16,
                       num_kv_blocks=4096, kv_block_bytes=1 << 20, cuda_graphs="on (2 batch "
                       "sizes, 1 to 2)", memory="80.0 GiB x 0.90: weights 16.00, KV cache 4.00 GiB")
    lines = start_summary(info, elapsed_s=1.0).splitlines()
    assert lines[1] == "  Device: cuda:0, dtype bfloat16"
    assert lines[5] == ("  KV cache: 4096 blocks x 16 tokens = 65536 tokens, 4.00 GiB "
                        "(65536 bytes a token)")
    assert lines[6] == "  Memory: 80.0 GiB x 0.90: weights 16.00, KV cache 4.00 GiB"
    assert lines[7] == "  Max model len: 512 tokens (128.00 full-length sequences fit at once)"
