"""The OpenAI front needs only its FrontSeam: health, models and keys follow the router state the
seam reports, with no RouterServer, engine or gRPC front behind it."""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request

import pytest

from router.auth import ApiKeys
from router.config import RouterServerConfig
from router.metrics import RouterMetrics
from router.openai_api import FrontSeam, OpenAIFront
from router.openai_protocol import RequestError, check_body


def _send(port: int, path: str, key: str | None = None, body: dict | None = None):
    """(status, JSON body, headers) of one request (a POST when ``body`` is given)."""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    data = None
    if body is not None:
        data = json.dumps(body).encode()
        headers["Content-Type"] = "application/json"
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=data,
                                     headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, json.loads(response.read()), response.headers
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read()), e.headers


def _get(port: int, path: str, key: str | None = None) -> tuple[int, dict]:
    status, body, _ = _send(port, path, key)
    return status, body


async def _no_generate(request, context):
    raise AssertionError("these routes never generate")
    yield  # an async generator, like the servicer's Generate


def test_health_models_and_keys_follow_the_seam():
    states = {"serving": 0, "not_serving": 0, "unreachable": 1, "refused": 0}
    draining = [False]
    seam = FrontSeam(generate=_no_generate, keys=ApiKeys(["k1"]), session_header="x-session-id",
                     model_name=lambda: "m", tokenizer=lambda: None,
                     engine_states=lambda: dict(states), draining=lambda: draining[0])

    async def scenario():
        front = OpenAIFront(seam, RouterServerConfig(), RouterMetrics(lambda: dict(states)))
        port = await front.start()
        try:
            health = await asyncio.to_thread(_get, port, "/health")
            assert health == (503, {"serving_engines": 0, "engines": states})
            states.update(serving=1, unreachable=0)
            assert (await asyncio.to_thread(_get, port, "/health"))[0] == 200
            draining[0] = True
            assert (await asyncio.to_thread(_get, port, "/health"))[0] == 503
            status, body = await asyncio.to_thread(_get, port, "/v1/models")
            assert status == 401 and body["error"]["param"] == "authorization"
            status, body = await asyncio.to_thread(_get, port, "/v1/models", "k1")
            assert status == 200 and [m["id"] for m in body["data"]] == ["m"]
        finally:
            await front.stop()
    asyncio.run(scenario())


def test_before_the_model_is_known_models_and_requests_answer_503_with_retry_after():
    """No placeholder model name: a client that lists models at start would otherwise get
    404 for the placeholder once the engines' model is known."""
    states = {"serving": 0, "not_serving": 0, "unreachable": 1, "refused": 0}
    model = [None]
    seam = FrontSeam(generate=_no_generate, keys=ApiKeys([]), session_header="x-session-id",
                     model_name=lambda: model[0], tokenizer=lambda: None,
                     engine_states=lambda: dict(states), draining=lambda: False)

    async def scenario():
        front = OpenAIFront(seam, RouterServerConfig(), RouterMetrics(lambda: dict(states)))
        port = await front.start()
        try:
            for path, body in (("/v1/models", None), ("/health", None),
                               ("/v1/completions", {"model": "quire", "prompt": "hi"}),
                               ("/v1/chat/completions", {"messages": [
                                   {"role": "user", "content": "hi"}]})):
                status, answer, headers = await asyncio.to_thread(_send, port, path, None, body)
                assert status == 503 and headers["Retry-After"] == "1", (path, answer)
            model[0] = "m"
            states.update(serving=1, unreachable=0)
            status, body, _ = await asyncio.to_thread(_send, port, "/v1/models")
            assert status == 200 and [m["id"] for m in body["data"]] == ["m"]
        finally:
            await front.stop()
    asyncio.run(scenario())


@pytest.mark.parametrize("body, param, message", [
    # a key that cannot name its field (empty, or not valid Unicode) is named by its place
    ({"": "\ud800"}, "body key #1", "body key #1: contains a lone surrogate"),
    ({"prompt": "hi", "\udc80": 1}, "body key #2", "body key #2: contains a lone surrogate"),
    ({"prompt": "hi", "": 1}, "body key #2", 'body key #2: unknown or unsupported field ""'),
    ({"prompt": "\ud800"}, "prompt", "prompt: contains a lone surrogate"),
    ({"prompt": "hi", "a b": 1}, "a b", 'body: unknown or unsupported field "a b"'),
    ({"prompt": "hi", "frob": 1}, "frob", "frob: unknown or unsupported field"),
])
def test_body_errors_name_the_field_or_the_place_of_its_key(body, param, message):
    with pytest.raises(RequestError) as err:
        check_body(body, chat=False)
    assert err.value.param == param and str(err.value).startswith(message)


def test_echo_gathers_prompt_logprobs_from_every_prefill_chunk():
    """The engine sends a long prompt's logprobs one prefill chunk per message, all before its
    first output: the echoed logprobs cover every prompt position, for each prompt of a
    batch (its messages named <id>-<k>)."""
    from quire.v1 import engine_pb2 as pb
    from router.openai_answer import OpenAIRequest

    def entries(ids):
        return [pb.PositionLogprobs(token_ids=[t], logprobs=[-0.5]) for t in ids]

    for prompt in ([5, 6, 7, 8, 9], [[1, 2], [5, 6, 7, 8, 9]]):
        req = OpenAIRequest({"prompt": prompt, "echo": True, "logprobs": 0, "max_tokens": 1},
                            chat=False, model_name="m", token_text=lambda t: f"<{t}>")
        k = 1 if isinstance(prompt[0], list) else 0
        rid = f"{req.id}-{k}" if k else req.id
        req.saw(pb.GenerateResponse(request_id=rid, prompt_token_ids=[5, 6, 7, 8, 9],
                                    prompt_logprobs=[pb.PositionLogprobs(), *entries([6, 7])]))
        req.saw(pb.GenerateResponse(request_id=rid, prompt_logprobs=entries([8, 9])))
        last = pb.CompletionDelta(index=k, text="<3>", token_ids=[3], logprobs=entries([3]))
        choice = req.choice(k, last.text, last.logprobs, "length", chunk=False)
        logprobs = choice["logprobs"]
        assert choice["text"] == "<5><6><7><8><9><3>"
        assert logprobs["tokens"] == [f"<{t}>" for t in (5, 6, 7, 8, 9, 3)]
        assert logprobs["token_logprobs"] == [None, -0.5, -0.5, -0.5, -0.5, -0.5]
        assert logprobs["top_logprobs"][0] is None and len(logprobs["top_logprobs"]) == 6
        assert logprobs["text_offset"] == [0, 3, 6, 9, 12, 15]


def test_reasoning_effort_reaches_the_template_as_vllm_passes_it():
    from router.chat_template import ChatTemplateOptions

    messages = [{"role": "user", "content": "hi"}]
    options = ChatTemplateOptions.from_body({"reasoning_effort": "none"}, messages)
    assert options.template_kwargs == {"reasoning_effort": "none", "enable_thinking": False}
    mine = ChatTemplateOptions.from_body({"reasoning_effort": "high", "chat_template_kwargs":
                                          {"enable_thinking": False}}, messages)
    assert mine.template_kwargs == {"reasoning_effort": "high", "enable_thinking": False}
    with pytest.raises(RequestError) as err:
        ChatTemplateOptions.from_body({"reasoning_effort": "extreme"}, messages)
    assert err.value.param == "reasoning_effort"


def test_no_output_cap_by_default_as_vllm():
    """vLLM's example asks for 5,000 tokens, which vLLM serves (cut to the room its prompt
    leaves); the old default cap of 4,096 refused it on both fronts. By default there is no
    cap now: only an operator's --max-tokens-limit, and the model's length, bound it."""
    from engine_worker.server.config import ServerConfig
    from engine_worker.server.convert import RequestLimits, request_from_proto
    from quire.v1 import engine_pb2 as pb
    from router.config import RouterServerConfig
    from router.openai_protocol import sampling_options

    cap = RouterServerConfig().max_tokens_limit
    body = {"messages": [], "max_completion_tokens": 5000}
    assert sampling_options(body, chat=True, max_tokens_limit=cap).max_tokens == 5000
    with pytest.raises(RequestError, match="--max-tokens-limit"):
        sampling_options(body, chat=True, max_tokens_limit=4096)
    server = ServerConfig()
    limits = RequestLimits(max_n=server.max_n, max_stop_strings=server.max_stop_strings,
                           max_stop_string_len=server.max_stop_string_len,
                           max_prompt_chars=server.max_prompt_chars,
                           max_tokens=server.max_tokens_limit)
    _, params, _, _ = request_from_proto(pb.GenerateRequest(
        text="x", sampling=pb.SamplingOptions(max_tokens=5000)), limits)
    assert params.max_tokens == 5000


def test_the_loop_renders_only_a_few_small_jobs_a_window():
    """Small renders run inline, but a burst of them (a batch of 256 small prompts) is not
    all run on the event loop: past the window's characters, the rest go to the pool."""
    import asyncio
    import threading

    from router.render_pool import INLINE_CHARS_PER_WINDOW, WINDOW_S, Renderer, approx_chars

    assert approx_chars({"a": ["xy", {"b": "z" * 10}]}, (1, "q")) == 1 + 2 + 1 + 10 + 1 + 1
    assert approx_chars("x" * 10_000) == 10_000  # (it stops walking past the limit)

    async def threads() -> list[bool]:
        now = [0.0]
        renderer = Renderer(1, clock=lambda: now[0])  # a burst within one window
        try:
            loop_thread = threading.get_ident()
            burst = [await renderer.run(1000, lambda: threading.get_ident() == loop_thread)
                     for _ in range(2 * INLINE_CHARS_PER_WINDOW // 1000)]
            now[0] += WINDOW_S  # the next window: inline again
            return burst + [await renderer.run(
                1000, lambda: threading.get_ident() == loop_thread)]
        finally:
            renderer.shutdown()

    inline = asyncio.run(threads())
    per_window = INLINE_CHARS_PER_WINDOW // 1000
    assert inline == [True] * per_window + [False] * per_window + [True]
