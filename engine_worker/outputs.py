"""What the user API returns, in vLLM's shape."""

from __future__ import annotations

from dataclasses import dataclass

from quire.errors import FieldError


@dataclass(frozen=True, slots=True)
class Logprob:
    """One token's log probability, its 1-based rank in the distribution, and its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# One position: token id -> Logprob (top-k plus the chosen token).
LogprobsDict = dict[int, Logprob]


@dataclass(slots=True)
class CompletionOutput:
    """One of the ``n`` completions of a request."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[LogprobsDict] | None
    finish_reason: str | None = None  # "stop", "length", "abort" or None while running
    stop_reason: int | str | None = None  # the stop string or stop token that ended it
    # LLM.chat with tools: the calls parsed out of ``text``, in OpenAI's shape ({"id", "type":
    # "function", "function": {"name", "arguments"}}); None without tools or when it called none
    tool_calls: list[dict] | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestMetrics:
    """Timestamps (``time.monotonic()`` seconds) of a request's life."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    preempted_times: tuple[float, ...] = ()  # when each preemption sent it back to waiting

    @property
    def num_preemptions(self) -> int:
        return len(self.preempted_times)

    @property
    def time_to_first_token_s(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time


@dataclass(slots=True)
class RequestOutput:
    """The state of one request as the user sees it."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    prompt_logprobs: list[LogprobsDict | None] | None = None
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None
    # set when it ended aborted because of its own input (its constraints allowed no token):
    # the offending field and why; a server answers it as the client's error
    error: FieldError | None = None


@dataclass(frozen=True, slots=True)
class PoolingOutput:
    """A pooled prompt: ``data`` is the vector (plain floats)."""

    data: list[float]


@dataclass(slots=True)
class PoolingRequestOutput:
    """The result of a pooling request, as the engine's ``step()`` hands it out (vLLM's
    shape). ``outputs`` is None when the request was aborted before it finished."""

    request_id: str
    outputs: PoolingOutput | None
    prompt_token_ids: list[int]
    finished: bool = True
    num_cached_tokens: int = 0


@dataclass(frozen=True, slots=True)
class EmbeddingOutput:
    """One embedding (vLLM's ``EmbeddingOutput``)."""

    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass(slots=True)
class EmbeddingRequestOutput:
    """What ``LLM.embed`` returns per prompt (vLLM's ``EmbeddingRequestOutput``)."""

    request_id: str
    outputs: EmbeddingOutput
    prompt_token_ids: list[int]
    finished: bool = True

    @classmethod
    def from_base(cls, output: PoolingRequestOutput) -> EmbeddingRequestOutput:
        return cls(request_id=output.request_id,
                   outputs=EmbeddingOutput(list(output.outputs.data)),
                   prompt_token_ids=output.prompt_token_ids, finished=output.finished)
