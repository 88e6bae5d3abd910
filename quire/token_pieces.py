"""What one token of a sequence is, for logprobs: the text it adds to the sequence and its raw
bytes.

A byte-level tokenizer splits a character of several UTF-8 bytes (CJK, emoji) over tokens, and
such a token alone is not text: decoded by itself it reads U+FFFD. In the logprobs of a
sequence's own tokens (the chosen ones, prompt or output) each token reads as the text it
adds there, as vLLM's detokenizer gives it: ``""`` until the character is whole, then the
whole character (so completions' ``text_offset`` indexes into ``text``). Its ``bytes`` (chat's
field) are the token's own, as OpenAI's are: a client that joins them gets the text back. The
alternatives in ``top_logprobs`` are not part of a sequence and read as decoded alone.
"""

from __future__ import annotations

import re
from functools import lru_cache

from tokenizers import Tokenizer, decoders
from tokenizers.decoders import DecodeStream

_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece's byte fallback


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's printable stand-in character for each byte, reversed: character -> byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            chars[chr(byte)] = byte
        else:
            chars[chr(256 + extra)] = byte
            extra += 1
    return chars


_BYTE_LEVEL = _byte_level_alphabet()


class TokenPieces:
    """One tokenizer's token bytes, and text steps for its sequences."""

    def __init__(self, backend: Tokenizer) -> None:
        self.backend = backend
        self._byte_level = isinstance(backend.decoder, decoders.ByteLevel)
        self._added = frozenset(backend.get_added_tokens_decoder())
        self.bytes_of = lru_cache(maxsize=65536)(self._bytes_of)

    def _bytes_of(self, token_id: int) -> bytes:
        """The token's raw bytes (its text's UTF-8 where the tokenizer stores text)."""
        piece = self.backend.id_to_token(token_id)
        if piece is None:
            return b""
        if token_id not in self._added:
            if self._byte_level and all(c in _BYTE_LEVEL for c in piece):
                return bytes(_BYTE_LEVEL[c] for c in piece)
            if match := _BYTE_TOKEN.fullmatch(piece):
                return bytes([int(match.group(1), 16)])
            if "\u2581" in piece:  # SentencePiece's space mark
                return piece.replace("\u2581", " ").encode()
        return self.backend.decode([token_id], skip_special_tokens=False).encode()

    def text_steps(self) -> TextSteps:
        return TextSteps(self.backend)


class TextSteps:
    """One sequence's tokens, each as the text it adds (``""`` while a character is partial);
    called with the sequence's tokens in order, across calls."""

    def __init__(self, backend: Tokenizer) -> None:
        self._backend = backend
        self._stream = DecodeStream(skip_special_tokens=False)

    def __call__(self, token_id: int) -> str:
        return self._stream.step(self._backend, token_id) or ""
