"""vLLM's older extra-body names of structured outputs (``guided_json``, ``guided_regex``,
``guided_choice``, ``guided_grammar``) on the router's OpenAI front: each becomes the same
wire spec as its ``structured_outputs`` kind, and a bad one is refused under its own name."""

from __future__ import annotations

import json

import pytest

from router.openai_answer import OpenAIRequest
from router.openai_protocol import RequestError, check_body, structured_outputs_of

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}}


@pytest.mark.parametrize("name, value, kind", [
    ("guided_json", SCHEMA, "json"), ("guided_json", json.dumps(SCHEMA), "json"),
    ("guided_regex", "[a-z]+", "regex"), ("guided_choice", ["yes", "no"], "choice"),
    ("guided_grammar", 'root ::= "a"', "grammar")])
def test_guided_fields_are_their_structured_outputs_kind(name, value, kind):
    check_body({"messages": [], name: value}, chat=True)
    check_body({"prompt": "x", name: value}, chat=False)
    legacy = structured_outputs_of({name: value})
    current = structured_outputs_of({"structured_outputs": {kind: value}})
    assert legacy == current and legacy.WhichOneof("kind") == kind


@pytest.mark.parametrize("body, param, words", [
    ({"guided_choice": []}, "guided_choice", "non-empty"),
    ({"guided_json": "{not json"}, "guided_json", "not valid JSON"),
    ({"guided_json": 5}, "guided_json", "JSON schema"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_regex", "cannot be combined"),
    ({"guided_regex": "a", "structured_outputs": {"regex": "a"}}, "structured_outputs",
     "cannot be combined with guided_regex"),
    ({"guided_json": SCHEMA, "response_format": {"type": "json_object"}}, "response_format",
     "cannot be combined"),
])
def test_bad_guided_fields_name_themselves(body, param, words):
    with pytest.raises(RequestError) as e:
        structured_outputs_of(body)
    assert e.value.param == param and words in str(e.value), str(e.value)


def test_engine_refusals_of_a_guided_spec_name_the_guided_field():
    request = OpenAIRequest({"messages": [], "guided_regex": "(("}, chat=True, model_name="m",
                            token_text=str)
    # (the adapter a request names is its model, and the ids the router sent are the chat's
    # messages: always aliased)
    assert request.field_aliases == {"structured_outputs.regex": "guided_regex",
                                     "lora_name": "model", "token_ids": "messages",
                                     "prompt": "messages"}
