"""The offline user API, in vLLM's shape: ``LLM(model=...).generate(prompts, params)``."""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence

from engine_worker.beam_search import BeamSearchOutput, BeamSearchParams, beam_search
from engine_worker.config import EngineArgs
from engine_worker.engine import LLMEngine
from engine_worker.engine_info import EngineInfo
from engine_worker.input_processor import PromptType
from engine_worker.lora.request import LoRARequest
from engine_worker.outputs import EmbeddingRequestOutput, RequestOutput
from engine_worker.pooling_params import PoolingParams
from engine_worker.sampling_params import (RequestOutputKind, SamplingParams,
                                           StructuredOutputsParams)
from quire.tool_calls import render_inputs, tool_choice_of


class LLM:
    """An engine plus a loop that runs it until every submitted request finishes.

    Takes vLLM's engine argument names: ``model, tokenizer, dtype, max_model_len, block_size,
    kv_cache_memory_bytes, gpu_memory_utilization, max_num_seqs, max_num_batched_tokens,
    scheduling_policy, seed, device, speculative_config``. ``model=None`` loads the embedded
    SmolLM2-135M-Instruct.
    """

    def __init__(self, model: str | None = None, **kwargs) -> None:
        known = set(EngineArgs.__dataclass_fields__)
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise ValueError(f"{unknown[0]}: not an engine argument (known: {sorted(known)})")
        self.engine = LLMEngine.from_engine_args(EngineArgs(model=model, **kwargs))
        self._counter = itertools.count()

    def shutdown(self) -> None:
        """Stop the engine's tensor-parallel worker processes (nothing to stop with one rank;
        also done when the LLM is collected or Python exits)."""
        self.engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    @property
    def info(self) -> EngineInfo:
        """What the engine runs, fixed at start: model, device, dtype, kernel backend, KV cache
        size, max_model_len, ..."""
        return self.engine.info

    def get_tokenizer(self):
        return self.engine.tokenizer.hf

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True, priority: Sequence[int] | None = None,
                 lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None
                 ) -> list[RequestOutput]:
        """Generate completions for every prompt; outputs come back in the prompts' order.

        A prompt is a string, a list of token ids, or ``{"prompt": ...}`` /
        ``{"prompt_token_ids": [...]}``. One SamplingParams applies to all, or give one each;
        likewise ``lora_request`` (None: the base model), as vLLM takes it.
        """
        prompts = self._as_prompt_list(prompts)
        params = self._as_params_list(sampling_params, len(prompts))
        loras = self._as_lora_list(lora_request, len(prompts))
        if priority is not None and len(priority) != len(prompts):
            raise ValueError("priority: needs one value per prompt")
        # Validate every request before queueing any, so a bad one leaves no half-run batch.
        for p in params:
            if not isinstance(p, SamplingParams):
                raise ValueError("sampling_params: must be SamplingParams")
        request_ids = []
        try:
            for i, (prompt, p) in enumerate(zip(prompts, params)):
                request_id = str(next(self._counter))
                self.engine.add_request(request_id, prompt,
                                        p.clone(output_kind=RequestOutputKind.FINAL_ONLY),
                                        priority=0 if priority is None else priority[i],
                                        lora_request=loras[i])
                request_ids.append(request_id)
        except ValueError:
            self.engine.abort_request(request_ids)
            self._drain()
            raise
        return self._run(request_ids, use_tqdm)

    def embed(self, prompts: PromptType | Sequence[PromptType],
              pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
              use_tqdm: bool = True) -> list[EmbeddingRequestOutput]:
        """One embedding per prompt, in the prompts' order (``output.outputs.embedding``):
        the final hidden states pooled as the engine's ``pooler_config`` says (LAST or MEAN,
        L2-normalised by default). Prompts batch together as one continuous batch."""
        prompts = self._as_prompt_list(prompts)
        if pooling_params is None or isinstance(pooling_params, PoolingParams):
            params = [pooling_params or PoolingParams()] * len(prompts)
        else:
            params = list(pooling_params)
            if len(params) != len(prompts):
                raise ValueError(f"pooling_params: got {len(params)} for {len(prompts)} prompts")
        if not all(isinstance(p, PoolingParams) for p in params):
            raise ValueError("pooling_params: must be PoolingParams")
        request_ids = []
        try:
            for prompt, p in zip(prompts, params):
                request_id = str(next(self._counter))
                self.engine.add_request(request_id, prompt, p)
                request_ids.append(request_id)
        except ValueError:
            self.engine.abort_request(request_ids)
            self._drain()
            raise
        return [EmbeddingRequestOutput.from_base(o) for o in self._run(request_ids, use_tqdm)]

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True, add_generation_prompt: bool = True,
             continue_final_message: bool = False, chat_template_kwargs: dict | None = None,
             tools: list[dict] | None = None, tool_choice: str | dict | None = None,
             parallel_tool_calls: bool | None = None,
             lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None
             ) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation (or a list of them) and
        generate the assistant's reply.

        ``tools`` (OpenAI's function tools) go to the template, or are written into the
        prompt in the Hermes format when the template ignores them; ``tool_choice`` ("auto",
        the default with tools, "none", "required" or ``{"type": "function", "function":
        {"name": ...}}``) and ``parallel_tool_calls`` as in the OpenAI API: "required" and a
        named function are enforced by a JSON-schema grammar. Each completion's parsed calls
        are in ``output.outputs[i].tool_calls`` (``text`` stays the raw output).
        ``role: "tool"`` messages and earlier assistant ``tool_calls`` render too."""
        conversations = messages if messages and isinstance(messages[0], list) else [messages]
        choice = tool_choice_of({"tools": tools, "tool_choice": tool_choice,
                                 "parallel_tool_calls": parallel_tool_calls})
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message: cannot be combined with "
                             "add_generation_prompt")
        tokenizer = self.engine.tokenizer
        template = tokenizer.chat_template
        prompts = []
        for conversation in conversations:
            if not isinstance(conversation, list) or not all(
                    isinstance(m, dict) and isinstance(m.get("role"), str)
                    for m in conversation):
                raise ValueError("messages: a conversation is a list of {role, content} dicts")
            rendered, template_tools = render_inputs(conversation, tools, template)
            prompts.append(tokenizer.apply_chat_template(
                rendered, add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message, tools=template_tools,
                **(chat_template_kwargs or {})))
        token_prompts = [tokenizer.encode(p, add_special_tokens=False) for p in prompts]
        params = self._as_params_list(sampling_params, len(prompts))
        if choice is not None and choice.schema() is not None:
            params = [_enforce_tool_schema(p, choice.schema()) for p in params]
        outputs = self.generate([{"prompt_token_ids": t} for t in token_prompts],
                                params, use_tqdm=use_tqdm, lora_request=lora_request)
        for output, text in zip(outputs, prompts):
            output.prompt = text
            if choice is not None:
                for completion in output.outputs:
                    _, calls = choice.parse(completion.text)
                    completion.tool_calls = [c.as_json() for c in calls] or None
        return outputs

    def beam_search(self, prompts: PromptType | Sequence[PromptType],
                    params: BeamSearchParams) -> list[BeamSearchOutput]:
        """Beam search (``beam_width`` beams, ``max_tokens`` steps); beams share KV blocks
        through the prefix cache. Returns each prompt's beams, best first."""
        if not isinstance(params, BeamSearchParams):
            raise ValueError("params: must be BeamSearchParams")
        return beam_search(self, self._as_prompt_list(prompts), params)

    # ---------------------------------------------------------------------- internals
    @staticmethod
    def _as_prompt_list(prompts) -> list[PromptType]:
        if isinstance(prompts, (str, dict)):
            return [prompts]
        prompts = list(prompts)
        if prompts and all(isinstance(t, int) for t in prompts):
            return [prompts]  # one prompt given as token ids
        return prompts

    @staticmethod
    def _as_params_list(params, n: int) -> list[SamplingParams]:
        if params is None:
            return [SamplingParams()] * n
        if isinstance(params, SamplingParams):
            return [params] * n
        params = list(params)
        if len(params) != n:
            raise ValueError(f"sampling_params: got {len(params)} for {n} prompts")
        return params

    @staticmethod
    def _as_lora_list(lora_request, n: int) -> list[LoRARequest | None]:
        if lora_request is None or isinstance(lora_request, LoRARequest):
            return [lora_request] * n
        loras = list(lora_request)
        if len(loras) != n:
            raise ValueError(f"lora_request: got {len(loras)} for {n} prompts")
        return loras

    def _drain(self) -> None:
        while self.engine.has_unfinished_requests():
            self.engine.step()

    def _run(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        results: dict[str, RequestOutput] = {}
        bar = _Progress(len(request_ids)) if use_tqdm else None
        while self.engine.has_unfinished_requests():
            for output in self.engine.step().outputs:
                if output.finished:
                    results[output.request_id] = output
                    if bar is not None:
                        bar.update(output)
        if bar is not None:
            bar.close()
        return [results[r] for r in request_ids]


def _enforce_tool_schema(params: SamplingParams, schema: dict) -> SamplingParams:
    """tool_choice required / named: the output is constrained to the calls' JSON schema."""
    if not isinstance(params, SamplingParams):
        raise ValueError("sampling_params: must be SamplingParams")
    if params.structured_outputs is not None:
        raise ValueError("tool_choice: required or a named function cannot be combined with "
                         "structured_outputs")
    return params.clone(structured_outputs=StructuredOutputsParams(json=schema))


class _Progress:
    """Requests done, with input and output tokens/s, as vLLM's bar shows them."""

    def __init__(self, total: int) -> None:
        from tqdm.auto import tqdm

        self._bar = tqdm(total=total, desc="Processed prompts", dynamic_ncols=True,
                         unit="req")
        self._start = time.monotonic()
        self._in = self._out = 0

    def update(self, output) -> None:
        self._in += len(output.prompt_token_ids)
        if isinstance(output, RequestOutput):
            self._out += sum(len(c.token_ids) for c in output.outputs)
        elapsed = max(time.monotonic() - self._start, 1e-9)
        self._bar.set_postfix_str(f"input: {self._in / elapsed:.1f} toks/s, "
                                  f"output: {self._out / elapsed:.1f} toks/s", refresh=False)
        self._bar.update(1)

    def close(self) -> None:
        self._bar.close()
