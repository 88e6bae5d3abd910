"""Tokenizer identity shared by engines and routers: equal digests tokenize identically."""

from __future__ import annotations

import hashlib
from pathlib import Path


def tokenizer_digest(tokenizer_json: bytes) -> str:
    """SHA-256 (hex) of a tokenizer.json's bytes, as GetModelInfo.tokenizer_digest reports it."""
    return hashlib.sha256(tokenizer_json).hexdigest()


def tokenizer_dir_digest(model_dir: Path) -> str:
    """The digest of ``model_dir/tokenizer.json``, or "" when the directory has none."""
    path = Path(model_dir) / "tokenizer.json"
    return tokenizer_digest(path.read_bytes()) if path.is_file() else ""
