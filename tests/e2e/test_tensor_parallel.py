"""Tensor and pipeline parallelism on CPU (shared memory, gloo): tp 2 and 4, pp 2 and 2 x 2
against the single-process engine, the
features that must not notice it, `quire engine --tensor-parallel-size 2` over gRPC, and the
workers' lifecycle (no orphans after SIGKILL of the engine, a dead worker fails the engine
loudly, SIGTERM drains).

Outputs are compared by vLLM's rule for parallel runs: greedy tokens equal, or, where an
all-reduce's summation order flips a near-tie, each side's token within the other's top-5
logprobs at the first divergence (and nothing compared after it).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2

from engine_worker import LLM, SamplingParams
from engine_worker.lora.request import LoRARequest
from engine_worker.server.config import ServerConfig
from quire.v1 import engine_pb2 as pb
from quire.v1 import engine_pb2_grpc
from quire_cli.stack import EXAMPLE_QUESTION
from tests.conftest import build_tiny_model
from tests.e2e.lora_adapters import make_adapter
from tests.e2e.test_engine_server import RunningServer, _collect, _request

pytestmark = pytest.mark.slow  # starts worker processes

# chunked prefill: a prompt longer than 32 tokens runs in several steps
ENGINE = dict(dtype="float32", kv_cache_memory_bytes=1 << 24, num_threads=1,
              max_num_batched_tokens=32, max_num_seqs=8)
PROMPTS = [list(range(100, 112)), list(range(300, 380)), [7, 8, 9, 10, 11]]
GREEDY = SamplingParams(temperature=0, max_tokens=8, logprobs=5, ignore_eos=True)


@pytest.fixture(scope="module")
def bias_model_dir(tmp_path_factory, embedded_model_dir) -> Path:
    """8 query heads on 4 KV heads, untied logits, q/k/v/o biases: every slicing rule."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny-tp"), embedded_model_dir,
                            num_heads=8, num_kv_heads=4, hidden_size=64,
                            tie_word_embeddings=False, attention_bias=True, seed=3)


@pytest.fixture(scope="module")
def tp2(bias_model_dir):
    with LLM(str(bias_model_dir), tensor_parallel_size=2, **ENGINE) as llm:
        yield llm


@pytest.fixture(scope="module")
def single(bias_model_dir):
    return LLM(str(bias_model_dir), **ENGINE)


def assert_parallel_equal(expected, actual) -> None:
    """vLLM's rule (tests/models/utils.py check_logprobs_close) on one completion each."""
    for e, a in zip(expected, actual, strict=True):
        e_ids, a_ids = e.outputs[0].token_ids, a.outputs[0].token_ids
        for pos, (e_id, a_id) in enumerate(zip(e_ids, a_ids)):
            if e_id != a_id:
                assert e_id in a.outputs[0].logprobs[pos], (pos, e_ids, a_ids)
                assert a_id in e.outputs[0].logprobs[pos], (pos, e_ids, a_ids)
                break
        else:
            assert len(e_ids) == len(a_ids)


def test_tp2_greedy_equals_one_process_with_chunked_prefill_and_prefix_caching(tp2, single):
    assert tp2.info.tensor_parallel_size == 2 and tp2.info.all_reduce_backend.startswith("shm")
    assert len(tp2.info.worker_pids) == 1
    expected = single.generate(PROMPTS, GREEDY, use_tqdm=False)
    first = tp2.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert_parallel_equal(expected, first)
    again = tp2.generate(PROMPTS, GREEDY, use_tqdm=False)  # the prompts' blocks are cached
    assert again[1].num_cached_tokens >= 64
    assert_parallel_equal(expected, again)


def test_tp2_sampling_n_gt_1_and_logprobs_match_one_process(tp2, single):
    params = SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=6, ignore_eos=True,
                            logprobs=2)
    expected = single.generate(PROMPTS[:2], params, use_tqdm=False)
    actual = tp2.generate(PROMPTS[:2], params, use_tqdm=False)
    for e, a in zip(expected, actual):
        assert [c.token_ids for c in a.outputs] == [c.token_ids for c in e.outputs]
        for ec, ac in zip(e.outputs, a.outputs):
            for e_pos, a_pos in zip(ec.logprobs, ac.logprobs):
                assert e_pos.keys() == a_pos.keys()
                for token_id, lp in e_pos.items():
                    assert a_pos[token_id].logprob == pytest.approx(lp.logprob, abs=1e-4)


def test_tp4_replicates_kv_heads_and_matches_one_process(tiny_model_dir):
    # 4 query heads on 2 KV heads: each KV head lives on two of the four ranks
    expected = LLM(str(tiny_model_dir), **ENGINE).generate(PROMPTS, GREEDY, use_tqdm=False)
    with LLM(str(tiny_model_dir), tensor_parallel_size=4, **ENGINE) as llm:
        assert len(llm.info.worker_pids) == 3
        assert_parallel_equal(expected, llm.generate(PROMPTS, GREEDY, use_tqdm=False))


@pytest.mark.parametrize("tp, pp", [(1, 2), (2, 2)])
def test_pipeline_stages_match_one_process(bias_model_dir, single, tp, pp):
    # 3 layers: stage 0 holds layer 0, stage 1 layers 1 and 2; at tp 2 x pp 2 every rank
    # faults its cache in at start, as a server's do (its other stages' layers are empty)
    expected = single.generate(PROMPTS, GREEDY, use_tqdm=False)
    with LLM(str(bias_model_dir), tensor_parallel_size=tp, pipeline_parallel_size=pp,
             kv_cache_prefault=tp == 2, **ENGINE) as llm:
        assert (llm.info.tensor_parallel_size, llm.info.pipeline_parallel_size) == (tp, pp)
        assert llm.info.kv_cache_pages.startswith("faulted in at start" if tp == 2
                                                  else "mapped lazily")
        assert len(llm.info.worker_pids) == tp * pp - 1
        assert_parallel_equal(expected, llm.generate(PROMPTS, GREEDY, use_tqdm=False))
        again = llm.generate(PROMPTS, GREEDY, use_tqdm=False)  # from the prefix cache
        assert again[1].num_cached_tokens >= 64
        assert_parallel_equal(expected, again)


def test_more_stages_than_layers_is_refused(tiny_model_dir):
    with pytest.raises(ValueError, match="pipeline_parallel_size: 4 exceeds the model's 3 "
                                         "layers"):
        LLM(str(tiny_model_dir), pipeline_parallel_size=4, **ENGINE)


@pytest.mark.parametrize("size, words", [(3, "3 does not divide the model's 4 attention heads"),
                                         (8, "8 does not divide the model's 4 attention heads")])
def test_a_size_that_does_not_split_the_model_is_refused_naming_both(tiny_model_dir, size,
                                                                      words):
    with pytest.raises(ValueError, match=f"tensor_parallel_size: {words}"):
        LLM(str(tiny_model_dir), tensor_parallel_size=size, **ENGINE)


# ------------------------------------------------------------------ GGUF blocks and LoRA
def test_smollm2_at_tp3_splits_its_gguf_blocks_and_matches_one_process():
    # the embedded model: 9 query heads on 3 KV heads, MLP width 1536, its linear layers
    # Q4_1 / Q8_0 blocks run natively: q/k/v, gate/up and the tied logits split by rows, o
    # and down by whole blocks of input columns (18 and 48 blocks a row: 6 and 16 a rank)
    engine = ENGINE | dict(kv_cache_memory_bytes=1 << 25)
    single = LLM(**engine)
    assert single.info.quantization == "gguf"
    expected = single.generate(PROMPTS, GREEDY, use_tqdm=False)
    with LLM(tensor_parallel_size=3, **engine) as llm:
        assert llm.info.quantization == "gguf"
        assert len(llm.info.worker_pids) == 2
        assert_parallel_equal(expected, llm.generate(PROMPTS, GREEDY, use_tqdm=False))


@pytest.fixture(scope="module")
def tp_adapters(bias_model_dir, tmp_path_factory) -> dict[str, LoRARequest]:
    root = tmp_path_factory.mktemp("tp-lora")
    specs = {"all": dict(r=8, seed=1),
             "some": dict(r=4, seed=2, targets=("q_proj", "v_proj", "o_proj", "down_proj"))}
    return {name: LoRARequest(name, i + 1, make_adapter(bias_model_dir, root / name, **spec))
            for i, (name, spec) in enumerate(specs.items())}


@pytest.mark.parametrize("tp, pp", [(2, 1), (1, 2)])
def test_lora_adapters_split_across_ranks_match_one_process(bias_model_dir, tp_adapters, tp,
                                                            pp):
    # both adapters and the base model in one step; then an adapter registered while the
    # workers run, and a name re-pointed at another adapter's weights
    lora = dict(enable_lora=True, max_loras=2, max_lora_rank=8)
    loras = [tp_adapters["all"], tp_adapters["some"], None]
    single = LLM(str(bias_model_dir), **ENGINE, **lora)
    expected = single.generate(PROMPTS, GREEDY, use_tqdm=False, lora_request=loras)
    base = single.generate(PROMPTS, GREEDY, use_tqdm=False)
    for adapted, plain in zip(expected[:2], base[:2]):  # the adapters change the output
        assert adapted.outputs[0].token_ids != plain.outputs[0].token_ids
    with LLM(str(bias_model_dir), tensor_parallel_size=tp, pipeline_parallel_size=pp,
             **ENGINE, **lora) as llm:
        assert_parallel_equal(expected, llm.generate(PROMPTS, GREEDY, use_tqdm=False,
                                                     lora_request=loras))
        engine = llm.engine
        assert engine.remove_lora("all")
        repointed = LoRARequest("all", 7, tp_adapters["some"].lora_path)
        engine.add_lora(repointed)
        again = llm.generate(PROMPTS[:2], GREEDY, use_tqdm=False, lora_request=repointed)
    assert_parallel_equal(
        single.generate(PROMPTS[:2], GREEDY, use_tqdm=False, lora_request=tp_adapters["some"]),
        again)



@pytest.fixture(scope="module")
def fused_model_dir(tmp_path_factory, embedded_model_dir) -> Path:
    """Head size 32 and hidden size 128: shapes every CPU set's fused layer stack takes."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny-fused"), embedded_model_dir,
                            num_heads=4, num_kv_heads=2, hidden_size=128, seed=5)


@pytest.mark.parametrize("tp, pp, with_lora", [(2, 1, False), (1, 2, False), (2, 1, True),
                                             (1, 2, True)])
def test_the_fused_layer_stack_runs_split_and_matches_one_process(
        fused_model_dir, tmp_path_factory, tp, pp, with_lora):
    # every layer in one kernel call a step on each rank: under tensor parallelism the call
    # sums o_proj's and down's partial outputs in shared memory itself; a pipeline stage's
    # call runs its own layers. bf16: the dtype every CPU set's fused stack takes.
    engine = ENGINE | dict(dtype="bfloat16")
    kwargs, loras = {}, None
    if with_lora:
        kwargs = dict(enable_lora=True, max_loras=2, max_lora_rank=8)
        root = tmp_path_factory.mktemp("fused-lora")
        loras = [LoRARequest("a", 1, make_adapter(fused_model_dir, root / "a", r=8, seed=1)),
                 None, LoRARequest("b", 2, make_adapter(fused_model_dir, root / "b", r=4,
                                                        seed=2))]
    single = LLM(str(fused_model_dir), **engine, **kwargs)
    expected = single.generate(PROMPTS, GREEDY, use_tqdm=False, lora_request=loras)
    with LLM(str(fused_model_dir), tensor_parallel_size=tp, pipeline_parallel_size=pp,
             **engine, **kwargs) as llm:
        assert single.info.layer_execution == llm.info.layer_execution == "fused"
        assert_parallel_equal(expected, llm.generate(PROMPTS, GREEDY, use_tqdm=False,
                                                     lora_request=loras))


@pytest.mark.parametrize("model", ["bias", "fused"])
def test_pipeline_micro_batches_match_one_process(bias_model_dir, fused_model_dir,
                                                  monkeypatch, model):
    # steps of up to 256 tokens: each stage passes the step on in pieces of at least 64
    # tokens (cutting prompts mid-chunk), the next stage running one while this one runs the
    # next; per layer (the bias model's head size) and fused (bf16, shapes every set fuses)
    from engine_worker.attention.metadata import AttentionMetadata

    pieces = []
    token_range = AttentionMetadata.token_range
    monkeypatch.setattr(AttentionMetadata, "token_range", lambda self, start, end: (
        pieces.append((start, end)), token_range(self, start, end))[1])
    model_dir, dtype = {"bias": (bias_model_dir, "float32"),
                        "fused": (fused_model_dir, "bfloat16")}[model]
    engine = ENGINE | dict(max_num_batched_tokens=256, dtype=dtype)
    prompts = [list(range(100, 250)), list(range(400, 490)), list(range(600, 640))]
    expected = LLM(str(model_dir), **engine).generate(prompts, GREEDY, use_tqdm=False)
    assert not pieces  # one stage: the step whole
    with LLM(str(model_dir), pipeline_parallel_size=2, **engine) as llm:
        assert_parallel_equal(expected, llm.generate(prompts, GREEDY, use_tqdm=False))
    # this process is stage 0: the first step's 256 tokens went as 4 pieces of 64
    assert pieces[:4] == [(0, 64), (64, 128), (128, 192), (192, 256)]

# ------------------------------------------------------------------------- lifecycle
def _alive(pid: int) -> bool:
    """Running (a zombie left to an init that does not reap counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _children(pid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        found.append(int(entry))
            except (FileNotFoundError, ProcessLookupError):
                pass
    return found


def _wait_gone(pids: list[int], timeout_s: float = 20.0) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and any(_alive(p) for p in pids):
        time.sleep(0.1)
    return [p for p in pids if _alive(p)]


def _kill_all(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_workers_die_with_an_engine_killed_by_sigkill(tmp_path, tiny_model_dir):
    script = textwrap.dedent(f"""
        from engine_worker import LLM
        llm = LLM({str(tiny_model_dir)!r}, tensor_parallel_size=2, dtype="float32",
                  kv_cache_memory_bytes=1 << 24, num_threads=1)
        print("pids", *llm.info.worker_pids, flush=True)
        import time
        time.sleep(600)
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    workers: list[int] = []
    try:
        line = proc.stdout.readline()
        assert line.startswith("pids "), line
        workers = [int(p) for p in line.split()[1:]]
        children = _children(proc.pid)  # the workers and multiprocessing's resource tracker
        assert set(workers) <= set(children) and all(_alive(p) for p in workers)
        proc.kill()
        proc.wait(10)
        assert _wait_gone(children) == []
    finally:
        proc.kill()
        _kill_all(workers + _children(proc.pid))


def test_a_worker_that_dies_before_joining_fails_the_start_naming_the_cause(tmp_path,
                                                                            tiny_model_dir):
    # a script without a __main__ guard: each spawned worker imports it again and dies there
    # (multiprocessing refuses to spawn during its bootstrap); the start must fail, not hang
    script = tmp_path / "unguarded.py"
    script.write_text(textwrap.dedent(f"""
        from engine_worker import LLM
        llm = LLM({str(tiny_model_dir)!r}, tensor_parallel_size=2, dtype="float32",
                  kv_cache_memory_bytes=1 << 24, num_threads=1)
        print("started", flush=True)
    """))
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=120, cwd=Path(__file__).parents[2])
    assert done.returncode != 0 and "started" not in done.stdout
    assert re.search(r"RuntimeError: tensor-parallel worker rank 1 \(pid \d+\) exited with code "
                     r"1 before joining the engine .*if __name__ == '__main__'", done.stderr), \
        done.stderr[-3000:]


def test_a_dead_worker_fails_the_engine_loudly(tiny_model_dir):
    llm = LLM(str(tiny_model_dir), tensor_parallel_size=2, **ENGINE)
    server = RunningServer(llm.engine, ServerConfig(host="127.0.0.1", port=0))
    try:
        streams = [server.stub.Generate(_request([5, 6, 7 + i], max_tokens=900))
                   for i in range(2)]
        for stream in streams:
            next(stream)  # both are running
        os.kill(llm.info.worker_pids[0], signal.SIGKILL)
        for stream in streams:
            with pytest.raises(grpc.RpcError) as err:
                _collect(stream)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "tensor-parallel worker rank 1" in err.value.details()
        deadline, status = time.monotonic() + 10, None
        while time.monotonic() < deadline:
            status = server.health.Check(health_pb2.HealthCheckRequest()).status
            if status == health_pb2.HealthCheckResponse.NOT_SERVING:
                break
            time.sleep(0.05)
        assert status == health_pb2.HealthCheckResponse.NOT_SERVING
        with pytest.raises(grpc.RpcError) as err:
            _collect(server.stub.Generate(_request([1, 2], max_tokens=2)))
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        server.close()
        llm.shutdown()


def test_quire_engine_serves_with_tp2_over_grpc_and_drains_on_sigterm(tiny_model_dir):
    proc = subprocess.Popen(
        [sys.executable, "-m", "quire_cli", "engine", "--model", str(tiny_model_dir),
         "--dtype", "float32", "--kv-cache-memory-bytes", str(1 << 24), "--host", "127.0.0.1",
         "--port", "0", "--metrics-port", "0", "--drain-timeout-s", "60",
         "--tensor-parallel-size", "2"],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    children: list[int] = []
    try:
        line = proc.stdout.readline()
        match = re.search(r"listening on 127\.0\.0\.1:(\d+)", line)
        assert match, line
        children = _children(proc.pid)
        channel = grpc.insecure_channel(f"127.0.0.1:{match.group(1)}")
        stub = engine_pb2_grpc.EngineServiceStub(channel)
        info = stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
        assert (info.tensor_parallel_size, info.pipeline_parallel_size,
                info.all_reduce_backend[:3], info.distributed_executor_backend) == (2, 1, "shm",
                                                                                "mp")
        tokens, _, last = _collect(stub.Generate(_request([1, 2, 3, 4], max_tokens=5)))
        assert len(tokens) == 5 and last.finished
        result = {}

        def long_request():
            result["tokens"] = _collect(stub.Generate(_request([9, 8, 7], max_tokens=60)))[0]
        client = threading.Thread(target=long_request)
        client.start()
        time.sleep(1.0)
        proc.send_signal(signal.SIGTERM)  # drains: the request in flight still finishes
        client.join(120)
        assert len(result.get("tokens", [])) == 60
        assert proc.wait(60) == 0
        assert _wait_gone(children) == []
    finally:
        proc.kill()
        _kill_all(children)


def test_quire_up_runs_a_tp2_engine_behind_the_router(tiny_model_dir):
    result = subprocess.run(
        [sys.executable, "-m", "quire_cli", "up", "--model", str(tiny_model_dir), "--dtype",
         "float32", "--kv-cache-memory-bytes", str(1 << 24), "--router-port", "0",
         "--http-port", "0", "--num-engines", "1", "--tensor-parallel-size", "2", "--once",
         "true"], capture_output=True, text=True, timeout=400)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "tensor_parallel_size=2" in result.stderr
    assert re.search(rf"example: {re.escape(repr(EXAMPLE_QUESTION))} -> '.+'", result.stdout)
