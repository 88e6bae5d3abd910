"""Tokenizer wrapper, incremental detokenization and stop strings.

Detokenization uses the Rust ``tokenizers.decoders.DecodeStream``: it emits text only once a
token completes a UTF-8 character, so multi-byte characters split across tokens come out whole.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers.decoders import DecodeStream

_PRIME_TOKENS = 4  # prompt tokens replayed into the stream so the first word spaces correctly


class Tokenizer:
    """A Hugging Face fast tokenizer loaded from a local directory, plus EOS ids."""

    def __init__(self, path: Path) -> None:
        from transformers import AutoTokenizer

        try:
            self.hf = AutoTokenizer.from_pretrained(str(path))
        except (OSError, ValueError) as e:
            raise ValueError(f"tokenizer: cannot load a tokenizer from {path}: {e}") from e
        if not getattr(self.hf, "is_fast", False):
            raise ValueError(f"tokenizer: {path} has no fast (tokenizer.json) tokenizer")
        self.backend = self.hf.backend_tokenizer
        self.eos_token_ids = frozenset(_eos_ids(path, self.hf.eos_token_id))
        self.vocab_size = len(self.hf)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.hf.encode(text, add_special_tokens=add_special_tokens)

    def decode(self, token_ids, skip_special_tokens: bool = True) -> str:
        return self.hf.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def token_text(self, token_id: int) -> str:
        """How one token reads on its own, for logprob entries."""
        return self.backend.decode([token_id], skip_special_tokens=False)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            **kwargs) -> str:
        if not getattr(self.hf, "chat_template", None):
            raise ValueError("messages: this model's tokenizer has no chat template")
        return self.hf.apply_chat_template(messages, tokenize=False,
                                           add_generation_prompt=add_generation_prompt, **kwargs)

    def detokenizer(self, prompt_token_ids: list[int], skip_special_tokens: bool,
                    stop: list[str], include_stop_str_in_output: bool,
                    min_tokens: int = 0) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self.backend, prompt_token_ids, skip_special_tokens,
                                      stop, include_stop_str_in_output, min_tokens)


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
