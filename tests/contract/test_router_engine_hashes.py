"""The router and the engine tokenize, render chat templates and hash blocks exactly as
transformers and the engine's scheduler do.

Both sides tokenize with ``quire.tokenizer.FastTokenizer`` (Rust tokenizers + jinja2, no torch;
the engine through ``engine_worker.tokenizer.Tokenizer``); the reference is transformers'
``AutoTokenizer`` of the same directory, and the hashes are those the engine's scheduler stores
on ``Request.block_hashes``. All load the embedded SmolLM2 directory.
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
from pathlib import Path

import pytest

from quire.tokenizer import FastTokenizer

TEXTS = [
    "Hello world",
    " leading space and trailing space ",
    "The quick brown fox jumps over the lazy dog.\n\nNew paragraph\twith a tab.",
    "Größe, naïve café, smørrebrød, Ærø",
    "日本語のテキストと中文字符，还有한국어도 있습니다。",
    "Emoji: 👋🏽 🚀🔥 👨‍👩‍👧‍👦 and flags 🇫🇷🇯🇵",
    "def fib(n: int) -> int:\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n",
    '{"key": [1, 2.5, null, true], "nested": {"a": "b\\n"}}',
    "<|im_start|>user\nspecial tokens inline<|im_end|>\n<|endoftext|>",
    "   \n\n\t  whitespace   runs \r\n",
    "Numbers 1234567890 3.14159 -42 1e10 0x1F",
    ("A long passage about caches. " * 60) + "Ünïcödé at the end ✓",
]

CONVERSATIONS = [
    [{"role": "system", "content": "You are terse."},
     {"role": "user", "content": "What is 2 + 2?"}],
    [{"role": "user", "content": "Hi there! 👋"}],
    [{"role": "system", "content": "You translate to French."},
     {"role": "user", "content": "Good morning"},
     {"role": "assistant", "content": "Bonjour"},
     {"role": "user", "content": "Good night, café ☕"}],
    [{"role": "user", "content": "  {% raw %}not a tag{% endraw %}  \n"},
     {"role": "assistant", "content": "```python\nprint('x')\n```"},
     {"role": "user", "content": ""}],
]

BLOCK_SIZES = [1, 4, 16, 32]
SALTS = [None, "tenant-a"]


@pytest.fixture(scope="module")
def router_tokenizer(embedded_model_dir: Path) -> FastTokenizer:
    return FastTokenizer.from_dir(embedded_model_dir)


@pytest.fixture(scope="module")
def engine_tokenizer(embedded_model_dir: Path):
    from engine_worker.tokenizer import Tokenizer

    return Tokenizer(embedded_model_dir)


@pytest.fixture(scope="module")
def hf_tokenizer(embedded_model_dir: Path):
    """The reference: transformers' own tokenizer of the directory."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(embedded_model_dir))


@pytest.mark.parametrize("text", TEXTS, ids=range(len(TEXTS)))
@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_encode_matches_transformers(router_tokenizer, engine_tokenizer, hf_tokenizer, text,
                                     add_special_tokens):
    expected = hf_tokenizer.encode(text, add_special_tokens=add_special_tokens)
    assert router_tokenizer.encode(text, add_special_tokens=add_special_tokens) == expected
    assert engine_tokenizer.encode(text, add_special_tokens=add_special_tokens) == expected


@pytest.mark.parametrize("text", TEXTS, ids=range(len(TEXTS)))
@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_engine_decode_matches_transformers(engine_tokenizer, hf_tokenizer, text,
                                            skip_special_tokens):
    ids = hf_tokenizer.encode(text)
    assert (engine_tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
            == hf_tokenizer.decode(ids, skip_special_tokens=skip_special_tokens))


def test_special_tokens_and_vocab_match_transformers(router_tokenizer, engine_tokenizer,
                                                     hf_tokenizer):
    """SmolLM2 adds no BOS on encode; whatever transformers does, the router does too."""
    assert router_tokenizer.encode("Hello") == hf_tokenizer.encode("Hello")
    assert hf_tokenizer.bos_token == router_tokenizer.bos_token
    assert hf_tokenizer.eos_token == router_tokenizer.eos_token
    assert engine_tokenizer.vocab_size == len(hf_tokenizer)
    assert hf_tokenizer.eos_token_id in engine_tokenizer.eos_token_ids
    assert engine_tokenizer.hf is engine_tokenizer.hf  # loaded once, on first use


@pytest.mark.parametrize("messages", CONVERSATIONS, ids=range(len(CONVERSATIONS)))
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(router_tokenizer, engine_tokenizer, hf_tokenizer,
                                            messages, add_generation_prompt):
    theirs = hf_tokenizer.apply_chat_template(messages, tokenize=False,
                                              add_generation_prompt=add_generation_prompt)
    assert router_tokenizer.apply_chat_template(messages, add_generation_prompt) == theirs
    assert engine_tokenizer.apply_chat_template(messages, add_generation_prompt) == theirs
    assert router_tokenizer.encode(theirs) == hf_tokenizer.encode(theirs)


@pytest.mark.parametrize("final", ["Bonjour", "Bonjour ", "The answer is", ""])
def test_continue_final_message_matches_transformers(engine_tokenizer, hf_tokenizer, final):
    messages = [{"role": "user", "content": "Say hello in French."},
                {"role": "assistant", "content": final}]
    theirs = hf_tokenizer.apply_chat_template(messages, tokenize=False,
                                              continue_final_message=True)
    assert theirs.endswith("<|im_start|>assistant\n" + final)  # cut inside the last turn
    assert engine_tokenizer.apply_chat_template(messages, add_generation_prompt=False,
                                                continue_final_message=True) == theirs


def test_continue_final_message_needs_a_final_message(engine_tokenizer):
    with pytest.raises(ValueError, match="continue_final_message"):
        engine_tokenizer.apply_chat_template([], add_generation_prompt=False,
                                             continue_final_message=True)


def test_digest_matches_engine(router_tokenizer, embedded_model_dir):
    from quire.tokenizer_digest import tokenizer_dir_digest as tokenizer_digest

    assert router_tokenizer.digest == tokenizer_digest(embedded_model_dir)
    raw = (embedded_model_dir / "tokenizer.json").read_bytes()
    assert router_tokenizer.digest == hashlib.sha256(raw).hexdigest()


def _scheduler_block_hashes(token_ids: list[int], block_size: int, cache_salt: str | None,
                            eos_ids) -> list[int]:
    from engine_worker.kv_cache.manager import KVCacheManager
    from engine_worker.request import Request
    from engine_worker.sampling_params import SamplingParams
    from engine_worker.scheduler.scheduler import Scheduler

    kv = KVCacheManager(num_blocks=4096, block_size=block_size, enable_prefix_caching=True)
    scheduler = Scheduler(kv_cache_manager=kv, max_num_batched_tokens=8192, max_num_seqs=8,
                          max_model_len=8192)
    request = Request("r0", list(token_ids), SamplingParams(), eos_ids, max_tokens=16,
                      cache_salt=cache_salt)
    scheduler.add_request(request)
    return list(request.block_hashes)


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("cache_salt", SALTS)
def test_block_hashes_match_scheduler(router_tokenizer, engine_tokenizer, block_size, cache_salt):
    prompts = [TEXTS[2], TEXTS[5], TEXTS[11]]
    prompts += [engine_tokenizer.apply_chat_template(m) for m in CONVERSATIONS[:2]]
    checked_blocks = 0
    for prompt in prompts:
        router_ids = router_tokenizer.encode(prompt)
        engine_ids = engine_tokenizer.encode(prompt)
        assert router_ids == engine_ids
        ours = router_tokenizer.block_hashes(router_ids, block_size, cache_salt=cache_salt)
        theirs = _scheduler_block_hashes(engine_ids, block_size, cache_salt,
                                         engine_tokenizer.eos_token_ids)
        assert ours == theirs
        assert len(ours) == len(router_ids) // block_size
        checked_blocks += len(ours)
    assert checked_blocks > 0


def test_salt_changes_every_hash(router_tokenizer):
    ids = router_tokenizer.encode(TEXTS[11])
    plain = router_tokenizer.block_hashes(ids, 16)
    salted = router_tokenizer.block_hashes(ids, 16, cache_salt="tenant-a")
    assert len(plain) == len(salted) > 1
    assert all(a != b for a, b in zip(plain, salted))


def test_router_tokenizer_imports_no_torch_or_transformers():
    code = ("import quire.tokenizer, sys; "
            "assert 'torch' not in sys.modules and 'transformers' not in sys.modules, "
            "[m for m in ('torch', 'transformers') if m in sys.modules]")
    repo_root = Path(__file__).resolve().parents[2]
    subprocess.run([sys.executable, "-c", code], check=True, cwd=repo_root)



def test_named_chat_templates_are_chosen_as_transformers_does(embedded_model_dir, tmp_path):
    """tokenizer_config.json's list of named templates: "tool_use" when tools are given,
    "default" otherwise (chat_template.jinja absent)."""
    import json

    from transformers import AutoTokenizer

    config = json.loads((embedded_model_dir / "tokenizer_config.json").read_text())
    config["chat_template"] = [
        {"name": "default", "template": "{% for m in messages %}D:{{ m['content'] }}\n"
                                        "{% endfor %}"},
        {"name": "tool_use", "template": "{% for t in tools %}T:{{ t['function']['name'] }}\n"
                                         "{% endfor %}{% for m in messages %}U:"
                                         "{{ m['content'] }}\n{% endfor %}"}]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    (tmp_path / "tokenizer.json").write_bytes((embedded_model_dir / "tokenizer.json").read_bytes())
    ours = FastTokenizer.from_dir(tmp_path)
    theirs = AutoTokenizer.from_pretrained(str(tmp_path))
    messages = [{"role": "user", "content": "hi"}]
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]
    for kwargs in ({}, {"tools": tools}):
        expected = theirs.apply_chat_template(messages, tokenize=False, **kwargs)
        assert ours.apply_chat_template(messages, False, **kwargs) == expected
    assert ours.apply_chat_template(messages, False, tools=tools).startswith("T:get_weather")
    del config["chat_template"][0]  # no default: both refuse a call without tools
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="no default"):
        FastTokenizer.from_dir(tmp_path).apply_chat_template(messages, False)
