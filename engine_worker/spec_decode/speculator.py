"""How many draft tokens each request verifies in a step, and the acceptance counts.

The scheduler asks ``propose`` for a request in its decode phase and budgets the drafts
it gets as extra tokens of the request's step; after the step it reports how many were
accepted (``record``). Two rules keep speculation from costing more than it saves:

* **Per request (adaptivity).** A request starts at ``num_speculative_tokens``. After a step
  with ``a`` of ``d`` drafts accepted its next length is ``a + 1`` when a draft was rejected
  (so a request whose proposals keep failing verifies one draft, not k), and one more (up to k)
  when all were accepted. A request whose single draft is rejected again backs off: it
  proposes nothing for 1, 2, 4, ... up to ``MAX_BACKOFF_STEPS`` steps, reset by the next
  acceptance. On text that never repeats, the cost is then one extra verified token every
  ``MAX_BACKOFF_STEPS`` steps.
* **Per step (batch rule).** A step verifies drafts only while at most
  ``disable_by_batch_size`` requests are running (vLLM's field), and all its drafts together
  stay within ``step_token_limit`` less the number of running requests. A step is cheap to
  widen only while it is bound by reading the weights: measured on a 2-core Zen 3 with the
  embedded model (bf16, one thread, 550 tokens of context), 5 tokens in one step cost 1.3-1.5x
  one token, 9 tokens 2.5-3.5x, 17 tokens 4-5x, 33 tokens ~8x. Past ~8 tokens a draft costs
  about what a request's own token costs and a rejected one is pure loss, so on a CPU the
  limit is 8 tokens a step (one request verifies up to 7 drafts; two share 6; four share 4;
  five or more verify none). A GPU stays weight-bound far longer (``STEP_TOKEN_LIMITS``).
  Weights kept as GGUF blocks on a CPU (the embedded model's default) keep the same limit:
  ``csrc/cpu/quant_linear.cpp`` multiplies up to 8 rows (``kDecodeRows``) on the blocks as
  stored, and on AVX2 a 9th row switches a step to its prefill path, which de-quantizes every
  weight first (when that limit was 4, one request with 4 drafts decoded several times slower
  than without speculation, and the quantized limit was 4 tokens a step); with VNNI, bf16
  steps stay on the int8 kernel up to 512 rows, where a row costs what it costs in bf16.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from engine_worker.spec_decode.config import SpeculativeConfig
from engine_worker.spec_decode.stats import SpecDecodingCounter, SpecDecodingStats

MAX_BACKOFF_STEPS = 32
# device type -> the most tokens (requests' own plus drafts) a step with drafts may hold
STEP_TOKEN_LIMITS = {"cpu": 8, "cuda": 256}


def step_token_limit(device_type: str) -> int:
    """The most tokens a step with drafts may hold on ``device_type`` (module docstring)."""
    return STEP_TOKEN_LIMITS.get(device_type, STEP_TOKEN_LIMITS["cpu"])


class Proposer(Protocol):
    def propose(self, req_id: str, tokens: np.ndarray, max_num_tokens: int
                ) -> tuple[int, ...]: ...

    def forget(self, req_id: str, output_token_ids: list[int]) -> None: ...


@dataclass(slots=True)
class _RequestSpec:
    """One request's speculation state: its token history (grown, never rebuilt) and its
    adaptive proposal length."""

    num_tokens_limit: int  # current proposal length
    tokens: np.ndarray = field(default_factory=lambda: np.zeros(64, dtype=np.int64))
    num_tokens: int = 0
    backoff: int = 0  # steps to wait after consecutive rejections (0: none)
    skip: int = 0  # steps left to wait

    def sync(self, prompt: list[int], output: list[int]) -> np.ndarray:
        total = len(prompt) + len(output)
        if total < self.num_tokens:  # the history was rewritten (cannot happen today)
            self.num_tokens = 0
        if total > len(self.tokens):
            grown = np.zeros(max(total, 2 * len(self.tokens)), dtype=np.int64)
            grown[:self.num_tokens] = self.tokens[:self.num_tokens]
            self.tokens = grown
        if self.num_tokens < len(prompt):
            self.tokens[self.num_tokens:len(prompt)] = prompt[self.num_tokens:]
            self.num_tokens = len(prompt)
        start = self.num_tokens - len(prompt)
        if start < len(output):
            self.tokens[self.num_tokens:total] = output[start:]
            self.num_tokens = total
        return self.tokens[:total]


class Speculator:
    """Owned by the scheduler: proposals per request, the adaptive rules, the counts."""

    def __init__(self, config: SpeculativeConfig, proposer: Proposer,
                 step_token_limit: int = STEP_TOKEN_LIMITS["cpu"]) -> None:
        self.config = config
        self.proposer = proposer
        self.step_token_limit = step_token_limit
        self.max_num_tokens = config.num_speculative_tokens
        self._requests: dict[str, _RequestSpec] = {}
        self._counter = SpecDecodingCounter(config.num_speculative_tokens)

    def step_draft_budget(self, num_running: int) -> int:
        """The batch rule (module docstring): how many draft tokens this step may verify in
        all, with ``num_running`` requests running (0: none)."""
        if num_running > self.config.disable_by_batch_size:
            return 0
        return max(0, self.step_token_limit - num_running)

    def propose(self, req_id: str, prompt: list[int], output: list[int], room: int
                ) -> tuple[int, ...]:
        """Draft tokens to verify after the request's last token this step: at most its
        current length and ``room`` (what its budget, max_tokens and max_model_len leave)."""
        spec = self._requests.get(req_id)
        if spec is None:
            spec = self._requests[req_id] = _RequestSpec(self.max_num_tokens)
        if spec.skip > 0:
            spec.skip -= 1
            return ()
        limit = min(room, spec.num_tokens_limit)
        if limit <= 0:
            return ()
        return self.proposer.propose(req_id, spec.sync(prompt, output), limit)

    def record(self, req_id: str, num_draft_tokens: int, num_accepted: int) -> None:
        """A verified draft: adapt the request's length and count it."""
        self._counter.record(num_draft_tokens, num_accepted)
        spec = self._requests.get(req_id)
        if spec is None:
            return
        if num_accepted == num_draft_tokens:
            spec.num_tokens_limit = min(self.max_num_tokens, spec.num_tokens_limit + 1)
            spec.backoff = 0
        elif num_accepted > 0:
            spec.num_tokens_limit = num_accepted + 1
            spec.backoff = 0
        else:
            if spec.num_tokens_limit == 1:  # failed again at one draft: wait before retrying
                spec.backoff = min(MAX_BACKOFF_STEPS, max(1, 2 * spec.backoff))
                spec.skip = spec.backoff
            spec.num_tokens_limit = 1

    def forget(self, req_id: str, output_token_ids: list[int]) -> None:
        """The request finished with these output tokens: drop its state (a proposer may
        keep the output to propose from for others)."""
        self._requests.pop(req_id, None)
        self.proposer.forget(req_id, output_token_ids)

    def stats(self) -> SpecDecodingStats:
        return self._counter.snapshot()
