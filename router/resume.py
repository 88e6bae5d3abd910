"""Moving a stream whose engine failed mid-way onto another engine (request migration).

Once a request has streamed tokens, a retry from scratch would show the client a second,
different answer. Instead the router asks another engine to go on from where the stream broke:
the prompt plus the tokens already relayed, and only what is left of ``max_tokens`` and
``min_tokens`` (Dynamo calls this migration). The client sees one unbroken stream.

This is exact only where the rest of the completion depends on the tokens so far and nothing
else the failed engine held. Refused (the failure reaches the client, as before) for:
- ``n`` > 1: several completions in one stream;
- structured outputs: the grammar's state over the tokens so far lives in the engine;
- presence and frequency penalties: they count generated tokens only, and the continuation
  would see those tokens as prompt;
- bad words: a multi-token bad word is matched across generated tokens only;
- stop strings: the engine holds back text while one could be forming, and the relayed text
  would lose what it held.
A seeded request goes on with the same seed from a different place, so its continuation is not
the one the failed engine would have drawn (greedy ones are the same, up to numerics).
"""

from __future__ import annotations

from collections.abc import Sequence

from quire.v1 import engine_pb2 as pb


def resume_refusal(request: pb.GenerateRequest) -> str | None:
    """Why a failed stream of ``request`` cannot go on elsewhere; None when it can."""
    s = request.sampling
    if s.n > 1:
        return "n > 1"
    if s.HasField("structured_outputs") and s.structured_outputs.WhichOneof("kind"):
        return "structured outputs"
    if s.presence_penalty or s.frequency_penalty:
        return "presence or frequency penalty"
    if s.bad_words:
        return "bad words"
    if s.stop:
        return "stop strings"
    return None


def max_tokens_left(request: pb.GenerateRequest, generated: Sequence[int],
                    default_max_tokens: int = 0) -> int | None:
    """What is left of the request's ``max_tokens`` (unset: ``default_max_tokens``, the
    router's cap, 0 for none) after ``generated``; None when nothing but the model's length
    bounds it (a longer prompt leaves as much less room)."""
    s = request.sampling
    limit = s.max_tokens if s.HasField("max_tokens") else default_max_tokens
    return max(limit - len(generated), 0) if limit else None


def continuation(request: pb.GenerateRequest, generated: Sequence[int],
                 default_max_tokens: int = 0) -> pb.GenerateRequest:
    """``request`` (a token-id prompt) going on after ``generated``: those tokens become
    prompt, the token budgets shrink by as many (``max_tokens_left``), and the prompt's
    logprobs (sent with the first message) are not asked for again."""
    out = pb.GenerateRequest()
    out.CopyFrom(request)
    out.token_ids.ids.extend(generated)
    s = out.sampling
    left = max_tokens_left(request, generated, default_max_tokens)
    if left is not None:
        s.max_tokens = left
    if s.HasField("min_tokens"):
        s.min_tokens = max(s.min_tokens - len(generated), 0)
    s.ClearField("prompt_logprobs")
    return out


def last_message(request_id: str, prompt_tokens: int, generated: int) -> pb.GenerateResponse:
    """The end of a stream whose tokens were all relayed before its engine failed."""
    return pb.GenerateResponse(
        request_id=request_id, finished=True,
        outputs=[pb.CompletionDelta(index=0, finish_reason=pb.FINISH_REASON_LENGTH)],
        usage=pb.Usage(prompt_tokens=prompt_tokens, completion_tokens=generated))


def as_continued(message: pb.GenerateResponse, prompt_tokens: int,
                 earlier: int) -> pb.GenerateResponse:
    """A message of the continuation as the client's stream goes on: without the (longer)
    prompt's ids and logprobs, and with usage counted over the whole request: the original
    prompt, and the ``earlier`` tokens relayed before the move among the completion's."""
    if message.prompt_token_ids:
        del message.prompt_token_ids[:]
    if message.prompt_logprobs:
        del message.prompt_logprobs[:]
    if message.HasField("usage"):
        u = message.usage
        u.cached_tokens = min(u.cached_tokens, prompt_tokens)
        u.completion_tokens += earlier
        u.prompt_tokens = prompt_tokens
    return message
