"""The request checks the router and the engine share (quire/limits.py)."""

from __future__ import annotations

import pytest

from quire.limits import (DEFAULT_MAX_N, SAMPLING_RANGES, check_min_tokens, check_n,
                          check_sampling, request_prompt)
from quire.v1 import engine_pb2 as pb


@pytest.mark.parametrize("n", [1, 4])
def test_n_within_the_bound_passes(n):
    assert check_n(n, 4) == n


@pytest.mark.parametrize("n, message", [
    (0, "n: must be in [1, 4], got 0"), (5, "n: must be in [1, 4], got 5"),
    (-1, "n: must be in [1, 4], got -1"), (1.0, "n: must be an integer, got 1.0"),
    (True, "n: must be an integer, got True"), ("2", "n: must be an integer, got '2'"),
])
def test_n_outside_the_bound_names_the_field(n, message):
    with pytest.raises(ValueError) as err:
        check_n(n, 4)
    assert str(err.value) == message


def test_n_without_an_upper_bound_and_with_a_field_name():
    assert check_n(10_000) == 10_000
    with pytest.raises(ValueError, match=r"^n: must be at least 1, got 0$"):
        check_n(0)
    with pytest.raises(ValueError, match=r"^sampling\.n: must be in \[1, 16\], got 17$"):
        check_n(17, DEFAULT_MAX_N, field="sampling.n")


def test_request_prompt_is_the_text_or_the_token_ids():
    assert request_prompt(pb.GenerateRequest(text="hi")) == "hi"
    assert request_prompt(pb.GenerateRequest(token_ids=pb.TokenIds(ids=[3, 1, 2]))) == [3, 1, 2]


@pytest.mark.parametrize("request_, field", [
    (pb.GenerateRequest(), "prompt"),
    (pb.GenerateRequest(text=""), "text"),
    (pb.GenerateRequest(token_ids=pb.TokenIds(ids=[])), "token_ids"),
])
def test_a_missing_or_empty_prompt_names_the_field(request_, field):
    with pytest.raises(ValueError, match=rf"^{field}: "):
        request_prompt(request_)


# ------------------------------------------------------------------ sampling ranges, checked once

@pytest.mark.parametrize("name, value, message", [
    ("temperature", -0.5, "temperature: must be >= 0, got -0.5"),
    ("top_p", 0, "top_p: must be > 0 and <= 1, got 0"),
    ("top_k", -2, "top_k: must be >= -1 and <= 2147483647 (-1 and 0: off), got -2"),
    ("min_p", 1.5, "min_p: must be >= 0 and <= 1, got 1.5"),
    ("repetition_penalty", 0.0, "repetition_penalty: must be > 0, got 0.0"),
    ("presence_penalty", 2.5, "presence_penalty: must be >= -2 and <= 2, got 2.5"),
    ("max_tokens", 0, "max_tokens: must be >= 1 and <= 4294967295, got 0"),
    ("min_tokens", 2 ** 32, "min_tokens: must be >= 0 and <= 4294967295, got 4294967296"),
    ("seed", 2 ** 63, "seed: must be >= 0 and <= 9223372036854775807, got 9223372036854775808"),
    ("logprobs", 21, "logprobs: must be >= 0 and <= 20, got 21"),
    ("temperature", float("nan"), "temperature: must be a finite number, got NaN"),
    ("temperature", 1e39, "temperature: must be at most 3.402823e+38 in magnitude (a float32), "
     "got 1e+39"),
    ("temperature", True, "temperature: must be a number, got true"),
    ("top_k", 1.0, "top_k: must be an integer, got 1.0"),
    ("seed", "7", 'seed: must be an integer, got "7"'),
])
def test_check_sampling_names_the_field_and_echoes_the_value(name, value, message):
    with pytest.raises(ValueError) as err:
        check_sampling(name, value)
    assert str(err.value) == message and err.value.field == name


@pytest.mark.parametrize("name, value", [
    ("temperature", 0), ("temperature", 7.5), ("top_p", 1), ("top_k", -1), ("top_k", 0),
    ("min_p", 0.0), ("presence_penalty", -2), ("max_tokens", 1), ("seed", 2 ** 63 - 1),
    ("logprobs", 0), ("prompt_logprobs", 20),
])
def test_check_sampling_accepts_the_edges(name, value):
    assert check_sampling(name, value) == value


def test_check_sampling_under_another_name_and_a_tighter_cap():
    with pytest.raises(ValueError) as err:
        check_sampling("logprobs", 30, field="top_logprobs")
    assert str(err.value) == "top_logprobs: must be >= 0 and <= 20, got 30"
    assert err.value.field == "top_logprobs"
    with pytest.raises(ValueError) as err:
        check_sampling("max_tokens", 9, hi=8, why=" (the cap)")
    assert str(err.value) == "max_tokens: must be >= 1 and <= 8 (the cap), got 9"
    assert check_sampling("max_tokens", 7, hi=2 ** 40) == 7  # a cap never loosens the range
    with pytest.raises(ValueError, match=r"<= 4294967295, got 4294967296$"):
        check_sampling("max_tokens", 2 ** 32, hi=2 ** 40)


def test_min_tokens_within_max_tokens():
    check_min_tokens(4, 4)
    check_min_tokens(1000, None)
    with pytest.raises(ValueError, match=r"^min_tokens: must not exceed max_tokens=4, got 5$"):
        check_min_tokens(5, 4)


# Every rule, out of range, as the HTTP front (OpenAI body) and the engine (SamplingParams) see
# it: the same message, naming the field each side calls it.
_OUT_OF_RANGE = [("temperature", -1), ("top_p", 1.5), ("top_k", -3), ("min_p", -0.1),
                 ("repetition_penalty", -1), ("presence_penalty", -3),
                 ("frequency_penalty", 3), ("max_tokens", 0), ("min_tokens", -1),
                 ("seed", -1), ("logprobs", 21), ("temperature", "hot")]


@pytest.mark.parametrize("name, value", _OUT_OF_RANGE)
def test_http_front_and_engine_refuse_alike(name, value):
    from engine_worker.sampling_params import SamplingParams
    from router.openai_protocol import RequestError, sampling_options

    assert set(SAMPLING_RANGES) >= {n for n, _ in _OUT_OF_RANGE}
    with pytest.raises(RequestError) as http:
        sampling_options({name: value}, chat=False)
    with pytest.raises(ValueError) as engine:
        SamplingParams(**{name: value})
    assert str(http.value) == str(engine.value) and str(http.value).startswith(f"{name}: ")
    assert http.value.param == name


@pytest.mark.parametrize("body, param, message", [
    ({"top_logprobs": 21, "logprobs": True}, "top_logprobs",
     "top_logprobs: must be >= 0 and <= 20, got 21"),
    ({"max_completion_tokens": 0}, "max_completion_tokens",
     "max_completion_tokens: must be >= 1 and <= 4294967295, got 0"),
    ({"max_tokens": 4, "min_tokens": 5}, "min_tokens",
     "min_tokens: must not exceed max_tokens=4, got 5"),
])
def test_the_http_front_names_the_openai_field(body, param, message):
    from router.openai_protocol import RequestError, sampling_options

    with pytest.raises(RequestError) as err:
        sampling_options(body, chat=True)
    assert (err.value.param, str(err.value)) == (param, message)


def test_float_fields_refuse_magnitudes_past_float32_ints_included():
    """An int too large for a float (10**400) is refused like 1e39, naming the field, instead
    of overflowing where it is converted."""
    from quire.errors import FieldError
    from quire.limits import FLOAT32_MAX, check_sampling

    for value in (10 ** 400, 10 ** 39, 1e39, -1e39):
        with pytest.raises(FieldError) as e:
            check_sampling("presence_penalty" if value < 0 else "temperature", value)
        assert "float32" in str(e.value) or "must be >=" in str(e.value)
    assert check_sampling("temperature", 2) == 2
    assert check_sampling("repetition_penalty", FLOAT32_MAX) == FLOAT32_MAX


def test_load_json_names_the_field_for_every_way_json_text_fails():
    from quire.errors import FieldError
    from quire.limits import load_json

    assert load_json('{"a": [1, 2]}', "f") == {"a": [1, 2]}
    for text, words in (("{", "not valid JSON"), (b"\xff", "not UTF-8"),
                        ("[" * 100_000 + "]" * 100_000, "nested too deeply"),
                        ("1" * 5000, "4300 digits")):
        with pytest.raises(FieldError) as e:
            load_json(text, "body")
        assert e.value.field == "body" and words in str(e.value), e.value


def test_logit_bias_keys_and_values_are_bounded_before_any_conversion():
    from quire.errors import FieldError
    from quire.structured_outputs import check_logit_bias

    assert check_logit_bias({"5": 1, 7: -100}) == {5: 1.0, 7: -100.0}
    for bias in ({"4294967296": 1}, {"1" * 5000: 1}, {"-1": 1}, {"1": 10 ** 400},
                 {"1": float("nan")}, {"1": float("inf")}):
        with pytest.raises(FieldError) as e:
            check_logit_bias(bias)
        assert e.value.field == "logit_bias"
