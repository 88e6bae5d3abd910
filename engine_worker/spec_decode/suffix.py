"""Suffix proposals (after SuffixDecoding, Oliaro et al. 2024): continue the request as the
longest earlier occurrence of its latest tokens continued, found in its own context or in the
outputs of requests that finished recently.

Each request keeps a suffix automaton of its own tokens, grown by one token at a time (amortised
O(1)); the longest suffix of its tokens that occurred before is the suffix link of the
automaton's last state, and the first place it ended (``first_end``) is where its continuation
starts: a proposal costs O(1) however long the context. Recent outputs are one more automaton
over their concatenation (separated by tokens no vocabulary has), rebuilt from the newest
outputs when it outgrows ``max_corpus_tokens``; the request's last ``max_depth`` tokens are
matched there, longest first. The longer of the two matches wins (the request's own on a tie);
matches shorter than ``min_match`` propose nothing.
"""

from __future__ import annotations

from collections import deque

import numpy as np


class SuffixAutomaton:
    """The minimal automaton of every substring of a token sequence, built online."""

    __slots__ = ("next", "link", "length", "first_end", "last", "tokens")

    def __init__(self) -> None:
        self.next: list[dict[int, int]] = [{}]
        self.link = [-1]
        self.length = [0]
        self.first_end = [-1]  # end position of a state's first occurrence
        self.last = 0
        self.tokens: list[int] = []

    def extend(self, token: int) -> None:
        pos = len(self.tokens)
        self.tokens.append(token)
        cur = self._new_state(self.length[self.last] + 1, pos)
        p = self.last
        while p != -1 and token not in self.next[p]:
            self.next[p][token] = cur
            p = self.link[p]
        if p == -1:
            self.link[cur] = 0
        else:
            q = self.next[p][token]
            if self.length[p] + 1 == self.length[q]:
                self.link[cur] = q
            else:
                clone = self._new_state(self.length[p] + 1, self.first_end[q])
                self.next[clone] = dict(self.next[q])
                self.link[clone] = self.link[q]
                while p != -1 and self.next[p].get(token) == q:
                    self.next[p][token] = clone
                    p = self.link[p]
                self.link[q] = self.link[cur] = clone
        self.last = cur

    def _new_state(self, length: int, first_end: int) -> int:
        self.next.append({})
        self.link.append(-1)
        self.length.append(length)
        self.first_end.append(first_end)
        return len(self.length) - 1

    def longest_repeat(self) -> tuple[int, int]:
        """(length, end) of the longest suffix of the tokens that also ends earlier, at
        ``end`` (its first occurrence); (0, -1) when none."""
        link = self.link[self.last]
        if link <= 0:
            return 0, -1
        return self.length[link], self.first_end[link]

    def find(self, pattern) -> int:
        """End position of the first occurrence of ``pattern``, or -1."""
        state = 0
        for token in pattern:
            state = self.next[state].get(token, -1)
            if state == -1:
                return -1
        return self.first_end[state]


class SuffixProposer:
    """Per-request automata plus one over recent outputs of finished requests."""

    def __init__(self, *, min_match: int = 2, max_depth: int = 24, max_outputs: int = 1000,
                 max_corpus_tokens: int = 65536) -> None:
        self.min_match = min_match
        self.max_depth = max_depth
        self.max_outputs = max_outputs
        self.max_corpus_tokens = max_corpus_tokens
        self._own: dict[str, SuffixAutomaton] = {}
        self._outputs: deque[tuple[int, ...]] = deque()  # newest last
        self._corpus = SuffixAutomaton()
        self._separator = -1  # separators are negative: no vocabulary has them

    def propose(self, req_id: str, tokens: np.ndarray, max_num_tokens: int) -> tuple[int, ...]:
        own = self._own.get(req_id)
        if own is None or len(own.tokens) > len(tokens):
            own = self._own[req_id] = SuffixAutomaton()
        for token in tokens[len(own.tokens):].tolist():
            own.extend(token)
        length, end = own.longest_repeat()
        best = (length, own.tokens, end) if length >= self.min_match else (0, None, -1)
        if self._corpus.tokens:
            best = max(best, self._corpus_match(own.tokens), key=lambda m: m[0])
        length, source, end = best
        if length < self.min_match or source is None:
            return ()
        draft = []
        for token in source[end + 1:end + 1 + max_num_tokens]:
            if token < 0:  # the end of that output
                break
            draft.append(token)
        return tuple(draft)

    def _corpus_match(self, tokens: list[int]):
        """The longest suffix of ``tokens`` (up to max_depth) found in recent outputs."""
        for n in range(min(self.max_depth, len(tokens)), self.min_match - 1, -1):
            end = self._corpus.find(tokens[len(tokens) - n:])
            if end != -1 and end + 1 < len(self._corpus.tokens):
                return n, self._corpus.tokens, end
        return 0, None, -1

    def forget(self, req_id: str, output_token_ids=()) -> None:
        """The request finished: drop its automaton; its output joins the recent outputs."""
        self._own.pop(req_id, None)
        if len(output_token_ids) == 0:
            return
        output = tuple(int(t) for t in output_token_ids)
        self._outputs.append(output)
        if len(self._corpus.tokens) + len(output) + 1 > self.max_corpus_tokens or \
                len(self._outputs) > self.max_outputs:
            self._rebuild()
        else:
            self._add(output)

    def _add(self, output: tuple[int, ...]) -> None:
        for token in output:
            self._corpus.extend(token)
        self._corpus.extend(self._separator)
        self._separator -= 1

    def _rebuild(self) -> None:
        """Keep the newest outputs that fit in half the budget, in a fresh automaton."""
        kept, total = [], 0
        while self._outputs and len(kept) < max(1, self.max_outputs // 2) and \
                total + len(self._outputs[-1]) + 1 <= self.max_corpus_tokens // 2:
            kept.append(self._outputs.pop())
            total += len(kept[-1]) + 1
        self._outputs = deque(reversed(kept))
        self._corpus = SuffixAutomaton()
        self._separator = -1
        for output in self._outputs:
            self._add(output)
