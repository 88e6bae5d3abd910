"""The gRPC edge of flow control: one call turns a Generate or Embed call into a
``FlowRequest`` (tenant, effective priority, deadline), waits for its slot, and refuses it as
RESOURCE_EXHAUSTED with ``retry-after`` trailing metadata (whole seconds; the HTTP front copies
it to its 429's ``Retry-After`` header). The slot is released when the call ends, however it
ends: finished, failed, cancelled by the client or out of time."""

from __future__ import annotations

from typing import TYPE_CHECKING

import grpc

from quire.errors import FIELD_METADATA
from quire.v1 import engine_pb2 as pb
from router.flow import Admission, FlowController, FlowRefused, FlowRequest
from router.tenants import TenantTable

if TYPE_CHECKING:
    from router.tracing import RouterSpan

RETRY_AFTER_METADATA = "retry-after"
# A request still waiting this close to its deadline is refused rather than left to time out:
# the client hears "retry later" (429) instead of a deadline error (504 on HTTP).
_DEADLINE_MARGIN_S = 0.05


class _Unmetered:
    """The slot of a request admitted without flow control."""

    def __init__(self, priority: int) -> None:
        self.priority = priority

    def started(self) -> None:
        pass

    def generated(self, num_tokens: int) -> None:
        pass

    def release(self) -> None:
        pass


class AdmissionGate:
    def __init__(self, controller: FlowController | None, table: TenantTable) -> None:
        """``controller`` None: flow control is off; every request passes at once."""
        self.controller = controller
        self.table = table
        # whether any tenant's priority is bounded: else, with flow control off, a request
        # passes without its tenant being looked up (an API key's digest on every request)
        self._floors = table.default.min_priority is not None or any(
            p.min_priority is not None for p in table.tenants.values())

    async def admit(self, request: pb.GenerateRequest | pb.EmbedRequest,
                    context: grpc.aio.ServicerContext, num_prompt_tokens: int,
                    span: RouterSpan | None) -> Admission | _Unmetered:
        """The request's slot, released when the call ends; a refusal aborts the call (a
        priority more urgent than the tenant's ``min_priority``: PERMISSION_DENIED naming
        ``priority``, flow control on or off). Its ``priority`` is the effective one (the
        tenant's default for a request that set 0); the engine still gets the request's own
        (vLLM refuses a priority other than 0 unless it runs priority scheduling)."""
        if self.controller is None and not self._floors:
            return _Unmetered(request.priority)
        tenant = self.table.resolve(tuple(context.invocation_metadata() or ()))
        priority = request.priority or tenant.policy.priority
        floor = tenant.policy.min_priority
        if floor is not None and priority < floor:
            await context.abort(grpc.StatusCode.PERMISSION_DENIED,
                                f"priority: {request.priority} is more urgent than this "
                                f"tenant may ask for (at least {floor}; lower runs first)",
                                trailing_metadata=((FIELD_METADATA, "priority"),))
        if self.controller is None:
            return _Unmetered(request.priority)
        remaining = context.time_remaining()
        flow = FlowRequest(tenant=tenant, priority=priority,
                           priority_label=self.table.priority_label(priority),
                           num_prompt_tokens=num_prompt_tokens,
                           max_wait_s=None if remaining is None else
                           max(remaining - _DEADLINE_MARGIN_S, 0.0))
        try:
            admission = await self.controller.admit(flow)
        except FlowRefused as e:
            if span is not None:
                span.flow_refused(tenant.label, priority, e.reason)
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e),
                                trailing_metadata=((RETRY_AFTER_METADATA, e.retry_after),))
        context.add_done_callback(lambda _: admission.release())
        if span is not None:
            span.flow_admitted(tenant.label, priority, admission.wait_s)
        return admission
