"""Prompt-lookup (n-gram) proposals: continue the request as it went on after the last earlier
place where its latest tokens appeared.

The request's tokens ``t[0..L)`` end with the n-gram ``t[L-n..L)``. Among earlier positions
``j`` whose n tokens ending at ``j`` equal that n-gram, the longest match wins (n from
``prompt_lookup_max`` down to ``prompt_lookup_min``), the most recent one among equals that
has k tokens after it; the draft is ``t[j+1 .. j+1+k)``. Matching is vectorised: one
comparison of the whole history per n-gram length, so a proposal costs O(L * prompt_lookup_max)
numpy work and no Python loop over the history.
"""

from __future__ import annotations

import numpy as np


class NgramProposer:
    """Stateless: proposes from the token history it is handed."""

    def __init__(self, prompt_lookup_max: int, prompt_lookup_min: int) -> None:
        self.max_n = prompt_lookup_max
        self.min_n = prompt_lookup_min

    def propose(self, req_id: str, tokens: np.ndarray, max_num_tokens: int) -> tuple[int, ...]:
        """At most ``max_num_tokens`` draft tokens following ``tokens`` ([L] int64, the
        request's prompt then output); empty when no n-gram of the allowed lengths recurs."""
        num_tokens = len(tokens)
        if max_num_tokens <= 0 or num_tokens < self.min_n + 1:
            return ()
        # candidate match ends j in [0, L - 2]: each has at least one token after it
        ends = num_tokens - 1
        running = np.ones(ends, dtype=bool)
        lengths = np.zeros(ends, dtype=np.int32)
        for back in range(min(self.max_n, num_tokens - 1)):
            # t[j - back] == t[L - 1 - back] for the windows still matching
            shifted = np.zeros(ends, dtype=bool)
            if back < ends:
                shifted[back:] = tokens[:ends - back] == tokens[num_tokens - 1 - back]
            running &= shifted
            if not running.any():
                break
            lengths += running
        best = int(lengths.max(initial=0))
        if best < self.min_n:
            return ()
        # the most recent longest match with a full draft after it, else the earliest (a
        # token repeating itself matches just before the end, with one token after it)
        matches = np.flatnonzero(lengths == best)
        full = matches[matches <= num_tokens - 1 - max_num_tokens]
        j = int(full[-1] if len(full) else matches[0])
        return tuple(int(t) for t in tokens[j + 1:j + 1 + max_num_tokens])

    def forget(self, req_id: str, output_token_ids=()) -> None:
        """Nothing is kept per request."""
