"""The request checks the router and the engine share (quire/limits.py)."""

from __future__ import annotations

import pytest

from quire.limits import DEFAULT_MAX_N, check_n, request_prompt
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
