"""Tokenizer wrapper, incremental detokenization and stop strings.

Detokenization uses the Rust ``tokenizers.decoders.DecodeStream``: it emits text only once a
token completes a UTF-8 character, so multi-byte characters split across tokens come out whole.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path

from tokenizers.decoders import DecodeStream

from quire.tokenizer import FastTokenizer

_PRIME_TOKENS = 4  # prompt tokens replayed into the stream so the first word spaces correctly


class Tokenizer:
    """A model directory's fast tokenizer (tokenizer.json) and chat template, plus EOS ids.

    Tokenizing and chat templates go through ``quire.tokenizer.FastTokenizer``, the router's
    own (Rust ``tokenizers`` and jinja2, rendering as transformers does; the contract tests
    hold both to transformers): one implementation for both sides of the block hashes, and no
    transformers import on the engine's start (about 1 s, plus 1 s more to load its tokenizer).
    ``hf``, transformers' own tokenizer of the same directory, loads on first use: what
    ``LLM.get_tokenizer()`` returns and what xgrammar reads a vocabulary from."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        try:
            self.fast = FastTokenizer.from_dir(self.path)
        except Exception as e:  # tokenizers raises a bare Exception for a malformed file
            raise ValueError(f"tokenizer: cannot load a tokenizer from {path}: {e}") from e
        self.backend = self.fast.backend
        eos = self.fast.eos_token
        self.eos_token_ids = frozenset(_eos_ids(
            self.path, None if eos is None else self.backend.token_to_id(eos)))
        self.vocab_size = self.backend.get_vocab_size(with_added_tokens=True)
        # transformers' decode: the cleanup where the config asks for it, never on BPE (it
        # would eat real spaces) unless the config insists
        config = self.fast.config
        self._clean_up_spaces = bool(config.get("clean_up_tokenization_spaces", False)) and (
            type(self.backend.model).__name__ != "BPE" or bool(config.get(
                "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output")))
        self._hf = None
        self._hf_lock = threading.Lock()

    @property
    def hf(self):
        """transformers' tokenizer of this directory (loaded once, on first use)."""
        with self._hf_lock:
            if self._hf is None:
                from transformers import AutoTokenizer

                self._hf = AutoTokenizer.from_pretrained(str(self.path))
            return self._hf

    @property
    def chat_template(self) -> str | None:
        return self.fast.chat_template

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.fast.encode(text, add_special_tokens=add_special_tokens)

    def decode(self, token_ids, skip_special_tokens: bool = True) -> str:
        text = self.backend.decode(list(token_ids), skip_special_tokens=skip_special_tokens)
        return clean_up_tokenization(text) if self._clean_up_spaces else text

    def token_text(self, token_id: int) -> str:
        """How one token reads on its own, for logprob entries."""
        return self.backend.decode([token_id], skip_special_tokens=False)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            **kwargs) -> str:
        return self.fast.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                             **kwargs)

    def detokenizer(self, prompt_token_ids: list[int], skip_special_tokens: bool,
                    stop: list[str], include_stop_str_in_output: bool,
                    min_tokens: int = 0) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self.backend, prompt_token_ids, skip_special_tokens,
                                      stop, include_stop_str_in_output, min_tokens)


def clean_up_tokenization(text: str) -> str:
    """transformers' ``clean_up_tokenization`` (for tokenizers whose config asks for it)."""
    for spaced, tight in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"),
                          (" n't", "n't"), (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"),
                          (" 're", "'re")):
        text = text.replace(spaced, tight)
    return text


def _eos_ids(path: Path, tokenizer_eos: int | None) -> set[int]:
    ids = set() if tokenizer_eos is None else {int(tokenizer_eos)}
    gen_config = path / "generation_config.json"
    if gen_config.is_file():
        eos = json.loads(gen_config.read_text()).get("eos_token_id")
        if isinstance(eos, int):
            ids.add(eos)
        elif isinstance(eos, list):
            ids.update(int(e) for e in eos)
    return ids


class IncrementalDetokenizer:
    """Turns one sequence's new token ids into text and watches for stop strings.

    ``output_text`` may lag the tokens by up to ``max(len(stop)) - 1`` characters while a
    stop string could still be forming; ``text(finished=True)`` returns everything.
    """

    def __init__(self, backend, prompt_token_ids: list[int], skip_special_tokens: bool,
                 stop: list[str], include_stop_str_in_output: bool, min_tokens: int = 0) -> None:
        self._backend = backend
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        for token_id in prompt_token_ids[-_PRIME_TOKENS:]:
            self._stream.step(backend, token_id)
        self._stop = stop
        self._include_stop = include_stop_str_in_output
        self._hold_back = 0 if include_stop_str_in_output else max((len(s) for s in stop),
                                                                   default=1) - 1
        self._min_tokens = min_tokens  # stop strings count only after this many tokens
        self._num_tokens = 0
        self.output_text = ""
        self.stop_string: str | None = None

    def update(self, new_token_ids) -> str | None:
        """Add tokens; return the stop string if one now appears (text truncated before it)."""
        for token_id in new_token_ids:
            self._num_tokens += 1
            piece = self._stream.step(self._backend, token_id)
            if not piece:
                continue
            start = max(0, len(self.output_text) - self._longest_stop() + 1)
            self.output_text += piece
            if self._stop and self._num_tokens > self._min_tokens and self._check_stop(start):
                return self.stop_string
        return None

    @property
    def num_tokens(self) -> int:
        """Tokens taken so far (``update`` stops taking them at a stop string)."""
        return self._num_tokens

    def text(self, finished: bool) -> str:
        if finished or not self._hold_back:
            return self.output_text
        return self.output_text[:max(0, len(self.output_text) - self._hold_back)]

    def _longest_stop(self) -> int:
        return max((len(s) for s in self._stop), default=1)

    def _check_stop(self, search_from: int) -> bool:
        for stop in self._stop:
            index = self.output_text.find(stop, search_from)
            if index != -1:
                end = index + len(stop) if self._include_stop else index
                self.output_text = self.output_text[:end]
                self.stop_string = stop
                return True
        return False
