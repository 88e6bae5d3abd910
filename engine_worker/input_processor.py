"""Validate and tokenize a request before it reaches the scheduler.

Everything that can be known to fail fails here, with a ValueError naming the field, so a bad
request never occupies the queue.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Union

from quire.errors import FieldError

from engine_worker.pooler import POOLING_METHODS
from engine_worker.pooler_config import PoolerConfig
from engine_worker.pooling_params import PoolingParams
from engine_worker.request import Request
from engine_worker.sampling_params import SamplingParams, bad_words_token_ids
from engine_worker.tokenizer import Tokenizer
from quire.limits import check_cache_salt, check_n
from quire.structured_outputs import check_logit_bias
from quire.list_limits import MAX_STOP_TOKEN_IDS, check_length, check_token_ids

# A prompt: text, token ids, or vLLM's dict forms {"prompt": ...} / {"prompt_token_ids": ...}.
PromptType = Union[str, list[int], dict]


class DefaultMaxTokens(int):
    """A ``max_tokens`` the server chose because the client set none (its output cap): cut to
    the room the prompt leaves like any, and never refused for exceeding max_model_len (a
    client's own value past max_model_len is refused, as vLLM 0.32 refuses it)."""

    __slots__ = ()


@dataclass(frozen=True, slots=True)
class ProcessedRequest:
    prompt_text: str | None
    prompt_token_ids: list[int]
    request: Request  # the first sample; it forks into the others
    sample_ids: tuple[str, ...]  # request ids of all n samples


def child_request_id(request_id: str, index: int, n: int) -> str:
    return request_id if n == 1 else f"{index}_{request_id}"


class InputProcessor:
    def __init__(self, tokenizer: Tokenizer, *, max_model_len: int, kv_capacity_tokens: int,
                 vocab_size: int, max_num_seqs: int,
                 pooler_config: PoolerConfig = PoolerConfig("LAST", True),
                 runner: str = "generate") -> None:
        """``pooler_config`` (resolved) decides how pooling requests read the prefix cache
        and whether they are normalised by default; ``runner`` "pooling" refuses generation."""
        self.pooler_config = pooler_config
        self.runner = runner
        self.max_num_seqs = max_num_seqs
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.kv_capacity_tokens = kv_capacity_tokens
        self.vocab_size = vocab_size

    def process(self, request_id: str, prompt: PromptType,
                params: SamplingParams | PoolingParams, arrival_time: float, priority: int,
                cache_salt: str | None = None) -> ProcessedRequest:
        if not isinstance(request_id, str) or not request_id:
            raise FieldError("request_id", "must be a non-empty string")
        if isinstance(params, PoolingParams):
            return self._process_pooling(request_id, prompt, params, arrival_time, priority,
                                         cache_salt)
        if not isinstance(params, SamplingParams):
            raise FieldError("sampling_params", "must be a SamplingParams (or PoolingParams)")
        if self.runner == "pooling":
            raise FieldError("runner", "this engine runs with --runner pooling: it serves "
                             "embeddings only, not generation (start one with --runner "
                             "generate to generate)")
        # the samples of one request run together: at most max_num_seqs of them
        check_n(params.n, self.max_num_seqs)
        cache_salt = self._check_common(prompt, priority, cache_salt)
        check_length(params.stop_token_ids, MAX_STOP_TOKEN_IDS, "stop_token_ids",
                     "stop token ids")
        check_token_ids(params.stop_token_ids, self.vocab_size, "stop_token_ids")
        if params.logit_bias:
            check_logit_bias(params.logit_bias, self.vocab_size)
        if params.allowed_token_ids is not None:
            check_token_ids(params.allowed_token_ids, self.vocab_size, "allowed_token_ids")
        if params.bad_words:
            banned = bad_words_token_ids(params.bad_words, partial(
                self.tokenizer.encode, add_special_tokens=False))
            check_token_ids([t for word in banned for t in word], self.vocab_size, "bad_words")
            params = params.clone(bad_words_token_ids=banned)
        text, token_ids = self._tokenize(prompt)
        max_tokens = self._max_tokens(len(token_ids), params)
        # n > 1 is one request until its prompt is computed; then it forks into the samples,
        # which share the prompt's KV blocks. Sample i draws from seed + i.
        # Each sample gets its own copy, so a caller mutating its SamplingParams later
        # changes nothing in flight.
        samples = [(child_request_id(request_id, i, params.n),
                    params.clone() if params.n == 1 else params.clone(
                        n=1, seed=None if params.seed is None else params.seed + i))
                   for i in range(params.n)]
        (first_id, first_params), others = samples[0], tuple(samples[1:])
        request = Request(first_id, list(token_ids), first_params, self.tokenizer.eos_token_ids,
                          max_tokens, arrival_time=arrival_time, priority=priority,
                          cache_salt=cache_salt, fork_children=others)
        return ProcessedRequest(text, token_ids, request, tuple(s[0] for s in samples))

    def _check_common(self, prompt: PromptType, priority, cache_salt: str | None) -> str | None:
        """Priority and cache salt (a dict prompt's own salt wins); returns the salt."""
        if not isinstance(priority, int):
            raise FieldError("priority", f"must be an integer, got {priority!r}")
        if isinstance(prompt, dict) and prompt.get("cache_salt") is not None:
            cache_salt = prompt["cache_salt"]
        if cache_salt is not None:
            check_cache_salt(cache_salt)
        return cache_salt

    def _process_pooling(self, request_id: str, prompt: PromptType, params: PoolingParams,
                         arrival_time: float, priority: int,
                         cache_salt: str | None) -> ProcessedRequest:
        """A pooling request: its whole prompt must fit max_model_len and the KV cache (it
        generates nothing, so no room is kept for output)."""
        cache_salt = self._check_common(prompt, priority, cache_salt)
        text, token_ids = self._tokenize(prompt)
        keep = params.truncate_prompt_tokens
        if keep is not None:
            keep = self.max_model_len if keep == -1 else keep
            if len(token_ids) > keep:  # the text no longer matches
                text, token_ids = None, list(token_ids[-keep:] if params.truncation_side ==
                                             "left" else token_ids[:keep])
        num_tokens = len(token_ids)
        if num_tokens > self.max_model_len:
            raise FieldError("prompt", f"{num_tokens} tokens, more than this model's "
                             f"max_model_len={self.max_model_len}")
        if num_tokens > self.kv_capacity_tokens:
            raise FieldError("prompt", f"{num_tokens} tokens, more than the whole KV cache "
                             f"holds ({self.kv_capacity_tokens})")
        config = self.pooler_config
        params = params.clone(normalize=config.normalize if params.normalize is None
                              else params.normalize)
        reads_cache = not POOLING_METHODS[config.pooling_type].needs_every_position
        request = Request(request_id, list(token_ids), None, self.tokenizer.eos_token_ids, 0,
                          arrival_time=arrival_time, priority=priority, cache_salt=cache_salt,
                          pooling_params=params, reads_prefix_cache=reads_cache)
        return ProcessedRequest(text, token_ids, request, (request_id,))

    def tokenize(self, prompt: PromptType) -> list[int]:
        """The prompt's token ids, validated (ValueError naming the field otherwise)."""
        return self._tokenize(prompt)[1]

    def _tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                prompt = prompt["prompt_token_ids"]
            elif "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise FieldError("prompt", "a dict prompt needs 'prompt' or 'prompt_token_ids'")
        if isinstance(prompt, str):
            if not prompt:
                raise FieldError("prompt", "must not be empty")
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, (list, tuple)):
            if not prompt:
                raise FieldError("prompt_token_ids", "must not be empty")
            check_token_ids(prompt, self.vocab_size, "prompt_token_ids")
            return None, list(prompt)
        raise FieldError("prompt", f"must be a string or a list of token ids, "
                         f"got {type(prompt).__name__}")

    def _max_tokens(self, num_prompt_tokens: int, params: SamplingParams) -> int:
        if num_prompt_tokens >= self.max_model_len:
            raise FieldError("prompt", f"{num_prompt_tokens} tokens leave no room to generate "
                             f"within max_model_len={self.max_model_len}")
        requested = params.max_tokens
        if requested is not None and not isinstance(requested, DefaultMaxTokens) and \
                requested > self.max_model_len:
            raise FieldError("max_tokens", f"max_tokens={requested} cannot be greater than "
                             f"max_model_len={self.max_model_len}; request fewer output tokens")
        room = self.max_model_len - num_prompt_tokens
        # what the prompt leaves, as vLLM 0.32's server cuts it (get_max_tokens): the
        # completion then ends with finish_reason "length"
        max_tokens = room if requested is None else min(requested, room)
        if requested is None or isinstance(requested, DefaultMaxTokens):
            # the server chose it (no cap: the model's length): cut to what the whole KV
            # cache holds too, where that is less, rather than refuse what the client never
            # asked for (the last sampled token is never cached, hence the + 1)
            max_tokens = min(max_tokens, max(1, self.kv_capacity_tokens - num_prompt_tokens + 1))
        # The cache never holds the last sampled token, hence the - 1.
        peak = num_prompt_tokens + max_tokens - 1
        if peak > self.kv_capacity_tokens:
            field_name = "prompt" if num_prompt_tokens > self.kv_capacity_tokens else "max_tokens"
            raise FieldError(field_name, f"the request needs up to {peak} tokens of KV cache "
                             f"but the whole cache holds {self.kv_capacity_tokens}")
        return max_tokens

