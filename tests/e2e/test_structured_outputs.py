"""Structured outputs and logit_bias end to end: the official ``openai`` client through the
router's HTTP front to an engine serving the embedded model (SmolLM2), gRPC directly, and the
offline ``LLM``. Every sampled output (temperature 1, fixed seeds) must parse and validate.

Samples per schema: ``SAMPLES`` (50, the issue's count), whole and streamed, sent as
concurrent requests of at most ``MAX_N`` samples each (the servers' default bound on ``n``), so
they decode as one batch.
"""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai
import pytest

from engine_worker import LLM, SamplingParams
from engine_worker.beam_search import BeamSearchParams
from engine_worker.sampling_params import StructuredOutputsParams
from quire.limits import DEFAULT_MAX_N as MAX_N
from quire.v1 import engine_pb2 as pb
from tests.e2e.router_harness import (TIMEOUT_S, RunningRouter, address, collect,
                                      engine_fleet)

pytestmark = pytest.mark.slow  # the embedded SmolLM2 behind a router

MODEL = "smollm2"
SAMPLES = 50
# a hang guard, not a timing check: 50 samples of a schema share 2 cores with other work
SAMPLES_TIMEOUT_S = 10 * TIMEOUT_S

SCHEMAS = {
    "nested": {
        "type": "object", "additionalProperties": False, "required": ["person"],
        "properties": {"person": {
            "type": "object", "additionalProperties": False, "required": ["name", "address"],
            "properties": {
                "name": {"type": "string", "maxLength": 20},
                "address": {"type": "object", "additionalProperties": False,
                            "required": ["city", "zip"],
                            "properties": {"city": {"type": "string", "maxLength": 20},
                                           "zip": {"type": "string",
                                                   "pattern": "^[0-9]{5}$"}}}}}}},
    "array": {
        "type": "object", "additionalProperties": False, "required": ["tags"],
        "properties": {"tags": {"type": "array", "minItems": 1, "maxItems": 4,
                                "items": {"type": "string", "maxLength": 12}}}},
    "enum": {
        "type": "object", "additionalProperties": False, "required": ["color", "size"],
        "properties": {"color": {"enum": ["red", "green", "blue"]},
                       "size": {"type": "string", "enum": ["S", "M", "L", "XL"]}}},
    "bounded_numbers": {
        "type": "object", "additionalProperties": False, "required": ["age", "rating"],
        "properties": {"age": {"type": "integer", "minimum": 0, "maximum": 120},
                       "rating": {"type": "integer", "minimum": -5, "maximum": 5}}},
    "any_of": {
        "type": "object", "additionalProperties": False, "required": ["value"],
        "properties": {"value": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 999},
                                           {"type": "string", "maxLength": 10},
                                           {"type": "boolean"}]}}},
}
MESSAGES = [{"role": "user", "content": "Describe a person as a JSON object."}]


@pytest.fixture(scope="module")
def engines(embedded_model_dir):
    yield from engine_fleet(embedded_model_dir, count=1, kv_cache_memory_bytes=1 << 28)


@pytest.fixture(scope="module")
def router(engines):
    running = RunningRouter([address(e) for e in engines], http_port=0, model_name=MODEL)
    yield running
    running.close()


@pytest.fixture(scope="module")
def client(router):
    with openai.OpenAI(base_url=f"http://127.0.0.1:{router.server.front.port}/v1",
                       api_key="x", max_retries=0, timeout=SAMPLES_TIMEOUT_S) as c:
        yield c


def _sampled(create, seed: int, **kwargs) -> list:
    """``SAMPLES`` choices of ``create(**kwargs)``: concurrent requests of at most MAX_N
    samples, each with its own seed; a streamed request's choices are its joined texts."""
    sizes = [min(MAX_N, SAMPLES - start) for start in range(0, SAMPLES, MAX_N)]
    stream = kwargs.get("stream", False)

    def one(i):
        result = create(n=sizes[i], seed=seed + i, **kwargs)
        if stream:
            texts = _streamed_texts(result)
            assert sorted(texts) == list(range(sizes[i]))
            return list(texts.values())
        return list(result.choices)

    with ThreadPoolExecutor(len(sizes)) as pool:
        out = [c for part in pool.map(one, range(len(sizes))) for c in part]
    assert len(out) == SAMPLES
    return out


def _json_format(schema):
    return {"type": "json_schema", "json_schema": {"name": "out", "schema": schema,
                                                   "strict": True}}


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_sampled_json_validates_against_its_schema(client, name):
    schema = SCHEMAS[name]
    choices = _sampled(client.chat.completions.create, 11, model=MODEL, messages=MESSAGES,
                       temperature=1.0, max_tokens=160, response_format=_json_format(schema))
    for choice in choices:
        assert choice.finish_reason == "stop", choice.message.content
        jsonschema.validate(json.loads(choice.message.content), schema)
    assert len({c.message.content for c in choices}) > 1  # sampled, not one answer


def _streamed_texts(stream) -> dict[int, str]:
    texts: dict[int, str] = {}
    for chunk in stream:
        for choice in chunk.choices:
            piece = choice.delta.content if hasattr(choice, "delta") else choice.text
            texts[choice.index] = texts.get(choice.index, "") + (piece or "")
    return texts


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_streamed_json_validates(client, name):
    schema = SCHEMAS[name]
    texts = _sampled(client.chat.completions.create, 5, model=MODEL, messages=MESSAGES,
                     temperature=1.0, max_tokens=160, response_format=_json_format(schema),
                     stream=True)
    for text in texts:
        jsonschema.validate(json.loads(text), schema)


def test_json_object_regex_and_choice(client):
    # an open-ended object may run past max_tokens at temperature 1: those that end are objects
    result = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Reply with a JSON object whose "
                                "key ok is true."}], n=2, temperature=1.0, seed=3,
        max_tokens=200, response_format={"type": "json_object"})
    done = [c for c in result.choices if c.finish_reason == "stop"]
    assert done and all(isinstance(json.loads(c.message.content), dict) for c in done)
    phone = r"\(\d{3}\) \d{3}-\d{4}"
    for stream in (False, True):
        texts = _sampled(client.completions.create, 4, model=MODEL, prompt="Call me at",
                         temperature=1.0, max_tokens=20, stream=stream,
                         extra_body={"structured_outputs": {"regex": phone}})
        for text in texts:
            text = text if stream else text.text
            assert re.fullmatch(phone, text), text
    choices = ["positive", "negative", "neutral \"quoted\""]
    picked = _sampled(client.chat.completions.create, 6, model=MODEL,
                      messages=[{"role": "user", "content": "Is this good?"}],
                      temperature=1.0, max_tokens=20,
                      extra_body={"structured_outputs": {"choice": choices}})
    assert all(c.message.content in choices for c in picked)
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Is this good?"}], temperature=1.0,
        seed=6, max_tokens=20, stream=True,
        extra_body={"structured_outputs": {"choice": choices}})
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) in choices


def test_sampled_grammar_and_streamed_choice(client):
    """vLLM's ``grammar`` kind (xgrammar's EBNF) and a streamed ``choice``, 50 samples each."""
    grammar = 'root ::= num (" + " num){0,3}\nnum ::= [1-9] [0-9]{0,2}'
    sums = re.compile(r"[1-9][0-9]{0,2}( \+ [1-9][0-9]{0,2}){0,3}")
    for stream in (False, True):
        texts = _sampled(client.completions.create, 21, model=MODEL, prompt="A sum: ",
                         temperature=1.0, max_tokens=40, stream=stream,
                         extra_body={"structured_outputs": {"grammar": grammar}})
        texts = texts if stream else [c.text for c in texts]
        assert all(sums.fullmatch(t) for t in texts), texts
        assert len(set(texts)) > 1
    choices = ["positive", "negative", "neutral \"quoted\""]
    picked = _sampled(client.chat.completions.create, 31, model=MODEL,
                      messages=[{"role": "user", "content": "Is this good?"}],
                      temperature=1.0, max_tokens=20, stream=True,
                      extra_body={"structured_outputs": {"choice": choices}})
    assert all(text in choices for text in picked), picked


def test_vllm_guided_fields(client):
    """vLLM's older names (guided_json / guided_regex / guided_choice) still constrain."""
    schema = SCHEMAS["enum"]
    result = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, n=4, temperature=1.0, seed=8, max_tokens=60,
        extra_body={"guided_json": schema})
    for choice in result.choices:
        jsonschema.validate(json.loads(choice.message.content), schema)
    result = client.completions.create(model=MODEL, prompt="Pick:", n=4, temperature=1.0,
                                       seed=8, max_tokens=10,
                                       extra_body={"guided_choice": ["left", "right"]})
    assert all(c.text in ("left", "right") for c in result.choices)


def test_grpc_structured_outputs_with_n(engines, router):
    schema = SCHEMAS["enum"]
    for stub in (engines[0].stub, router.stub):
        request = pb.GenerateRequest(text="Pick a color and a size:", sampling=pb.SamplingOptions(
            n=4, temperature=1.0, seed=9, max_tokens=60,
            structured_outputs=pb.StructuredOutputs(json=json.dumps(schema))))
        texts = {}
        for message in stub.Generate(request, timeout=TIMEOUT_S):
            for delta in message.outputs:
                texts[delta.index] = texts.get(delta.index, "") + delta.text
        assert sorted(texts) == [0, 1, 2, 3]
        for text in texts.values():
            jsonschema.validate(json.loads(text), schema)
        grammar = pb.GenerateRequest(text="Answer:", sampling=pb.SamplingOptions(
            temperature=1.0, seed=2, max_tokens=20, structured_outputs=pb.StructuredOutputs(
                grammar='root ::= "yes" | "no" | "maybe"')))
        text = "".join(d.text for m in stub.Generate(grammar, timeout=TIMEOUT_S)
                       for d in m.outputs)
        assert text in ("yes", "no", "maybe")


def test_logit_bias_forces_and_bans_tokens(client, router, engines):
    tokenizer = engines[0].server.async_engine.engine.tokenizer
    forced = tokenizer.encode(" banana", add_special_tokens=False)[0]
    result = client.completions.create(model=MODEL, prompt="The capital of France is",
                                       max_tokens=4, temperature=0,
                                       logit_bias={str(forced): 100})
    assert result.choices[0].text == " banana" * 4
    plain = client.completions.create(model=MODEL, prompt="The capital of France is",
                                      max_tokens=1, temperature=0)
    first = tokenizer.encode(plain.choices[0].text, add_special_tokens=False)[0]
    banned = client.completions.create(model=MODEL, prompt="The capital of France is",
                                       max_tokens=1, temperature=0,
                                       logit_bias={str(first): -100})
    assert banned.choices[0].text != plain.choices[0].text
    request = pb.GenerateRequest(text="The capital of France is", sampling=pb.SamplingOptions(
        temperature=0, max_tokens=3, logit_bias={forced: 100.0}))
    tokens, _ = collect(router.stub.Generate(request, timeout=TIMEOUT_S))
    assert tokens == [forced] * 3


def _error(client, **kwargs):
    kwargs = {"model": MODEL, "messages": MESSAGES, "max_tokens": 5} | kwargs
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(**kwargs)
    return e.value.body


@pytest.mark.parametrize("kwargs, param, words", [
    ({"response_format": _json_format({"type": "object", "properties": {
        "a": {"type": "string", "minLength": 5, "maxLength": 2}}})},
     "response_format", "cannot be compiled"),
    ({"response_format": _json_format({"type": "frobnicate"})}, "response_format",
     "cannot be compiled"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format", "schema"),
    ({"response_format": {"type": "xml"}}, "response_format", "type"),
    ({"extra_body": {"structured_outputs": {"regex": "(unclosed"}}},
     "structured_outputs.regex", "cannot be compiled"),
    ({"extra_body": {"structured_outputs": {"grammar": "root ::= undefined_rule"}}},
     "structured_outputs.grammar", "cannot be compiled"),
    ({"extra_body": {"structured_outputs": {"regex": "a", "choice": ["a"]}}},
     "structured_outputs", "exactly one"),
    ({"extra_body": {"structured_outputs": {"choice": []}}}, "structured_outputs.choice",
     "non-empty"),
    ({"response_format": {"type": "json_object"},
      "extra_body": {"structured_outputs": {"regex": "a"}}}, "response_format", "combined"),
    ({"extra_body": {"guided_regex": "(unclosed"}}, "guided_regex", "cannot be compiled"),
    ({"extra_body": {"guided_json": {"type": "frobnicate"}}}, "guided_json",
     "cannot be compiled"),
    ({"response_format": {"type": "structural_tag", "structures": [{"begin": "<f>"}],
                          "triggers": ["<f"]}}, "response_format", "structures"),
    ({"response_format": {"type": "structural_tag", "format": {"type": "frob"}}},
     "response_format", "cannot be compiled"),
    ({"extra_body": {"structured_outputs": {"structural_tag": "{not json"}}},
     "structured_outputs.structural_tag", "not valid JSON"),
    ({"logit_bias": {"5": 101}}, "logit_bias", "[-100, 100]"),
    ({"logit_bias": {"abc": 1}}, "logit_bias", "token id"),
    ({"logit_bias": {"49152": 1}}, "logit_bias", "token id"),
    ({"logit_bias": {"4000000000": 1}}, "logit_bias", "token id"),
])
def test_bad_input_is_a_400_naming_the_field(client, kwargs, param, words):
    body = _error(client, **kwargs)
    assert body["param"] == param and words in body["message"], body
    # and the engine keeps serving
    ok = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2,
                                        temperature=0)
    assert ok.choices[0].finish_reason == "length"


WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
           "required": ["city"], "additionalProperties": False}


def test_structural_tags_as_vllm_takes_them(client):
    """vLLM's structural tags (its structural_tag examples): the newer xgrammar form, here a
    tag the output must be, so its body always follows the schema; and the older one,
    {"structures", "triggers"}, where text is free until a trigger (this model writes none).
    Through response_format and structured_outputs, streamed and not."""
    tag = {"type": "structural_tag", "format": {
        "type": "tag", "begin": "<function=get_weather>",
        "content": {"type": "json_schema", "json_schema": WEATHER}, "end": "</function>"}}
    for kwargs in ({"response_format": tag},
                   {"extra_body": {"structured_outputs": {"structural_tag": json.dumps(tag)}}}):
        for choice in _sampled(client.chat.completions.create, seed=11, model=MODEL,
                               messages=MESSAGES, max_tokens=40, temperature=1.0, **kwargs):
            if choice.finish_reason != "stop":
                continue  # cut by max_tokens: only a prefix
            text = choice.message.content
            assert text.startswith("<function=get_weather>") and \
                text.endswith("</function>"), text
            body = json.loads(text[len("<function=get_weather>"):-len("</function>")])
            jsonschema.validate(body, WEATHER)
    streamed = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=40,
                                              temperature=0, response_format=tag, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
    assert text.startswith("<function=get_weather>")
    legacy = {"type": "structural_tag", "triggers": ["<function="], "structures": [
        {"begin": "<function=get_weather>", "schema": WEATHER, "end": "</function>"}]}
    answer = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=20,
                                            temperature=0, response_format=legacy)
    assert answer.choices[0].message.content is not None
    del legacy["structures"][0]["schema"]  # optional, as in vLLM's: any JSON there
    answer = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=20,
                                            temperature=0, response_format=legacy)
    assert answer.choices[0].message.content is not None


def test_grpc_bad_schema_is_invalid_argument(engines, router):
    import grpc
    for stub in (engines[0].stub, router.stub):
        request = pb.GenerateRequest(text="x", sampling=pb.SamplingOptions(
            max_tokens=4, structured_outputs=pb.StructuredOutputs(regex="[z-a]")))
        with pytest.raises(grpc.RpcError) as e:
            list(stub.Generate(request, timeout=TIMEOUT_S))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "structured_outputs.regex" in e.value.details()


@pytest.fixture(scope="module")
def llm(tiny_model_dir) -> LLM:
    return LLM(str(tiny_model_dir), dtype="float32", kv_cache_memory_bytes=1 << 24)


def test_offline_llm_structured_outputs(llm):
    """Random weights: the grammar alone makes the output match, with n > 1 and a batch."""
    params = [SamplingParams(n=3, temperature=1.0, seed=1, max_tokens=30,
                             structured_outputs=StructuredOutputsParams(regex=r"[a-c]{2}-\d{2}")),
              SamplingParams(temperature=1.0, seed=2, max_tokens=30,
                             structured_outputs=StructuredOutputsParams(choice=["up", "down"])),
              SamplingParams(temperature=1.0, seed=3, max_tokens=8)]
    outs = llm.generate(["one", "two", "three"], params, use_tqdm=False)
    assert len(outs[0].outputs) == 3
    for c in outs[0].outputs:
        assert re.fullmatch(r"[a-c]{2}-\d{2}", c.text) and c.finish_reason == "stop"
    assert outs[1].outputs[0].text in ("up", "down")
    assert len(outs[2].outputs[0].token_ids) == 8  # unconstrained beside them
    with pytest.raises(ValueError, match="structured_outputs.regex"):
        llm.generate("x", SamplingParams(structured_outputs={"regex": "(("}), use_tqdm=False)


def test_beam_search_refuses_structured_outputs(llm):
    with pytest.raises(ValueError, match="structured_outputs: beam search"):
        llm.beam_search(["x"], BeamSearchParams(beam_width=2, max_tokens=4,
                                                structured_outputs=StructuredOutputsParams(
                                                    choice=["a"])))


def test_offline_structural_tag(llm):
    """SamplingParams(structured_outputs=StructuredOutputsParams(structural_tag=...)), as
    vLLM's offline API takes it: random weights, and the tag alone makes the output fit."""
    tag = {"type": "structural_tag", "format": {
        "type": "tag", "begin": "<a>", "end": "</a>",
        "content": {"type": "regex", "pattern": "[0-9]{1,3}"}}}
    params = SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=40,
                            structured_outputs=StructuredOutputsParams(structural_tag=tag))
    (out,) = llm.generate(["one"], params, use_tqdm=False)
    stopped = [c.text for c in out.outputs if c.finish_reason == "stop"]
    assert stopped, [c.text for c in out.outputs]
    for text in stopped:
        assert re.fullmatch(r"<a>[0-9]{1,3}</a>", text), text
