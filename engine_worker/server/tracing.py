"""The engine's span of one Generate call, after the OpenTelemetry GenAI conventions.

Nothing is traced inside the engine loop: the loop already stamps each request's life
(``RequestOutput.metrics``: arrival, first scheduled, first token, preemptions, finished), and
this span is built from those stamps once the request ends, with explicit start, event and end
times. While the request runs the servicer only keeps its latest output (and, with text on, the
completion text).
"""

from __future__ import annotations

import time

from opentelemetry.trace import SpanKind

from engine_worker.outputs import RequestOutput
from quire.tracing import Tracing
from quire.v1 import engine_pb2 as pb

OPERATION = "text_completion"


def _sampling_attributes(sampling: pb.SamplingOptions) -> dict:
    """What the client asked for (unset fields are left out, not shown as defaults)."""
    attributes = {}
    for field, key in (("max_tokens", "gen_ai.request.max_tokens"),
                       ("temperature", "gen_ai.request.temperature"),
                       ("top_p", "gen_ai.request.top_p"), ("top_k", "gen_ai.request.top_k"),
                       ("seed", "gen_ai.request.seed")):
        if sampling.HasField(field):
            attributes[key] = getattr(sampling, field)
    if sampling.HasField("n"):
        attributes["gen_ai.request.choice.count"] = sampling.n
    return attributes


class EngineSpan:
    """Collects one request's outputs; ``end()`` writes the span, exactly once."""

    def __init__(self, tracing: Tracing, request: pb.GenerateRequest, metadata, *,
                 model_name: str) -> None:
        self.tracing = tracing
        self.request = request
        self.metadata = metadata
        self.model_name = model_name
        self.received_s = time.monotonic()
        self.last: RequestOutput | None = None
        self.finish_reasons: dict[int, str] = {}
        self.num_output_tokens = 0
        self.texts: dict[int, list[str]] | None = {} if tracing.include_text else None

    def observe(self, output: RequestOutput) -> None:
        """One DELTA output as it is streamed (per message: a few additions, no span work)."""
        self.last = output
        for completion in output.outputs:
            self.num_output_tokens += len(completion.token_ids)
            if completion.finish_reason is not None:
                self.finish_reasons[completion.index] = completion.finish_reason
            if self.texts is not None:
                self.texts.setdefault(completion.index, []).append(completion.text)

    def end(self, error: BaseException | None, context) -> None:
        offset_ns = time.time_ns() - time.monotonic_ns()  # monotonic stamps -> wall clock

        def wall(monotonic_s: float) -> int:
            return int(monotonic_s * 1e9) + offset_ns

        metrics = self.last.metrics if self.last is not None else None
        finished_s = metrics.finished_time if metrics and metrics.finished_time else None
        span = self.tracing.tracer.start_span(
            f"{OPERATION} {self.model_name}", context=self.tracing.extract(self.metadata),
            kind=SpanKind.SERVER, start_time=wall(self.received_s),
            attributes=self._attributes())
        if metrics is not None:
            self._lifecycle(span, metrics, wall)
        end_s = finished_s or time.monotonic()
        self.tracing.end(span, error, context, end_time_ns=wall(end_s))

    def _attributes(self) -> dict:
        request = self.request
        attributes = {"gen_ai.operation.name": OPERATION, "gen_ai.system": "quire",
                      "gen_ai.request.model": self.model_name,
                      "rpc.system": "grpc", "rpc.service": "quire.v1.EngineService",
                      "rpc.method": "Generate",
                      **_sampling_attributes(request.sampling)}
        if self.texts is not None:  # QUIRE_TRACE_INCLUDE_TEXT: the user asked for text
            if request.WhichOneof("prompt") == "text":
                attributes["gen_ai.prompt"] = request.text
            attributes["gen_ai.completion"] = ["".join(self.texts[i]) for i in sorted(self.texts)]
        last = self.last
        if last is None:  # refused before the engine took it
            return attributes
        attributes |= {"gen_ai.response.id": last.request_id,
                       "quire.request_id": last.request_id,
                       "gen_ai.usage.input_tokens": len(last.prompt_token_ids),
                       "gen_ai.usage.output_tokens": self.num_output_tokens,
                       "quire.usage.cached_tokens": max(0, last.num_cached_tokens),
                       "gen_ai.response.finish_reasons": [
                           self.finish_reasons[i] for i in sorted(self.finish_reasons)]}
        metrics = last.metrics
        if metrics is not None:
            attributes["quire.num_preemptions"] = metrics.num_preemptions
            if metrics.first_scheduled_time is not None:
                attributes["quire.queue_time_s"] = \
                    metrics.first_scheduled_time - metrics.arrival_time
            if metrics.first_token_time is not None:
                attributes["quire.time_to_first_token_s"] = \
                    metrics.first_token_time - metrics.arrival_time
        return attributes

    def _lifecycle(self, span, metrics, wall) -> None:
        """The request's life as events, in time order: queued, scheduled, first token,
        preempted (each time), finished."""
        events = [(metrics.arrival_time, "queued", None),
                  (metrics.first_scheduled_time, "scheduled", None),
                  (metrics.first_token_time, "first_token", None),
                  *((t, "preempted", {"quire.preemption": n})
                    for n, t in enumerate(metrics.preempted_times, 1)),
                  (metrics.finished_time, "finished", {"gen_ai.response.finish_reasons": [
                      self.finish_reasons[i] for i in sorted(self.finish_reasons)]})]
        for at_s, name, attributes in sorted((e for e in events if e[0] is not None),
                                             key=lambda e: e[0]):
            span.add_event(name, attributes, timestamp=wall(at_s))
