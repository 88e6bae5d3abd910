"""The suffix automaton against brute force, and suffix proposals from a request's own context
and from recent outputs of finished requests."""

from __future__ import annotations

import random

import numpy as np
import pytest

from engine_worker.spec_decode.config import SpeculativeConfig
from engine_worker.spec_decode.suffix import SuffixAutomaton, SuffixProposer


def _brute_longest_repeat(tokens):
    n = len(tokens)
    for length in range(n - 1, 0, -1):
        suffix = tokens[n - length:]
        for end in range(length - 1, n - 1):
            if tokens[end - length + 1:end + 1] == suffix:
                return length, end
    return 0, -1


@pytest.mark.parametrize("seed", range(20))
def test_automaton_finds_the_longest_repeat_and_its_first_occurrence(seed):
    rng = random.Random(seed)
    sam = SuffixAutomaton()
    tokens = []
    for _ in range(60):
        token = rng.randrange(3)
        tokens.append(token)
        sam.extend(token)
        assert sam.longest_repeat() == _brute_longest_repeat(tokens)
    for _ in range(30):
        i = rng.randrange(len(tokens))
        pattern = tokens[i:i + rng.randrange(1, 6)]
        first = next(e for e in range(len(pattern) - 1, len(tokens))
                     if tokens[e - len(pattern) + 1:e + 1] == pattern)
        assert sam.find(pattern) == first
    assert sam.find([5]) == -1


def test_proposals_from_the_request_and_from_finished_outputs():
    proposer = SuffixProposer(min_match=2, max_depth=8)
    own = np.array([10, 11, 12, 13, 14, 15, 10, 11])
    assert proposer.propose("a", own, 3) == (12, 13, 14)
    assert proposer.propose("b", np.array([1, 2, 3, 40, 41]), 3) == ()
    proposer.forget("a", [40, 41, 42, 43, 44, 45])  # a finished output others can follow
    assert proposer.propose("b", np.array([1, 2, 3, 40, 41]), 3) == (42, 43, 44)
    # a draft stops at the end of that output
    assert proposer.propose("c", np.array([7, 44, 45]), 4) == ()
    assert proposer.propose("d", np.array([7, 43, 44]), 4) == (45,)


def test_old_outputs_are_dropped_when_the_corpus_is_full():
    proposer = SuffixProposer(min_match=2, max_outputs=2)
    for i in range(3):
        proposer.forget(f"r{i}", [100 * i + 1, 100 * i + 2, 100 * i + 3])
    assert proposer.propose("x", np.array([9, 201, 202]), 1) == (203,)
    assert proposer.propose("y", np.array([9, 1, 2]), 1) == ()  # the oldest is gone


def test_suffix_config_fields_are_checked():
    cfg = SpeculativeConfig.parse({"method": "suffix", "num_speculative_tokens": 4})
    assert (cfg.suffix_decoding_max_tree_depth, cfg.suffix_decoding_max_cached_requests) == \
        (24, 1000)
    with pytest.raises(ValueError, match=r"speculative_config\.suffix_decoding_max_tree_depth"):
        SpeculativeConfig.parse({"method": "suffix", "num_speculative_tokens": 4,
                                 "suffix_decoding_max_tree_depth": 0})
    with pytest.raises(ValueError, match=r"speculative_config\.suffix_decoding_max_tree_depth"):
        SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 4,
                                 "suffix_decoding_max_tree_depth": 3})
