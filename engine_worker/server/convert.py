"""Between quire.v1 messages and the engine's own types. Bad fields raise ValueError naming them."""

from __future__ import annotations

from quire.errors import FieldError, renamed
from engine_worker.input_processor import DefaultMaxTokens
from engine_worker.outputs import PoolingRequestOutput, RequestOutput
from engine_worker.pooling_params import PoolingParams
from engine_worker.sampling_params import SamplingParams, StructuredOutputsParams
from quire.limits import check_lora_name, check_n, check_request_id, request_prompt
from quire.structured_outputs import no_kind_error, spec_from_proto, structured_outputs_kind
from quire.v1 import engine_pb2 as pb

_FINISH = {"stop": pb.FINISH_REASON_STOP, "length": pb.FINISH_REASON_LENGTH,
           "abort": pb.FINISH_REASON_ABORT}

# proto field -> SamplingParams field, for the optional scalars
_OPTIONAL = ("n", "temperature", "top_p", "top_k", "min_p", "repetition_penalty",
             "presence_penalty", "frequency_penalty", "seed", "max_tokens", "min_tokens",
             "logprobs", "prompt_logprobs", "skip_special_tokens")


_SAMPLING_WIRE_FIELDS = frozenset(pb.SamplingOptions.DESCRIPTOR.fields_by_name)


def wire_error(error: BaseException, sampling: bool) -> BaseException:
    """``error`` naming the field by its path in the request message a gRPC client sent, as
    the router's own checks do: a sampling field as ``sampling.<name>`` (``sampling``: the
    message has them, a GenerateRequest) and the engine's ``prompt_token_ids`` as
    ``token_ids``. Other errors are returned as they are."""
    if not isinstance(error, FieldError):
        return error
    field = error.field
    root = field.split(".", 1)[0].split("[", 1)[0]
    if root == "prompt_token_ids":
        return renamed(error, "token_ids" + field[len(root):])
    if sampling and root in _SAMPLING_WIRE_FIELDS:
        return renamed(error, f"sampling.{field}")
    return error


def request_from_proto(message: pb.GenerateRequest, limits: RequestLimits):
    """-> (prompt for LLMEngine.add_request, SamplingParams, priority, cache_salt)."""
    check_request_id(message.request_id)
    check_lora_name(message.lora_name)
    prompt = request_prompt(message)
    if not isinstance(prompt, str):
        prompt = {"prompt_token_ids": prompt}
    sampling = message.sampling
    kwargs = {name: getattr(sampling, name) for name in _OPTIONAL if sampling.HasField(name)}
    if "max_tokens" not in kwargs:
        # up to the output cap, cut to the model's length limit, as vLLM's server does
        kwargs["max_tokens"] = DefaultMaxTokens(limits.max_tokens) if limits.max_tokens else None
    structured = None
    if sampling.HasField("structured_outputs"):
        spec = spec_from_proto(sampling.structured_outputs)
        if spec is None:
            raise no_kind_error("structured_outputs")
        structured_outputs_kind(spec)  # names the field before the dataclass sees it
        structured = StructuredOutputsParams(**spec)
    params = SamplingParams(stop=list(sampling.stop),
                            structured_outputs=structured,
                            logit_bias=dict(sampling.logit_bias) or None,
                            allowed_token_ids=list(sampling.allowed_token_ids) or None,
                            bad_words=list(sampling.bad_words) or None,
                            stop_token_ids=list(sampling.stop_token_ids),
                            ignore_eos=sampling.ignore_eos,
                            include_stop_str_in_output=sampling.include_stop_str_in_output,
                            **kwargs)
    limits.check(params, prompt)
    return prompt, params, message.priority, message.cache_salt or None


def embed_request_from_proto(message: pb.EmbedRequest, limits: RequestLimits):
    """-> (prompt for LLMEngine.add_request, PoolingParams, priority, cache_salt)."""
    check_request_id(message.request_id)
    prompt = request_prompt(message)
    if isinstance(prompt, str) and len(prompt) > limits.max_prompt_chars:
        raise FieldError("text", f"at most {limits.max_prompt_chars} characters, got "
                         f"{len(prompt)}")
    if not isinstance(prompt, str):
        prompt = {"prompt_token_ids": prompt}
    params = PoolingParams(
        normalize=message.normalize if message.HasField("normalize") else None,
        truncate_prompt_tokens=message.truncate_prompt_tokens
        if message.HasField("truncate_prompt_tokens") else None,
        truncation_side=message.truncation_side or None)
    return prompt, params, message.priority, message.cache_salt or None


def embed_response_to_proto(output: PoolingRequestOutput) -> pb.EmbedResponse:
    return pb.EmbedResponse(request_id=output.request_id, embedding=output.outputs.data,
                            usage=pb.Usage(prompt_tokens=len(output.prompt_token_ids),
                                           cached_tokens=output.num_cached_tokens))


class RequestLimits:
    """Server-side caps beyond what the engine itself validates."""

    def __init__(self, *, max_n: int, max_stop_strings: int, max_stop_string_len: int,
                 max_prompt_chars: int, max_tokens: int = 0) -> None:
        self.max_n = max_n
        self.max_tokens = max_tokens  # 0: no cap beyond the model's length
        self.max_stop_strings = max_stop_strings
        self.max_stop_string_len = max_stop_string_len
        self.max_prompt_chars = max_prompt_chars

    def check(self, params: SamplingParams, prompt) -> None:
        check_n(params.n, self.max_n)
        if len(params.stop) > self.max_stop_strings:
            raise FieldError("stop", f"at most {self.max_stop_strings} stop strings")
        if any(len(s) > self.max_stop_string_len for s in params.stop):
            raise FieldError("stop", f"each stop string at most {self.max_stop_string_len} chars")
        if isinstance(prompt, str) and len(prompt) > self.max_prompt_chars:
            raise FieldError("text", f"at most {self.max_prompt_chars} characters, got "
                             f"{len(prompt)}")
        if self.max_tokens and params.max_tokens is not None and \
                params.max_tokens > self.max_tokens:
            raise FieldError("max_tokens", f"must be <= {self.max_tokens} (the server's "
                             f"--max-tokens-limit), got {params.max_tokens}")


def _logprobs_to_proto(entries, k: int) -> list[pb.PositionLogprobs]:
    """Each entry lists the chosen token first (insertion order), then the top-k. An entry (a
    dict, as vLLM's) holds the chosen token once: when it is among the top ``k`` it is put
    back at its rank, so the wire has the whole top-k after the chosen token (OpenAI's chat
    ``top_logprobs`` are the k most likely tokens, the chosen one among them)."""
    out = []
    for entry in entries:
        if entry is None:  # the first prompt position has no logprob
            out.append(pb.PositionLogprobs())
            continue
        items = list(entry.items())
        (chosen_id, chosen), top = items[0], items[1:]
        rank = chosen.rank or 0
        if len(top) < k and 1 <= rank <= len(top) + 1:
            top.insert(rank - 1, (chosen_id, chosen))
        out.append(pb.PositionLogprobs(token_ids=[chosen_id] + [t for t, _ in top],
                                       logprobs=[chosen.logprob] + [lp.logprob for _, lp in top],
                                       chosen_rank=rank))
    return out


def response_to_proto(output: RequestOutput, first: bool, *, num_logprobs: int = 0,
                      num_prompt_logprobs: int = 0) -> pb.GenerateResponse:
    """One DELTA RequestOutput as a stream message; ``num_logprobs`` / ``num_prompt_logprobs``
    are the request's ``logprobs`` / ``prompt_logprobs`` (top-k sizes)."""
    message = pb.GenerateResponse(request_id=output.request_id, finished=output.finished)
    for completion in output.outputs:
        delta = message.outputs.add(index=completion.index, token_ids=completion.token_ids,
                                    text=completion.text,
                                    finish_reason=_FINISH.get(completion.finish_reason, 0))
        if completion.stop_reason is not None:
            delta.stop_reason = str(completion.stop_reason)
        if completion.logprobs:
            delta.logprobs.extend(_logprobs_to_proto(completion.logprobs, num_logprobs))
    if first:
        message.prompt_token_ids.extend(output.prompt_token_ids)
    if output.prompt_logprobs:
        message.prompt_logprobs.extend(_logprobs_to_proto(output.prompt_logprobs,
                                                          num_prompt_logprobs))
    return message
