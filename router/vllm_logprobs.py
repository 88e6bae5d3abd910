"""Logprobs from a vLLM server's completions stream, as a Quire engine puts them on the wire
(``PositionLogprobs``: the chosen token, then the top k by id).

vLLM's completions logprobs name tokens by their text; asked with
``return_tokens_as_token_ids`` they are ``token_id:<id>``, which is what the router sends.
Each position's ``top_logprobs`` holds the chosen token and the top k (k + 1 entries, or k
when the chosen one is among them); the chosen token's rank is not sent, so beyond the top k
it is written as unknown (0). vLLM refuses ``prompt_logprobs`` on a stream, so a request that
wants the prompt's logprobs is sent with ``echo``: the first chunk of each choice then starts
with the prompt's positions (the first has none), which are split off here, and its text
leaves the prompt out (``return_token_ids`` blanks it).
"""

from __future__ import annotations

from quire.v1 import engine_pb2 as pb

_PREFIX = "token_id:"


def logprobs_fields(sampling: pb.SamplingOptions) -> dict:
    """The completions body's fields that ask vLLM for the logprobs ``sampling`` wants."""
    want = sampling.logprobs if sampling.HasField("logprobs") else None
    prompt = sampling.prompt_logprobs if sampling.HasField("prompt_logprobs") else None
    if want is None and prompt is None:
        return {}
    return {"logprobs": max(want or 0, prompt or 0), "return_tokens_as_token_ids": True} | (
        {} if prompt is None else {"echo": True})


def _token_id(token: str) -> int:
    if not token.startswith(_PREFIX):
        raise ValueError(f"vLLM sent a logprobs token without its id: {token[:40]!r}")
    return int(token[len(_PREFIX):])


def _position(token, logprob, top, k: int) -> pb.PositionLogprobs:
    if token is None or logprob is None:  # the prompt's first position
        return pb.PositionLogprobs()
    chosen = _token_id(token)
    ranked = sorted(((_token_id(t), lp) for t, lp in (top or {}).items()),
                    key=lambda item: -item[1])[:k]
    rank = next((i + 1 for i, (tid, _) in enumerate(ranked) if tid == chosen), 0)
    return pb.PositionLogprobs(token_ids=[chosen] + [tid for tid, _ in ranked],
                               logprobs=[logprob] + [lp for _, lp in ranked], chosen_rank=rank)


class LogprobsReader:
    """One stream's logprobs: ``read(choice, delta, message)`` fills ``delta.logprobs`` (and,
    from each choice's first chunk of an echoed request, ``message.prompt_logprobs``)."""

    def __init__(self, sampling: pb.SamplingOptions, num_prompt_tokens: int) -> None:
        self.want = sampling.logprobs if sampling.HasField("logprobs") else None
        self.prompt_k = sampling.prompt_logprobs if sampling.HasField("prompt_logprobs") \
            else None
        self.num_prompt_tokens = num_prompt_tokens
        self._echoed: set[int] = set()  # choices whose prompt positions came
        self._prompt_sent = False  # the prompt's logprobs went out (once per stream)

    def read(self, choice: dict, delta: pb.CompletionDelta,
             message: pb.GenerateResponse) -> None:
        body = choice.get("logprobs")
        if not body or (self.want is None and self.prompt_k is None):
            return
        positions = list(zip(body.get("tokens") or (), body.get("token_logprobs") or (),
                             body.get("top_logprobs") or ()))
        if self.prompt_k is not None and delta.index not in self._echoed:
            self._echoed.add(delta.index)
            prompt, positions = (positions[:self.num_prompt_tokens],
                                 positions[self.num_prompt_tokens:])
            if not self._prompt_sent:  # every choice echoes the same prompt
                self._prompt_sent = True
                message.prompt_logprobs.extend(_position(*p, self.prompt_k) for p in prompt)
        if self.want is not None:
            delta.logprobs.extend(_position(*p, self.want) for p in positions)
