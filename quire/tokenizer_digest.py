"""Tokenizer identity shared by engines and routers: equal digests tokenize identically."""

from __future__ import annotations

import hashlib
from pathlib import Path

# What a router needs to tokenize and render chat templates as an engine does; an engine's
# GetTokenizer sends these files where the model has them.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                   "special_tokens_map.json")


def tokenizer_digest(tokenizer_json: bytes) -> str:
    """SHA-256 (hex) of a tokenizer.json's bytes, as GetModelInfo.tokenizer_digest reports it."""
    return hashlib.sha256(tokenizer_json).hexdigest()


def tokenizer_dir_digest(model_dir: Path) -> str:
    """The digest of ``model_dir/tokenizer.json``, or "" when the directory has none."""
    path = Path(model_dir) / "tokenizer.json"
    return tokenizer_digest(path.read_bytes()) if path.is_file() else ""
