"""The block-hash contract: pinned values that engines and routers must both produce.

Changing any number here is a wire-protocol change (see ``quire/block_hash.py``): bump the
domain tag and ``BLOCK_HASH_ALGORITHM`` rather than editing the pins.
"""

from __future__ import annotations

import hashlib
import struct
import subprocess
import sys

import pytest

from quire.block_hash import (BLOCK_HASH_ALGORITHM, ROOT_HASH, first_block_extra_keys,
                              hash_block, hash_block_tokens)

TOKENS_12 = list(range(100, 112))  # three full blocks of 4
CHAIN_12 = [4736461211415503188, 5465841201497931947, 17959905060985124631]
CHAIN_12_SALTED = [11601888052319677336, 13663792849977945783, 11091480306793281145]


def reference_hash(parent_hash: int, token_ids, extra_keys=()) -> int:
    """The encoding exactly as the module docstring states it, written out independently."""
    data = b"quire.block.v1" + struct.pack("<Q", parent_hash)
    data += struct.pack("<I", len(token_ids)) + b"".join(struct.pack("<I", t) for t in token_ids)
    data += struct.pack("<I", len(extra_keys))
    for key in extra_keys:
        raw = key.encode("utf-8")
        data += struct.pack("<I", len(raw)) + raw
    return int.from_bytes(hashlib.sha256(data).digest()[:8], "little")


# ------------------------------------------------------------------------------- pins
def test_algorithm_name_and_root_hash_are_pinned():
    assert BLOCK_HASH_ALGORITHM == "sha256-64-chained-v1"
    assert ROOT_HASH == 8115852720484773575
    assert ROOT_HASH == int.from_bytes(hashlib.sha256(b"quire.block.v1.root").digest()[:8],
                                       "little")


@pytest.mark.parametrize("parent, tokens, extra, expected", [
    (ROOT_HASH, [1, 2, 3, 4], (), 9558269281766641333),
    (ROOT_HASH, [1, 2, 3, 4], ("salt:abc",), 510398826598495209),
    (ROOT_HASH, [], (), 17012646037524348858),
    (0, [0], (), 1474253414066037021),
    (ROOT_HASH, [49151, 0, 2**32 - 1, 7], (), 13782972782056347332),
    # keys are length-prefixed: ("a", "b") and ("ab",) must not collide
    (ROOT_HASH, [1, 2, 3, 4], ("a", "b"), 6025751485405299736),
    (ROOT_HASH, [1, 2, 3, 4], ("ab",), 3627313664981541078),
])
def test_single_block_hashes_are_pinned(parent, tokens, extra, expected):
    assert hash_block(parent, tokens, extra) == expected
    assert reference_hash(parent, tokens, extra) == expected
    assert 0 <= expected < 2**64


def test_hash_is_64_bit_unsigned_and_depends_on_every_input():
    base = hash_block(ROOT_HASH, [1, 2, 3, 4])
    assert hash_block(ROOT_HASH + 1, [1, 2, 3, 4]) != base
    assert hash_block(ROOT_HASH, [1, 2, 3, 5]) != base
    assert hash_block(ROOT_HASH, [2, 1, 3, 4]) != base
    assert hash_block(ROOT_HASH, [1, 2, 3]) != base
    assert hash_block(ROOT_HASH, [1, 2, 3, 4], ("x",)) != base


def test_chain_of_three_blocks_is_pinned():
    assert hash_block_tokens(TOKENS_12, 4) == CHAIN_12
    # each link is hash_block of the previous link
    parent = ROOT_HASH
    for i, expected in enumerate(CHAIN_12):
        parent = hash_block(parent, TOKENS_12[4 * i:4 * i + 4])
        assert parent == expected


def test_cache_salt_changes_the_first_block_and_therefore_every_later_one():
    salted = hash_block_tokens(TOKENS_12, 4, cache_salt="tenant-a")
    assert salted == CHAIN_12_SALTED
    assert all(s != u for s, u in zip(salted, CHAIN_12))
    # the salt is an extra key of the first block only; later blocks differ through the chain
    assert salted[0] == hash_block(ROOT_HASH, TOKENS_12[:4], ("salt:tenant-a",))
    assert salted[1] == hash_block(salted[0], TOKENS_12[4:8])
    assert salted[2] == hash_block(salted[1], TOKENS_12[8:12])
    assert hash_block_tokens(TOKENS_12, 4, cache_salt="tenant-b") != salted


@pytest.mark.parametrize("salt", [None, ""])
def test_no_salt_and_empty_salt_are_the_same_unsalted_chain(salt):
    assert first_block_extra_keys(salt) == ()
    assert hash_block_tokens(TOKENS_12, 4, cache_salt=salt) == CHAIN_12


def test_first_block_extra_keys():
    assert first_block_extra_keys("tenant-a") == ("salt:tenant-a",)


# ------------------------------------------------------------------------ partial blocks
@pytest.mark.parametrize("num_tokens, num_hashes", [(0, 0), (3, 0), (4, 1), (7, 1), (8, 2),
                                                    (11, 2), (12, 3), (13, 3)])
def test_a_trailing_partial_block_gets_no_hash(num_tokens, num_hashes):
    hashes = hash_block_tokens(list(range(100, 100 + num_tokens)), 4)
    assert len(hashes) == num_hashes
    assert hashes == CHAIN_12[:num_hashes]


def test_appending_tokens_never_changes_earlier_hashes():
    tokens = TOKENS_12 + [5, 6, 7, 8]
    assert hash_block_tokens(tokens, 4)[:3] == CHAIN_12
    assert hash_block_tokens(tokens[:13], 4) == CHAIN_12


@pytest.mark.parametrize("block_size", [1, 2, 3, 4, 6])
def test_block_size_is_part_of_the_key(block_size):
    hashes = hash_block_tokens(TOKENS_12, block_size)
    assert len(hashes) == 12 // block_size
    if block_size != 4:
        assert not set(hashes) & set(CHAIN_12)


# ----------------------------------------------------------------------- continuing a chain
@pytest.mark.parametrize("salt", [None, "tenant-a"])
@pytest.mark.parametrize("start", [0, 1, 2, 3])
def test_continuing_a_chain_equals_hashing_it_whole(salt, start):
    whole = hash_block_tokens(TOKENS_12, 4, cache_salt=salt)
    parent = whole[start - 1] if start else ROOT_HASH
    rest = hash_block_tokens(TOKENS_12, 4, cache_salt=salt, parent_hash=parent,
                             start_block=start)
    assert whole[:start] + rest == whole


def test_continuing_with_a_partial_tail_adds_only_the_new_full_blocks():
    first = hash_block_tokens(TOKENS_12[:6], 4)  # one full block, a partial one
    more = hash_block_tokens(TOKENS_12[:10], 4, parent_hash=first[-1], start_block=len(first))
    assert first + more == CHAIN_12[:2]


def test_continuing_does_not_salt_later_blocks_again():
    salted = hash_block_tokens(TOKENS_12, 4, cache_salt="s")
    rest = hash_block_tokens(TOKENS_12, 4, cache_salt="s", parent_hash=salted[0],
                             start_block=1)
    assert rest == salted[1:]


# ------------------------------------------------------------------------- no torch
def test_shared_contract_modules_import_without_torch():
    code = ("import quire.block_hash, quire.kv_events, sys; "
            "assert 'torch' not in sys.modules, 'torch was imported'")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
