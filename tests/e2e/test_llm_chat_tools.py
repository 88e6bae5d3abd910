"""Tool calling through the offline ``LLM.chat`` (vLLM's ``tools=``, plus OpenAI's
``tool_choice`` and ``parallel_tool_calls``), on the tiny random Llama with the embedded
model's tokenizer and chat template (which ignores tools: the Hermes format is written into the
prompt). Random weights call nothing of their own accord, so "required" and named choices show
the grammar alone makes every call parse against its function's schema."""

from __future__ import annotations

import json

import jsonschema
import pytest

from engine_worker import LLM, SamplingParams
from engine_worker.sampling_params import StructuredOutputsParams
from tests.e2e.test_tool_calls import QUESTION, SCHEMAS, TOOLS


@pytest.fixture(scope="module")
def llm(tiny_model_dir) -> LLM:
    return LLM(str(tiny_model_dir), dtype="float32", kv_cache_memory_bytes=1 << 24)


def _calls(completion) -> list[dict]:
    assert completion.tool_calls, completion.text
    for call in completion.tool_calls:
        assert call["type"] == "function" and call["id"].startswith("call_")
        jsonschema.validate(json.loads(call["function"]["arguments"]),
                            SCHEMAS[call["function"]["name"]])
    return completion.tool_calls


def test_required_calls_parse_whatever_the_weights(llm):
    single = llm.chat(QUESTION, SamplingParams(n=4, temperature=1.0, seed=3, max_tokens=120),
                      use_tqdm=False, tools=TOOLS, tool_choice="required",
                      parallel_tool_calls=False)[0]
    for completion in single.outputs:
        assert completion.finish_reason == "stop", completion.text
        assert len(_calls(completion)) == 1
    # parallel calls: a JSON array of any length >= 1, every entry a call that parses
    many = llm.chat(QUESTION, SamplingParams(n=4, temperature=1.0, seed=5, max_tokens=200),
                    use_tqdm=False, tools=TOOLS, tool_choice="required")[0]
    done = [c for c in many.outputs if c.finish_reason == "stop"]
    assert done
    for completion in done:
        assert len(_calls(completion)) == len(json.loads(completion.text))


@pytest.mark.parametrize("name", ["get_weather", "convert_currency"])
def test_named_function_is_the_one_called(llm, name):
    out = llm.chat([QUESTION, QUESTION + [{"role": "assistant", "content": "Let me see."},
                                          {"role": "user", "content": "Go on."}]],
                   SamplingParams(temperature=1.0, seed=7, max_tokens=120), use_tqdm=False,
                   tools=TOOLS, tool_choice={"type": "function", "function": {"name": name}})
    for output in out:
        (call,) = _calls(output.outputs[0])
        assert call["function"]["name"] == name
        assert json.loads(output.outputs[0].text) == json.loads(call["function"]["arguments"])


def test_tools_render_in_the_prompt_and_results_render_back(llm):
    plain = llm.chat(QUESTION, SamplingParams(max_tokens=1), use_tqdm=False)[0]
    assert "<tools>" not in plain.prompt and plain.outputs[0].tool_calls is None
    first = llm.chat(QUESTION, SamplingParams(temperature=0, max_tokens=120), use_tqdm=False,
                     tools=TOOLS, tool_choice="required", parallel_tool_calls=False)[0]
    assert '"name": "get_weather"' in first.prompt and "<tools>" in first.prompt
    call = first.outputs[0].tool_calls[0]
    history = QUESTION + [{"role": "assistant", "content": None, "tool_calls": [call]},
                          {"role": "tool", "tool_call_id": call["id"],
                           "content": "22 degrees celsius and sunny"}]
    final = llm.chat(history, SamplingParams(temperature=0, max_tokens=4), use_tqdm=False,
                     tools=TOOLS, tool_choice="none")[0]
    assert "<tool_response>\n22 degrees celsius and sunny\n</tool_response>" in final.prompt
    assert f'"name": "{call["function"]["name"]}"' in final.prompt
    # none: no call is parsed or enforced, but the tools are still shown, as vLLM's default
    assert "<tools>" in final.prompt
    assert final.outputs[0].tool_calls is None


def test_auto_parses_what_the_model_writes(llm):
    """Random weights write no <tool_call>: the text stays content, no calls."""
    out = llm.chat(QUESTION, SamplingParams(temperature=0, max_tokens=8), use_tqdm=False,
                   tools=TOOLS)[0]
    assert "<tools>" in out.prompt
    assert out.outputs[0].tool_calls is None and out.outputs[0].text


@pytest.mark.parametrize("kwargs, field", [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [{"type": "function"}]}, "tools"),
    ({"tools": TOOLS, "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ({"tools": TOOLS, "tool_choice": "required",
      "sampling_params": SamplingParams(structured_outputs=StructuredOutputsParams(
          json_object=True))}, "tool_choice"),
    ({"continue_final_message": True}, "continue_final_message"),
])
def test_bad_tool_arguments_name_the_field(llm, kwargs, field):
    with pytest.raises(ValueError, match=f"^{field}"):
        llm.chat(QUESTION, use_tqdm=False, **kwargs)
    assert llm.chat(QUESTION, SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs[0].text
