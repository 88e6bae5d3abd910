"""The router's span of one Generate call: why the request was placed where it was.

One SERVER span per request, child of the client's W3C ``traceparent`` (gRPC metadata; the HTTP
front forwards its headers there) and parent of the engine's span (its context goes to the
engine as metadata). The final placement is on the span's attributes; every attempt is a
``placement`` event, and each failed one a ``retry`` event, so a retried request shows both
engines and why the first was left. The wait in the router's queue is a ``flow.admitted``
event (``quire.flow.wait_s``), a refusal a ``flow.refused`` event.
"""

from __future__ import annotations

from opentelemetry.trace import SpanKind

from quire.tracing import Tracing
from quire.v1 import engine_pb2 as pb
from router.balancer import Decision

SPAN_NAME = "quire.v1.EngineService/Generate"


def _scores(decision: Decision) -> dict:
    # Parallel arrays: OTLP attributes hold no maps, and engine ids are not attribute keys.
    candidates = sorted(decision.scores)
    return {"quire.routing.candidates": candidates,
            "quire.routing.scores": [float(decision.scores[c]) for c in candidates]}


class RouterSpan:
    """Records one request's placement; ``end()`` exactly once."""

    def __init__(self, tracing: Tracing, request: pb.GenerateRequest, metadata) -> None:
        self.tracing = tracing
        attributes = {"rpc.system": "grpc", "rpc.service": "quire.v1.EngineService",
                      "rpc.method": "Generate"}
        if request.request_id:
            attributes["quire.request_id"] = request.request_id
        if tracing.include_text and request.WhichOneof("prompt") == "text":
            attributes["gen_ai.prompt"] = request.text
        self.span = tracing.tracer.start_span(SPAN_NAME, context=tracing.extract(metadata),
                                              kind=SpanKind.SERVER, attributes=attributes)
        self.metadata = tracing.metadata(self.span)  # for the engine call
        self._attempts = 0

    def placed(self, decision: Decision, attempt: int, request_id: str,
               num_prompt_tokens: int) -> None:
        self._attempts = attempt
        scores = _scores(decision)
        self.span.add_event("placement", {
            "quire.routing.attempt": attempt, "quire.routing.engine_id": decision.engine_id,
            "quire.routing.predicted_cached_tokens": decision.predicted_cached_tokens,
            **scores})
        self.span.set_attributes({
            "quire.request_id": request_id, "quire.routing.policy": decision.policy,
            "quire.routing.engine_id": decision.engine_id,
            "quire.routing.predicted_cached_tokens": decision.predicted_cached_tokens,
            "quire.routing.num_prompt_tokens": num_prompt_tokens,
            "quire.routing.attempts": attempt, **scores})

    def flow_admitted(self, tenant: str, priority: int, wait_s: float) -> None:
        """The wait for a slot in the router's queue (0 when the engines had room)."""
        self.span.add_event("flow.admitted", {"quire.flow.tenant": tenant,
                                              "quire.flow.priority": priority,
                                              "quire.flow.wait_s": wait_s})

    def flow_refused(self, tenant: str, priority: int, reason: str) -> None:
        self.span.add_event("flow.refused", {"quire.flow.tenant": tenant,
                                             "quire.flow.priority": priority,
                                             "quire.flow.reason": reason})

    def retried(self, engine_id: str, code: str) -> None:
        self.span.add_event("retry", {"quire.routing.engine_id": engine_id,
                                      "rpc.grpc.status_code": code,
                                      "quire.routing.attempt": self._attempts})

    def migrated(self, engine_id: str, code: str, num_tokens: int) -> None:
        """The stream's engine failed after ``num_tokens`` relayed tokens; it goes on
        elsewhere (router.resume)."""
        self.span.add_event("migration", {"quire.routing.engine_id": engine_id,
                                          "rpc.grpc.status_code": code,
                                          "quire.routing.attempt": self._attempts,
                                          "gen_ai.usage.output_tokens": num_tokens})

    def first_message(self, engine_id: str) -> None:
        self.span.add_event("first_message", {"quire.routing.engine_id": engine_id})

    def usage(self, usage: pb.Usage) -> None:
        self.span.set_attributes({"gen_ai.usage.input_tokens": usage.prompt_tokens,
                                  "gen_ai.usage.output_tokens": usage.completion_tokens,
                                  "quire.usage.cached_tokens": usage.cached_tokens})

    def end(self, error: BaseException | None, context) -> None:
        self.tracing.end(self.span, error, context)
