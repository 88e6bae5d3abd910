"""The engine's logprob dicts on the wire: the chosen token first, then the whole top-k."""

from __future__ import annotations

from engine_worker.outputs import CompletionOutput, Logprob, RequestOutput
from engine_worker.server.convert import response_to_proto


def _output(entry) -> RequestOutput:
    completion = CompletionOutput(index=0, text="x", token_ids=[next(iter(entry))],
                                  cumulative_logprob=None, logprobs=[entry])
    return RequestOutput(request_id="r", prompt=None, prompt_token_ids=[1], outputs=[completion],
                         finished=False)


def test_chosen_token_in_the_top_k_is_put_back_at_its_rank():
    # chosen token 7 is the 2nd most likely; the dict (vLLM's shape) holds it once
    entry = {7: Logprob(-1.0, rank=2), 3: Logprob(-0.5, rank=1), 9: Logprob(-2.0, rank=3)}
    wire = response_to_proto(_output(entry), True, num_logprobs=3).outputs[0].logprobs[0]
    assert list(wire.token_ids) == [7, 3, 7, 9]
    assert list(wire.logprobs) == [-1.0, -0.5, -1.0, -2.0] and wire.chosen_rank == 2


def test_chosen_token_outside_the_top_k_is_not_repeated():
    entry = {7: Logprob(-5.0, rank=4), 3: Logprob(-0.5, rank=1), 9: Logprob(-2.0, rank=2),
             4: Logprob(-3.0, rank=3)}
    wire = response_to_proto(_output(entry), True, num_logprobs=3).outputs[0].logprobs[0]
    assert list(wire.token_ids) == [7, 3, 9, 4] and wire.chosen_rank == 4


def test_top_one_and_zero():
    entry = {7: Logprob(-0.1, rank=1)}
    assert list(response_to_proto(_output(entry), True, num_logprobs=1)
                .outputs[0].logprobs[0].token_ids) == [7, 7]
    assert list(response_to_proto(_output(entry), True, num_logprobs=0)
                .outputs[0].logprobs[0].token_ids) == [7]
