"""Beam search over the engine, in vLLM's shape (``llm.beam_search(prompts, params)``).

Each step asks the engine for the top ``2 * beam_width`` next tokens of every live beam (one
token, greedy, with logprobs), then keeps the ``beam_width`` best continuations by cumulative
log probability, as Hugging Face's beam search does. Beams share their KV blocks through the
prefix cache: a beam's request finds every full block of its history already cached, so a step
computes only the tokens past its last full block.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class BeamSearchParams:
    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    length_penalty: float = 1.0
    structured_outputs: object = None  # refused: beams are ranked by logprob, not by grammar

    def __post_init__(self) -> None:
        if self.structured_outputs is not None:
            raise ValueError("structured_outputs: beam search does not support structured "
                             "outputs; use sampling (n > 1) instead")
        if not isinstance(self.beam_width, int) or self.beam_width < 1:
            raise ValueError(f"beam_width: must be at least 1, got {self.beam_width!r}")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens: must be at least 1, got {self.max_tokens!r}")


@dataclass(slots=True)
class BeamSearchSequence:
    """One beam: the prompt's and generated tokens, and its score's parts."""

    tokens: list[int]
    cum_logprob: float = 0.0
    logprobs: list[float] = field(default_factory=list)
    text: str | None = None
    finish_reason: str | None = None

    def score(self, num_prompt_tokens: int, length_penalty: float) -> float:
        """Hugging Face's final ranking: cumulative logprob / generated length ** penalty."""
        return self.cum_logprob / max(1, len(self.tokens) - num_prompt_tokens) ** length_penalty


@dataclass(slots=True)
class BeamSearchOutput:
    sequences: list[BeamSearchSequence]  # best first, beam_width of them


@dataclass(slots=True)
class _Instance:
    num_prompt_tokens: int
    beams: list[BeamSearchSequence]
    completed: list[BeamSearchSequence] = field(default_factory=list)


def beam_search(llm, prompts: list, params: BeamSearchParams) -> list[BeamSearchOutput]:
    """Run beam search for every prompt; the beams of all prompts step together."""
    from engine_worker.sampling_params import SamplingParams

    tokenizer = llm.engine.tokenizer
    instances = []
    for prompt in prompts:
        ids = llm.engine.input_processor.tokenize(prompt)
        instances.append(_Instance(len(ids), [BeamSearchSequence(tokens=ids)]))
    step_params = SamplingParams(temperature=0, max_tokens=1, logprobs=2 * params.beam_width,
                                 ignore_eos=True)
    eos = tokenizer.eos_token_ids
    for _ in range(params.max_tokens):
        live = [(inst, beam) for inst in instances for beam in inst.beams]
        if not live:
            break
        outputs = llm.generate([{"prompt_token_ids": beam.tokens} for _, beam in live],
                               step_params, use_tqdm=False)
        candidates: dict[int, list[BeamSearchSequence]] = {id(i): [] for i in instances}
        for (inst, beam), output in zip(live, outputs):
            for token_id, lp in output.outputs[0].logprobs[0].items():
                candidates[id(inst)].append(BeamSearchSequence(
                    tokens=beam.tokens + [token_id], cum_logprob=beam.cum_logprob + lp.logprob,
                    logprobs=beam.logprobs + [lp.logprob]))
        for inst in instances:
            ranked = sorted(candidates[id(inst)], key=lambda b: b.cum_logprob, reverse=True)
            inst.beams = []
            for beam in ranked[:2 * params.beam_width]:
                if len(inst.beams) == params.beam_width:
                    break
                if not params.ignore_eos and beam.tokens[-1] in eos:
                    beam.finish_reason = "stop"
                    inst.completed.append(beam)
                else:
                    inst.beams.append(beam)
    return [_finalize(inst, params, tokenizer) for inst in instances]


def _finalize(inst: _Instance, params: BeamSearchParams, tokenizer) -> BeamSearchOutput:
    for beam in inst.beams:
        beam.finish_reason = "length"
    ranked = sorted(inst.completed + inst.beams,
                    key=lambda b: b.score(inst.num_prompt_tokens, params.length_penalty),
                    reverse=True)[:params.beam_width]
    for beam in ranked:
        beam.text = tokenizer.decode(beam.tokens[inst.num_prompt_tokens:])
    return BeamSearchOutput(sequences=ranked)
