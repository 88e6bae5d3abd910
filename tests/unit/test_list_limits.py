"""The list limits the router and the engine share (quire/list_limits.py, issue 32)."""

from __future__ import annotations

import pytest

from quire.list_limits import MAX_STOP_TOKEN_IDS, check_length, check_token_ids


def test_a_list_at_its_limit_passes_and_one_more_is_refused_naming_the_limit():
    check_length([0] * MAX_STOP_TOKEN_IDS, MAX_STOP_TOKEN_IDS, "stop_token_ids", "ids")
    with pytest.raises(ValueError) as err:
        check_length([0] * (MAX_STOP_TOKEN_IDS + 1), MAX_STOP_TOKEN_IDS, "stop_token_ids",
                     "stop token ids")
    assert str(err.value) == (f"stop_token_ids: at most {MAX_STOP_TOKEN_IDS} stop token ids, "
                              f"got {MAX_STOP_TOKEN_IDS + 1}")
    assert err.value.field == "stop_token_ids"


@pytest.mark.parametrize("bad", [-1, 100, True, 1.0, "3", None])
def test_token_ids_must_be_integers_in_the_vocabulary(bad):
    check_token_ids([0, 99], 100, "prompt_token_ids")
    with pytest.raises(ValueError) as err:
        check_token_ids([0, bad], 100, "prompt_token_ids")
    assert str(err.value) == f"prompt_token_ids: {bad!r} is not a token id in [0, 100)"
