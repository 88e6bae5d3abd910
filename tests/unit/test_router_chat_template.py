"""router.chat_template: vLLM's chat-template fields, checked and rendered (the router's own
tokenizer, no engine)."""

from __future__ import annotations

import pytest

from router.chat_template import ChatTemplateOptions
from router.openai_protocol import RequestError
from quire.tokenizer import FastTokenizer

# a template that refuses a conversation whose roles do not alternate, as Mistral's does, and
# reads one template variable (``shout``) from chat_template_kwargs
TEMPLATE = (
    "{% for m in messages %}"
    "{% if loop.index0 > 0 and m['role'] == messages[loop.index0 - 1]['role'] %}"
    "{{ raise_exception('Conversation roles must alternate') }}{% endif %}"
    "<{{ m['role'] }}>{{ m['content'] | upper if shout else m['content'] }}</{{ m['role'] }}>"
    "{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}")


@pytest.fixture(scope="module")
def tokenizer(embedded_model_dir) -> FastTokenizer:
    files = {name: (embedded_model_dir / name).read_bytes()
             for name in ("tokenizer.json", "tokenizer_config.json")}
    files["chat_template.jinja"] = TEMPLATE.encode()
    return FastTokenizer.from_files(files)


USER = [{"role": "user", "content": "hi"}]


def test_fields_change_the_rendering(tokenizer):
    assert ChatTemplateOptions().render(tokenizer, USER) == "<user>hi</user><assistant>"
    options = ChatTemplateOptions.from_body({"add_generation_prompt": False,
                                             "chat_template_kwargs": {"shout": True}}, USER)
    assert options.render(tokenizer, USER) == "<user>HI</user>"
    partial = USER + [{"role": "assistant", "content": "Hel"}]
    options = ChatTemplateOptions.from_body({"continue_final_message": True}, partial)
    assert options.render(tokenizer, partial) == "<user>hi</user><assistant>Hel"
    assert not options.add_generation_prompt


def test_continue_final_message_cuts_where_transformers_does(tokenizer):
    """The router renders continue_final_message through the tokenizer's transformers-style
    cut (a tag after the final text), as the engine does: a final message whose text also
    occurs in what the template adds after it ("s" in "</assistant>") is not cut inside that
    closing text, and one the template alters is the field's 400."""
    partial = USER + [{"role": "assistant", "content": "s"}]
    options = ChatTemplateOptions.from_body({"continue_final_message": True}, partial)
    assert options.render(tokenizer, partial) == "<user>hi</user><assistant>s"
    assert options.render(tokenizer, partial) == tokenizer.apply_chat_template(
        partial, add_generation_prompt=False, continue_final_message=True)
    wordy = USER + [{"role": "assistant", "content": "hi there"}]
    shouted = ChatTemplateOptions.from_body(
        {"continue_final_message": True, "chat_template_kwargs": {"shout": True}}, wordy)
    with pytest.raises(RequestError) as err:
        shouted.render(tokenizer, wordy)  # the template upper-cased the final text
    assert err.value.param == "continue_final_message"


def test_a_template_that_raises_is_the_requests_error(tokenizer):
    twice = USER + USER
    with pytest.raises(RequestError) as err:
        ChatTemplateOptions().render(tokenizer, twice)
    assert err.value.param == "messages" and "roles must alternate" in str(err.value)


@pytest.mark.parametrize("body, param", [
    ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs"),
    ({"chat_template_kwargs": "x"}, "chat_template_kwargs"),
    ({"add_generation_prompt": 1}, "add_generation_prompt"),
    ({"continue_final_message": True}, "continue_final_message"),  # last message is the user's
    ({"continue_final_message": True, "add_generation_prompt": True}, "continue_final_message"),
    ({"add_special_tokens": "no"}, "add_special_tokens"),
])
def test_bad_fields_are_named(body, param):
    with pytest.raises(RequestError) as err:
        ChatTemplateOptions.from_body(body, USER)
    assert err.value.param == param
