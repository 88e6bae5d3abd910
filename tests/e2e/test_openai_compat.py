"""What an application written for vLLM's OpenAI server (or OpenAI's) sends and reads, served the
same way through the router's OpenAI front: found by a side-by-side run of the official client
against vLLM 0.32's server and `quire up` (docs/api.md). Real router + two real engines."""

from __future__ import annotations

import json
import socket

import pytest

from quire.v1 import engine_pb2 as pb
from tests.e2e import test_router_openai as base
from tests.e2e.router_harness import TIMEOUT_S, wait_for

# the same stack as test_router_openai (router + two engines), its fixtures
engines, router, front, client = base.engines, base.router, base.front, base.client
MODEL, PROMPT, _http = base.MODEL, base.PROMPT, base._http

MESSAGES = [{"role": "user", "content": "Say hello."}]


def _post(front, path, body):
    status, text = _http(front, "POST", path, {"model": MODEL, **body})
    return status, json.loads(text)


def _events(front, path, body) -> list[dict]:
    status, text = _http(front, "POST", path, {"model": MODEL, "stream": True, **body})
    assert status == 200, text
    events = [e.removeprefix("data: ") for e in text.split("\n\n") if e]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def test_completions_default_to_16_tokens_as_openai_and_vllm(client, front):
    """OpenAI's legacy completions (and vLLM's) generate 16 tokens when max_tokens is not
    sent, fewer where the context leaves less (never a 400 for a length nobody asked for);
    an explicit null, and chat's default, ask for what the server allows."""
    result = client.completions.create(model=MODEL, prompt=PROMPT, temperature=0,
                                       extra_body={"ignore_eos": True})
    assert result.usage.completion_tokens == 16 and result.choices[0].finish_reason == "length"
    _, tokenized = _post(front, "/tokenize", {"prompt": "hi"})
    room = 30  # prompts that leave this much of the context: quick to fill
    long_prompt = [5] * (tokenized["max_model_len"] - room)
    for max_tokens, expected in ((None, room), ("absent", 16)):
        body = {"prompt": long_prompt, "temperature": 0, "ignore_eos": True} | (
            {} if max_tokens == "absent" else {"max_tokens": max_tokens})
        status, answer = _post(front, "/v1/completions", body)
        assert status == 200 and answer["usage"]["completion_tokens"] == expected, answer
    status, answer = _post(front, "/v1/completions", {"prompt": [5] * (
        tokenized["max_model_len"] - 4), "ignore_eos": True})
    assert status == 200 and answer["usage"]["completion_tokens"] == 4, answer  # cut to fit
    messages = [{"role": "user", "content": "hi"}]
    _, chat_prompt = _post(front, "/tokenize", {"messages": messages})
    messages[0]["content"] = "hi" + " hi" * (tokenized["max_model_len"] - room -
                                             chat_prompt["count"])
    _, chat_prompt = _post(front, "/tokenize", {"messages": messages})
    status, chat = _post(front, "/v1/chat/completions", {"messages": messages,
                                                        "ignore_eos": True})
    left = tokenized["max_model_len"] - chat_prompt["count"]
    assert status == 200 and chat["usage"]["completion_tokens"] == left > 16, chat


@pytest.mark.parametrize("prompts", [
    ["The sky is", "Water is", "The quick brown fox"],
    [[504, 3575], [504, 3575, 282]],
])
def test_a_batch_of_prompts_is_answered_in_order_as_vllm_numbers_it(client, front, prompts):
    """prompt k's choice i is choice k * n + i; usage is the batch's sum; each text equals the
    prompt's own answer (greedy), streamed or not."""
    alone = [client.completions.create(model=MODEL, prompt=p, max_tokens=5, temperature=0)
             for p in prompts]
    batch = client.completions.create(model=MODEL, prompt=prompts, max_tokens=5, temperature=0,
                                      n=2)
    assert [c.index for c in batch.choices] == list(range(2 * len(prompts)))
    assert [c.text for c in batch.choices] == [a.choices[0].text for a in alone for _ in "ab"]
    assert batch.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone)
    assert batch.usage.completion_tokens == sum(2 * a.usage.completion_tokens for a in alone)
    chunks = _events(front, "/v1/completions", {"prompt": prompts, "max_tokens": 5,
                                                "temperature": 0, "logprobs": 1,
                                                "stream_options": {"include_usage": True}})
    texts: dict[int, str] = {}
    for chunk in chunks[:-1]:
        for choice in chunk["choices"]:
            texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
    assert [texts[k] for k in range(len(prompts))] == [a.choices[0].text for a in alone]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == \
        sum(a.usage.completion_tokens for a in alone)


def test_a_bad_prompt_in_a_batch_is_a_400_naming_it_and_nothing_runs(front, engines, client):
    status, body = _post(front, "/v1/completions", {"prompt": ["fine", ""], "max_tokens": 2})
    assert status == 400 and body["error"]["param"] == "prompt"
    assert body["error"]["message"].startswith("prompt[1]: "), body
    # too long for the model: the engine's refusal, before any output, fails the batch
    status, body = _post(front, "/v1/completions", {
        "prompt": [[5, 6], list(range(100, 2100))], "max_tokens": 2})
    assert status == 400 and body["error"]["param"] == "prompt", body
    # a field of the whole request is named as itself, not as one of the prompts
    status, body = _post(front, "/v1/completions", {"prompt": ["a", "b"], "temperature": -1})
    assert status == 400 and body["error"]["param"] == "temperature", body
    status, body = _post(front, "/v1/completions", {"prompt": ["x"] * 257, "max_tokens": 1})
    assert status == 400 and "at most 256 prompts" in body["error"]["message"]
    assert wait_for(lambda: all(e.holds_no_request() for e in engines), TIMEOUT_S)
    assert client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1).choices


def test_a_client_that_leaves_a_streamed_batch_stops_every_prompt(front, engines):
    body = json.dumps({"model": MODEL, "prompt": ["one", "two", "three"], "max_tokens": 500,
                       "ignore_eos": True, "stream": True}).encode()
    with socket.create_connection(("127.0.0.1", front.port)) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                     b"application/json\r\nContent-Length: " + str(len(body)).encode() +
                     b"\r\n\r\n" + body)
        received = b""
        while b"data: " not in received:  # until streaming has begun
            chunk = sock.recv(65536)
            assert chunk, received
            received += chunk
        assert wait_for(lambda: not all(e.holds_no_request() for e in engines), TIMEOUT_S)
    assert wait_for(lambda: all(e.holds_no_request() for e in engines), TIMEOUT_S)


def test_fields_the_official_client_sends_are_accepted(client, front):
    """Typed arguments of openai's client that change nothing here are accepted and ignored
    (as vLLM does); their "off" values are accepted; anything asking for what this server
    does not have is a 400 naming it."""
    for extra in ({"reasoning_effort": "low"}, {"prompt_cache_key": "k"},
                  {"prompt_cache_retention": "in_memory"}, {"safety_identifier": "u1"},
                  {"verbosity": "low"}, {"modalities": ["text"]}, {"audio": None},
                  {"prediction": {"type": "content", "content": "Hello"}},
                  {"web_search_options": None}, {"logprobs": False, "top_logprobs": 0},
                  {"use_beam_search": False}, {"kv_transfer_params": None}):
        result = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2,
                                                extra_body=extra)
        assert result.choices[0].message.role == "assistant", extra
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=2, stream=True,
        stream_options={"include_usage": True, "include_obfuscation": False}))
    assert chunks[-1].usage.completion_tokens == 2
    for extra, param in (({"modalities": ["text", "audio"]}, "modalities"),
                         ({"web_search_options": {}}, "web_search_options"),
                         ({"reasoning_effort": 3}, "reasoning_effort"),
                         ({"reasoning_effort": "extreme"}, "reasoning_effort"),
                         ({"use_beam_search": True}, "use_beam_search")):
        status, body = _post(front, "/v1/chat/completions", {"messages": MESSAGES, **extra})
        assert status == 400 and body["error"]["param"] == param, body
    status, body = _post(front, "/v1/completions", {"prompt": "x", "prompt_embeds": None,
                                                    "max_tokens": 1})
    assert status == 200, body


def test_replayed_history_keeps_reasoning_and_refusals(client):
    """An assistant message from another server's answer (vLLM sends reasoning: null; reasoning
    models fill reasoning_content; a refusal fills refusal) is accepted; a refusal is what
    the assistant said, so it renders as its content."""
    def prompt_tokens(assistant: dict) -> int:
        messages = [MESSAGES[0], {"role": "assistant", **assistant},
                    {"role": "user", "content": "Again."}]
        return client.chat.completions.create(model=MODEL, messages=messages,
                                              max_tokens=1).usage.prompt_tokens

    said = prompt_tokens({"content": "I cannot help with that."})
    assert prompt_tokens({"content": None, "refusal": "I cannot help with that."}) == said
    assert prompt_tokens({"content": "I cannot help with that.", "reasoning": None,
                          "reasoning_content": "Thinking it over."}) == said  # not in the template
    assert prompt_tokens({"content": "Hi", "refusal": None, "annotations": [],
                          "audio": None, "function_call": None}) > 0


def test_completion_logprobs_carry_text_offsets_and_the_chosen_token(client, front):
    result = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0,
                                       logprobs=2)
    lp = result.choices[0].logprobs
    expected, at = [], 0
    for token in lp.tokens:
        expected.append(at)
        at += len(token)
    assert lp.text_offset == expected and len(expected) == 6
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert top[token] == logprob and len(top) in (2, 3)  # the chosen one and the top 2
    streamed = _events(front, "/v1/completions", {"prompt": PROMPT, "max_tokens": 6,
                                                  "temperature": 0, "logprobs": 2})
    offsets = [o for chunk in streamed for c in chunk["choices"]
               for o in c["logprobs"]["text_offset"]]
    assert offsets == expected  # counted on across chunks
    zero = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0,
                                     logprobs=0)
    assert [list(top) for top in zero.choices[0].logprobs.top_logprobs] == \
        [[token] for token in zero.choices[0].logprobs.tokens]


def test_version_ping_and_the_context_length_in_models(front):
    status, text = _http(front, "GET", "/version")
    assert status == 200 and json.loads(text)["version"]
    assert _http(front, "GET", "/ping")[0] == 200 and _http(front, "POST", "/ping")[0] == 200
    status, text = _http(front, "GET", "/v1/models")
    _, tokenized = _post(front, "/tokenize", {"prompt": "hi"})
    assert [m["max_model_len"] for m in json.loads(text)["data"]] == \
        [tokenized["max_model_len"]]


def test_a_conversation_too_long_names_messages(front):
    status, body = _post(front, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "hi " * 3000}], "max_tokens": 1})
    assert status == 400 and body["error"]["param"] == "messages", body
    assert body["error"]["message"].startswith("messages: "), body


def test_echo_scores_a_prompt_as_evaluation_harnesses_ask(client, front, router):
    """echo with logprobs and max_tokens 0 (how lm-eval-harness style clients score a text):
    the prompt back with each position's logprob, the first position having none, and
    nothing completed; the logprobs are the engine's own prompt logprobs."""
    text = "The capital of France is Paris"
    scored = client.completions.create(model=MODEL, prompt=text, echo=True, logprobs=1,
                                       max_tokens=0, temperature=0)
    choice = scored.choices[0]
    assert choice.text == text and scored.usage.completion_tokens == 0
    lp = choice.logprobs
    assert len(lp.tokens) == scored.usage.prompt_tokens == len(lp.text_offset)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    request = pb.GenerateRequest(text=text, sampling=pb.SamplingOptions(
        max_tokens=1, temperature=0, prompt_logprobs=1))
    engine = list(router.stub.Generate(request, timeout=TIMEOUT_S))
    expected = [e.logprobs[0] for e in engine[0].prompt_logprobs[1:]]
    assert lp.token_logprobs[1:] == pytest.approx(expected, abs=1e-6)
    assert all(top[token] == logprob for token, logprob, top in
               zip(lp.tokens[1:], lp.token_logprobs[1:], lp.top_logprobs[1:]))
    # with a completion: the prompt, then what the same request answers without echo
    plain = client.completions.create(model=MODEL, prompt=text, max_tokens=4, temperature=0)
    echoed = client.completions.create(model=MODEL, prompt=text, max_tokens=4, temperature=0,
                                       echo=True)
    assert echoed.choices[0].text == text + plain.choices[0].text
    events = _events(front, "/v1/completions", {"prompt": text, "max_tokens": 4,
                                                "temperature": 0, "echo": True})
    assert "".join(c["text"] for e in events for c in e["choices"]) == echoed.choices[0].text
    batch = client.completions.create(model=MODEL, prompt=["One two", [504, 3575, 282]],
                                      max_tokens=0, echo=True)
    assert batch.choices[0].text == "One two" and batch.choices[1].text
    status, body = _post(front, "/v1/completions", {"prompt": text, "max_tokens": 0})
    assert status == 400 and body["error"]["param"] == "max_tokens"  # 0 only with echo


def test_stop_reason_names_what_ended_a_choice(client, front, router):
    """vLLM's stop_reason: the stop string or stop token id that ended the choice, None for
    length; in the answer and in the stream's last chunk of the choice."""
    plain = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0)
    assert plain.choices[0].model_extra["stop_reason"] is None
    text = plain.choices[0].text
    stop = text[2:4]
    stopped = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6,
                                        temperature=0, stop=[stop])
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.choices[0].model_extra["stop_reason"] == stop
    generated = [t for m in router.stub.Generate(pb.GenerateRequest(
        text=PROMPT, sampling=pb.SamplingOptions(max_tokens=6, temperature=0)),
        timeout=TIMEOUT_S) for d in m.outputs for t in d.token_ids]
    by_id = _post(front, "/v1/completions", {"prompt": PROMPT, "max_tokens": 6,
                                             "temperature": 0,
                                             "stop_token_ids": [generated[2]]})[1]
    assert by_id["choices"][0]["finish_reason"] == "stop"
    assert by_id["choices"][0]["stop_reason"] == generated[2]  # an integer, as vLLM's
    events = _events(front, "/v1/completions", {"prompt": PROMPT, "max_tokens": 6,
                                                "temperature": 0, "stop": [stop]})
    last = [c for e in events for c in e["choices"] if c["finish_reason"]]
    assert [c["stop_reason"] for c in last] == [stop]


@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions", {"messages": MESSAGES}),
    ("/v1/completions", {"prompt": PROMPT}),
])
def test_a_streamed_n_2_answer_has_one_choice_per_chunk_and_a_role_chunk_first(front, path,
                                                                             body):
    """As OpenAI and vLLM stream: readers that take choices[0] of each chunk see every choice,
    and on chat each choice opens with a role-only chunk (content "")."""
    events = _events(front, path, body | {"n": 2, "max_tokens": 4, "temperature": 0,
                                          "seed": 3, "stream_options": {"include_usage": True}})
    assert all(len(e["choices"]) == 1 for e in events[:-1]) and events[-1]["choices"] == []
    by_index: dict[int, list[dict]] = {}
    for event in events[:-1]:
        choice = event["choices"][0]
        by_index.setdefault(choice["index"], []).append(choice)
    assert sorted(by_index) == [0, 1]
    for chunks in by_index.values():
        assert chunks[-1]["finish_reason"] == "length"
        if "chat" in path:
            assert chunks[0]["delta"] == {"role": "assistant", "content": ""}
            assert all("role" not in c["delta"] for c in chunks[1:])
            assert "".join(c["delta"].get("content", "") for c in chunks)


@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions", {"messages": MESSAGES, "n": 2}),
    ("/v1/completions", {"prompt": [PROMPT, "Once upon a time"], "n": 2}),
])
def test_continuous_usage_stats_put_each_choices_usage_on_every_chunk(front, path, body):
    """vLLM's ``stream_options.continuous_usage_stats`` (with include_usage): every chunk
    carries its choice's usage so far (its prompt's tokens, the tokens it has generated,
    growing chunk by chunk), and the last chunk the whole request's, as without it."""
    events = _events(front, path, body | {
        "max_tokens": 6, "temperature": 1.0, "seed": 3, "ignore_eos": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True}})
    *chunks, last = events
    assert not last["choices"] and last["usage"]["completion_tokens"] == 6 * len(
        {c["choices"][0]["index"] for c in chunks})
    seen: dict[int, list[dict]] = {}
    for chunk in chunks:
        (choice,) = chunk["choices"]
        seen.setdefault(choice["index"], []).append(chunk["usage"])
    if path == "/v1/chat/completions":  # each choice's role-only chunk: nothing yet
        roles = [c for c in chunks if c["choices"][0]["delta"].get("role")]
        assert len(roles) == 2 and all(c["usage"]["completion_tokens"] == 0 for c in roles)
    for usages in seen.values():
        counts = [u["completion_tokens"] for u in usages]
        assert counts == sorted(counts) and counts[-1] == 6, counts
        assert all(u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"]
                   for u in usages)
        assert len({u["prompt_tokens"] for u in usages}) == 1 and usages[0]["prompt_tokens"]
    # each prompt's tokens counted once per prompt in the request's own usage
    per_prompt = {index // 2: seen[index][0]["prompt_tokens"] for index in seen}
    assert sum(per_prompt.values()) == last["usage"]["prompt_tokens"]
    # without include_usage it asks for nothing, as in vLLM
    plain = _events(front, path, body | {"max_tokens": 2, "stream_options": {
        "continuous_usage_stats": True}})
    assert all("usage" not in e for e in plain)
    status, answer = _post(front, path, body | {"stream": True, "stream_options": {
        "continuous_usage_stats": "yes"}})
    assert status == 400 and answer["error"]["param"] == \
        "stream_options.continuous_usage_stats", answer


def test_chat_echo_starts_each_choice_with_the_last_message_as_vllm(front):
    """vLLM's chat ``echo``: where the last message's role is the answer's (the assistant's;
    with ``add_generation_prompt`` false, the last message's own), each choice's content
    starts with that message's text; streamed, it comes in a chunk of its own after the role
    chunk, counted as nothing generated. Elsewhere it echoes nothing."""
    partial = [{"role": "user", "content": "Name a colour."},
               {"role": "assistant", "content": "My favourite colour is"}]
    body = {"messages": partial, "continue_final_message": True, "max_tokens": 5,
            "temperature": 0, "n": 2}
    _, plain = _post(front, "/v1/chat/completions", body)
    status, echoed = _post(front, "/v1/chat/completions", body | {"echo": True})
    assert status == 200, echoed
    for before, after in zip(plain["choices"], echoed["choices"], strict=True):
        assert after["message"] == {"role": "assistant", "reasoning": None,
                                    "content": "My favourite colour is" +
                                    before["message"]["content"]}
    assert [echoed["usage"][k] for k in ("prompt_tokens", "completion_tokens")] == \
        [plain["usage"][k] for k in ("prompt_tokens", "completion_tokens")]
    events = _events(front, "/v1/chat/completions", body | {"echo": True, "stream_options": {
        "include_usage": True, "continuous_usage_stats": True}})
    for index in (0, 1):
        chunks = [e for e in events if e["choices"] and e["choices"][0]["index"] == index]
        assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        assert chunks[1]["choices"][0]["delta"] == {"content": "My favourite colour is"}
        assert chunks[1]["usage"]["completion_tokens"] == 0
        text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
        assert text == echoed["choices"][index]["message"]["content"]
    # the last message is the user's: the answer's role is the assistant's, nothing echoed
    question = {"messages": MESSAGES, "max_tokens": 4, "temperature": 0}
    _, alone = _post(front, "/v1/chat/completions", question)
    _, same = _post(front, "/v1/chat/completions", question | {"echo": True})
    assert same["choices"][0]["message"] == alone["choices"][0]["message"]
    # no generation prompt: the answer continues the user's turn, echoing its text parts
    parts = [{"role": "user", "content": [{"type": "text", "text": "Say"},
                                          {"type": "text", "text": "hello."}]}]
    _, turn = _post(front, "/v1/chat/completions", {
        "messages": parts, "add_generation_prompt": False, "echo": True, "max_tokens": 3,
        "temperature": 0})
    message = turn["choices"][0]["message"]
    assert message["role"] == "user" and message["content"].startswith("Say\nhello."), turn
    status, answer = _post(front, "/v1/chat/completions", question | {"echo": "yes"})
    assert status == 400 and answer["error"]["param"] == "echo", answer


def test_return_token_ids_puts_the_ids_beside_the_text_as_vllm(front):
    """vLLM's ``return_token_ids``: each choice's generated ids, and the prompt's ids
    (completions: on each choice; chat: on the answer), streamed or not; streamed, each chunk
    carries its own ids and the prompt's come in each choice's first chunk (chat: its role
    chunk). The ids are the ones the text was made of."""
    prompts = ["The sky is", "Water is"]
    body = {"prompt": prompts, "n": 2, "max_tokens": 5, "temperature": 0,
            "return_token_ids": True}
    _, whole = _post(front, "/v1/completions", body)
    for choice in whole["choices"]:
        _, tokenized = _post(front, "/tokenize", {"prompt": prompts[choice["index"] // 2]})
        assert choice["prompt_token_ids"] == tokenized["tokens"]
        assert len(choice["token_ids"]) == 5
        _, text = _post(front, "/detokenize", {"tokens": choice["token_ids"]})
        assert text["prompt"] == choice["text"]
    events = _events(front, "/v1/completions", body)
    for index in range(4):
        chunks = [e["choices"][0] for e in events if e["choices"][0]["index"] == index]
        assert chunks[0]["prompt_token_ids"] == whole["choices"][index]["prompt_token_ids"]
        assert all("prompt_token_ids" not in c for c in chunks[1:])
        assert sum((c["token_ids"] for c in chunks), []) == whole["choices"][index]["token_ids"]
    messages = {"messages": MESSAGES, "max_tokens": 5, "temperature": 0, "n": 2,
                "return_token_ids": True}
    _, chat = _post(front, "/v1/chat/completions", messages)
    _, tokenized = _post(front, "/tokenize", {"messages": MESSAGES})
    assert chat["prompt_token_ids"] == tokenized["tokens"]
    assert all(len(c["token_ids"]) == chat["usage"]["completion_tokens"] // 2
               for c in chat["choices"])
    events = _events(front, "/v1/chat/completions", messages)
    roles = [e for e in events if e["choices"][0]["delta"].get("role")]
    assert len(roles) == 2 and all(e["prompt_token_ids"] == tokenized["tokens"] for e in roles)
    for index in (0, 1):
        chunks = [e["choices"][0] for e in events
                  if e["choices"][0]["index"] == index and "token_ids" in e["choices"][0]]
        assert sum((c["token_ids"] for c in chunks), []) == chat["choices"][index]["token_ids"]
    _, plain = _post(front, "/v1/chat/completions", messages | {"return_token_ids": False})
    assert "prompt_token_ids" not in plain and "token_ids" not in plain["choices"][0]


def test_cache_salt_isolates_cached_prefixes_as_vllm(front):
    """vLLM's ``cache_salt``: a prompt finds the blocks an earlier request cached only under
    an equal salt, on both routes and for embeddings; a bad salt is a 400 naming it."""
    prompt = "Salted prompt: " + " ".join(f"w{i}" for i in range(60))

    def cached(salt=None, path="/v1/completions"):
        body = {"max_tokens": 1, "temperature": 0} | (
            {"prompt": prompt} if "chat" not in path else
            {"messages": [{"role": "user", "content": prompt}]}) | (
            {} if salt is None else {"cache_salt": salt})
        status, answer = _post(front, path, body)
        assert status == 200, answer
        return answer["usage"]["prompt_tokens_details"]["cached_tokens"]

    for path in ("/v1/completions", "/v1/chat/completions"):
        # a salt changes every block's hash: not even chat's template preamble, which the
        # unsalted requests before have cached, is shared
        assert cached("tenant-a", path) == 0
        hit = cached("tenant-a", path)
        assert hit >= 64
        assert cached("tenant-b", path) == 0
        assert cached(None, path) < hit  # unsalted: at most what unsalted requests cached
    status, answer = _post(front, "/v1/embeddings", {"input": prompt, "cache_salt": "t"})
    assert status == 200 and answer["data"][0]["embedding"], answer
    for bad in ("", 5, "x" * 129, "a/b", "a@b", "a\\b", "a\x00b"):
        for path, body in (("/v1/completions", {"prompt": "hi"}),
                           ("/v1/chat/completions", {"messages": MESSAGES}),
                           ("/v1/embeddings", {"input": "hi"})):
            status, answer = _post(front, path, body | {"cache_salt": bad})
            assert status == 400 and answer["error"]["param"] == "cache_salt", (bad, answer)


def test_prompt_logprobs_are_the_engines_own_as_vllm_shapes_them(front, router):
    """vLLM's ``prompt_logprobs`` (not streamed): per prompt position (the first has none) the
    prompt's token and the top k by token id, each with its logprob, rank and text, equal to
    the engine's own prompt logprobs; on each completions choice of its prompt, on the chat
    answer, and implied by chat's ``echo`` (top 0: the prompt's tokens alone)."""
    text = "The capital of France is Paris"
    request = pb.GenerateRequest(text=text, sampling=pb.SamplingOptions(
        max_tokens=1, temperature=0, prompt_logprobs=2))
    engine = list(router.stub.Generate(request, timeout=TIMEOUT_S))[0].prompt_logprobs
    _, answer = _post(front, "/v1/completions", {"prompt": text, "max_tokens": 2, "n": 2,
                                                 "temperature": 0, "prompt_logprobs": 2})
    for choice in answer["choices"]:
        positions = choice["prompt_logprobs"]
        assert positions[0] is None and len(positions) == answer["usage"]["prompt_tokens"]
        for position, entry in zip(positions[1:], engine[1:], strict=True):
            chosen = str(entry.token_ids[0])
            assert position[chosen]["rank"] == entry.chosen_rank >= 1
            assert position[chosen]["logprob"] == pytest.approx(entry.logprobs[0], abs=1e-5)
            tops = [position[str(t)] for t in entry.token_ids[1:]]
            assert [t["rank"] for t in tops] == [1, 2]
            assert [t["logprob"] for t in tops] == pytest.approx(entry.logprobs[1:], abs=1e-5)
            assert all(isinstance(t["decoded_token"], str) for t in position.values())
    assert "prompt_logprobs" not in _post(front, "/v1/completions", {
        "prompt": text, "max_tokens": 1})[1]["choices"][0]
    messages = [{"role": "user", "content": text}]
    _, chat = _post(front, "/v1/chat/completions", {"messages": messages, "max_tokens": 1,
                                                    "prompt_logprobs": 1})
    _, tokenized = _post(front, "/tokenize", {"messages": messages})
    assert len(chat["prompt_logprobs"]) == len(tokenized["tokens"])
    assert all(str(t) in p for t, p in zip(tokenized["tokens"][1:], chat["prompt_logprobs"][1:]))
    _, echoed = _post(front, "/v1/chat/completions", {"messages": messages, "max_tokens": 1,
                                                      "echo": True})
    assert [list(p) for p in echoed["prompt_logprobs"][1:]] == \
        [[str(t)] for t in tokenized["tokens"][1:]]
    for body, param in (({"stream": True, "prompt_logprobs": 1}, "prompt_logprobs"),
                        ({"prompt_logprobs": 21}, "prompt_logprobs"),
                        ({"prompt_logprobs": -1}, "prompt_logprobs")):
        status, error = _post(front, "/v1/completions", {"prompt": text} | body)
        assert status == 400 and error["error"]["param"] == param, (body, error)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_return_tokens_as_token_ids_names_logprobs_tokens_by_id(front, path):
    """vLLM's ``return_tokens_as_token_ids``: logprobs name each token ``token_id:<id>``, the
    ids the answer was made of (``return_token_ids``), streamed or not."""
    chat = "chat" in path
    body = {"max_tokens": 4, "temperature": 0, "return_token_ids": True,
            "return_tokens_as_token_ids": True} | (
        {"messages": MESSAGES, "logprobs": True, "top_logprobs": 2} if chat else
        {"prompt": PROMPT, "logprobs": 2})
    _, answer = _post(front, path, body)
    choice = answer["choices"][0]
    named = [f"token_id:{t}" for t in choice["token_ids"]]
    if chat:
        content = choice["logprobs"]["content"]
        assert [c["token"] for c in content] == named
        assert all(t["token"].startswith("token_id:") for c in content
                   for t in c["top_logprobs"])
    else:
        assert choice["logprobs"]["tokens"] == named
        assert all(k.startswith("token_id:") for top in choice["logprobs"]["top_logprobs"]
                   for k in top)
    events = _events(front, path, body)
    streamed = [c["token"] for e in events for c in (e["choices"][0]["logprobs"] or {}).get(
        "content", ())] if chat else [t for e in events
                                      for t in (e["choices"][0]["logprobs"] or {}).get(
                                          "tokens", ())]
    assert streamed == named


def test_allowed_token_ids_and_bad_words_reach_the_engine(front):
    """vLLM's ``allowed_token_ids`` and ``bad_words`` on the OpenAI front (their semantics
    against transformers: test_allowed_and_bad_words.py); bad lists are 400s naming them."""
    body = {"prompt": PROMPT, "max_tokens": 12, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}
    _, free = _post(front, "/v1/completions", body)
    tokens = free["choices"][0]["token_ids"]
    _, sampled = _post(front, "/v1/chat/completions", {
        "messages": MESSAGES, "max_tokens": 12, "temperature": 1.5, "seed": 1,
        "ignore_eos": True, "return_token_ids": True, "allowed_token_ids": tokens[:3]})
    assert set(sampled["choices"][0]["token_ids"]) <= set(tokens[:3])
    for token in tokens:
        _, text = _post(front, "/detokenize", {"tokens": [token]})
        word = text["prompt"]
        _, again = _post(front, "/tokenize", {"prompt": word.lstrip(),
                                              "add_special_tokens": False})
        if word.strip() and again["tokens"] == [token]:
            break
    else:
        pytest.fail("no generated token is a word of its own")
    _, banned = _post(front, "/v1/completions", body | {"bad_words": [word]})
    assert token not in banned["choices"][0]["token_ids"]
    for field, value in (("allowed_token_ids", []), ("allowed_token_ids", [10 ** 7]),
                         ("allowed_token_ids", ["1"]), ("bad_words", ["  "]),
                         ("bad_words", "word")):
        status, error = _post(front, "/v1/completions", {"prompt": "hi", field: value})
        assert status == 400 and error["error"]["param"] == field, (field, value, error)


def test_truncate_prompt_tokens_keeps_the_prompts_end_as_vllm(front):
    """vLLM's ``truncate_prompt_tokens`` (with ``truncation_side``): the prompt cut to its last
    (or first) k tokens before it runs, so the answer is the one to the cut prompt; text,
    token-id and chat prompts alike; -1 is max_model_len."""
    _, tokenized = _post(front, "/tokenize", {"prompt": PROMPT})
    ids = tokenized["tokens"]
    body = {"max_tokens": 4, "temperature": 0, "return_token_ids": True}
    _, tail = _post(front, "/v1/completions", body | {"prompt": ids[-3:]})
    _, head = _post(front, "/v1/completions", body | {"prompt": ids[:3]})
    for prompt in (PROMPT, ids):
        _, cut = _post(front, "/v1/completions", body | {"prompt": prompt,
                                                         "truncate_prompt_tokens": 3})
        assert cut["choices"][0]["prompt_token_ids"] == ids[-3:]
        assert cut["choices"][0]["token_ids"] == tail["choices"][0]["token_ids"]
        assert cut["usage"]["prompt_tokens"] == 3
        _, right = _post(front, "/v1/completions", body | {
            "prompt": prompt, "truncate_prompt_tokens": 3, "truncation_side": "right"})
        assert right["choices"][0]["token_ids"] == head["choices"][0]["token_ids"]
    _, whole = _post(front, "/v1/completions", body | {"prompt": PROMPT,
                                                       "truncate_prompt_tokens": -1})
    assert whole["choices"][0]["prompt_token_ids"] == ids
    # -1 on a prompt past the context: cut to leave one token to generate, as vLLM cuts it
    room = tokenized["max_model_len"]
    status, full = _post(front, "/v1/completions", body | {
        "prompt": [5] * (room + 10), "truncate_prompt_tokens": -1})
    assert status == 200 and full["usage"]["prompt_tokens"] == room - 1, full
    assert full["usage"]["completion_tokens"] == 1
    _, echoed = _post(front, "/v1/completions", {"prompt": PROMPT, "max_tokens": 1, "echo": True,
                                                 "truncate_prompt_tokens": 2})
    _, text = _post(front, "/detokenize", {"tokens": ids[-2:]})
    assert echoed["choices"][0]["text"].startswith(text["prompt"])
    # in a batch, each prompt echoes what ran: the short one as sent, the cut one cut
    _, batch = _post(front, "/v1/completions", {"prompt": ["Hi", PROMPT], "max_tokens": 1,
                                                "echo": True, "truncate_prompt_tokens": 2})
    assert batch["choices"][0]["text"].startswith("Hi")
    assert batch["choices"][1]["text"].startswith(text["prompt"])
    _, chat = _post(front, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 1,
                                                    "truncate_prompt_tokens": 5})
    assert chat["usage"]["prompt_tokens"] == 5
    for value in (0, -2, "3", 10 ** 9):
        status, error = _post(front, "/v1/completions", {"prompt": PROMPT,
                                                         "truncate_prompt_tokens": value})
        assert status == 400 and error["error"]["param"] == "truncate_prompt_tokens", error
    status, error = _post(front, "/v1/completions", {"prompt": PROMPT, "truncation_side": "up"})
    assert status == 400 and error["error"]["param"] == "truncation_side", error

