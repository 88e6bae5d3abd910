"""The block-hash contract shared by engines and routers (no torch, standard library only).

A *full* KV block of ``block_size`` tokens is named by a 64-bit hash that chains its parent's::

    hash(block i) = H(hash(block i-1), token_ids of block i, extra_keys of block i)
    hash(block -1) = ROOT_HASH (the seed)

``H`` is the first 8 bytes, little-endian, of SHA-256 over this canonical encoding::

    b"quire.block.v1"                      domain tag, 14 bytes
    parent_hash                            uint64 little-endian
    len(token_ids)                         uint32 little-endian
    token_ids                              uint32 little-endian each
    len(extra_keys)                        uint32 little-endian
    for each extra key (a UTF-8 string):   uint32 byte length, then the bytes

``ROOT_HASH`` is the first 8 bytes, little-endian, of SHA-256(b"quire.block.v1.root").
Extra keys isolate caches: the request's ``cache_salt`` (``"salt:<salt>"``) and the LoRA
adapter it runs under (``"lora:<lora_name>"``, vLLM's ``extra_keys`` for LoRA) are extra keys
of its *first* block only (the chain carries them into every later block's hash, so two
adapters never share a block). The values are pinned by a contract test;
changing anything here is a wire-protocol change (bump the tag and ``BLOCK_HASH_ALGORITHM``).
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

BLOCK_HASH_ALGORITHM = "sha256-64-chained-v1"
_TAG = b"quire.block.v1"
ROOT_HASH = int.from_bytes(hashlib.sha256(b"quire.block.v1.root").digest()[:8], "little")

_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")


def hash_block(parent_hash: int, token_ids: Sequence[int],
               extra_keys: Sequence[str] = ()) -> int:
    """The hash of one full block given its parent's hash."""
    h = hashlib.sha256(_TAG)
    h.update(_U64.pack(parent_hash))
    h.update(_U32.pack(len(token_ids)))
    h.update(struct.pack(f"<{len(token_ids)}I", *token_ids))
    h.update(_U32.pack(len(extra_keys)))
    for key in extra_keys:
        data = key.encode("utf-8")
        h.update(_U32.pack(len(data)))
        h.update(data)
    return int.from_bytes(h.digest()[:8], "little")


def first_block_extra_keys(cache_salt: str | None,
                           lora_name: str | None = None) -> tuple[str, ...]:
    salt = () if not cache_salt else (f"salt:{cache_salt}",)
    return salt + (() if not lora_name else (f"lora:{lora_name}",))


def hash_block_tokens(token_ids: Sequence[int], block_size: int, *,
                      cache_salt: str | None = None, parent_hash: int = ROOT_HASH,
                      start_block: int = 0, lora_name: str | None = None) -> list[int]:
    """Hashes of every full block of ``token_ids`` (a trailing partial block has none).

    ``start_block``/``parent_hash`` continue a chain already hashed up to that block.
    """
    hashes = []
    for index in range(start_block, len(token_ids) // block_size):
        block = token_ids[index * block_size:(index + 1) * block_size]
        extra = first_block_extra_keys(cache_salt, lora_name) if index == 0 else ()
        parent_hash = hash_block(parent_hash, block, extra)
        hashes.append(parent_hash)
    return hashes
