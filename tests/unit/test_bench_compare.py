"""``quire bench compare``'s pure parts: the --dtypes grammar and the shared request set."""

from __future__ import annotations

from pathlib import Path

import pytest

from quire_cli.bench.compare import CompareConfig, make_requests, parse_dtypes


@pytest.mark.parametrize("text, expected", [
    ("float32", {"quire": ("float32",), "vllm": ("float32",)}),
    ("float32,bfloat16", {"quire": ("float32", "bfloat16"), "vllm": ("float32", "bfloat16")}),
    ("quire=bfloat16,vllm=float32", {"quire": ("bfloat16",), "vllm": ("float32",)}),
    ("quire=bfloat16, quire=float32, vllm=float32",
     {"quire": ("bfloat16", "float32"), "vllm": ("float32",)}),
])
def test_dtypes(text, expected):
    assert parse_dtypes(text) == expected


@pytest.mark.parametrize("text, message", [
    ("float64", "unknown dtype 'float64'"),
    ("sglang=float32", "unknown system 'sglang'"),
    ("quire=float32", "every system needs a dtype"),
])
def test_bad_dtypes_name_the_field(text, message):
    with pytest.raises(ValueError, match=f"dtypes: {message}"):
        CompareConfig(dtypes=text)


def test_both_systems_get_one_request_set_fresh_prompts_for_each_timing():
    cfg = CompareConfig(num_prompts=5, repeats=2, decode_prompt_len=7, ttft_prompt_len=11)
    req = make_requests(cfg, 1000, Path("/m"), 2048)
    assert req == make_requests(cfg, 1000, Path("/m"), 2048)  # the same every run
    assert len(req["workload"]["prompt_token_ids"]) == 5 == len(req["workload"]["output_lens"])
    singles = [tuple(p) for pair in req["decode_prompt_pairs"] for p in pair]
    singles += [tuple(p) for p in req["ttft_prompts"]]
    assert len(req["decode_prompt_pairs"]) == 3 and len(req["ttft_prompts"]) == 3  # + warm-up
    assert len(set(singles)) == len(singles)  # no prompt is timed twice: no prefix-cache help
    assert {len(p) for p in req["ttft_prompts"]} == {11}
