"""quire.errors: one table of error kinds, statuses for both applications' errors."""

from __future__ import annotations

import grpc

from quire.errors import ErrorKind, http_status, status_for
from quire.load_stream import load_interval_s
from quire.v1 import engine_pb2 as pb
from router.balancer import NoEndpointError
from router.errors import KINDS as ROUTER_KINDS


def test_every_kind_has_one_grpc_and_one_http_status():
    assert len({kind.grpc_code for kind in ErrorKind}) == len(ErrorKind)
    assert http_status(grpc.StatusCode.INVALID_ARGUMENT) == 400
    assert http_status(grpc.StatusCode.RESOURCE_EXHAUSTED) == 429
    assert http_status(grpc.StatusCode.UNAVAILABLE) == 503
    assert http_status(grpc.StatusCode.DEADLINE_EXCEEDED) == 504
    assert http_status(grpc.StatusCode.DATA_LOSS) == 500  # no kind names it


def test_router_errors_map_by_kind_and_hide_internals():
    assert status_for(ValueError("prompt: empty"), ROUTER_KINDS) == (
        grpc.StatusCode.INVALID_ARGUMENT, "prompt: empty")
    assert status_for(NoEndpointError("none"), ROUTER_KINDS) == (
        grpc.StatusCode.UNAVAILABLE, "none")
    assert status_for(KeyError("secret"), ROUTER_KINDS) == (
        grpc.StatusCode.INTERNAL, "internal error: KeyError")


def test_load_interval_defaults_and_floor():
    assert load_interval_s(pb.StreamLoadRequest()) == 1.0
    assert load_interval_s(pb.StreamLoadRequest(interval_ms=1)) == 0.01
    assert load_interval_s(pb.StreamLoadRequest(interval_ms=250)) == 0.25


def test_engine_errors_map_by_kind():
    from engine_worker.engine import EngineDeadError
    from engine_worker.server.async_engine import EngineUnavailableError, QueueFullError
    from engine_worker.server.errors import KINDS as ENGINE_KINDS

    assert status_for(QueueFullError("full"), ENGINE_KINDS)[0] == \
        grpc.StatusCode.RESOURCE_EXHAUSTED
    assert status_for(EngineUnavailableError("x"), ENGINE_KINDS)[0] == \
        grpc.StatusCode.UNAVAILABLE
    assert status_for(EngineDeadError("x"), ENGINE_KINDS)[0] == grpc.StatusCode.UNAVAILABLE
    assert status_for(ValueError("n: too big"), ENGINE_KINDS) == (
        grpc.StatusCode.INVALID_ARGUMENT, "n: too big")


def test_a_field_error_names_its_field_and_reads_as_before():
    from quire.errors import FieldError, field_of

    error = FieldError("max_tokens", "must be at least 1, got 0")
    assert str(error) == "max_tokens: must be at least 1, got 0"
    assert isinstance(error, ValueError) and field_of(error) == "max_tokens"
    assert field_of(ValueError("max_tokens: no field carried")) is None  # never parsed


def test_engine_errors_name_the_field_by_its_path_in_the_message_sent():
    """An engine names sampling fields as ``sampling.<name>`` and its prompt ids as
    ``token_ids`` over gRPC, as the router's checks do; the error keeps its type (its status)."""
    from engine_worker.lora.cache import UnknownLoRAError
    from engine_worker.server.convert import wire_error
    from engine_worker.server.errors import KINDS as ENGINE_KINDS
    from quire.errors import FieldError, NotFoundError, renamed

    for field, sampling, wire in (("temperature", True, "sampling.temperature"),
                                  ("structured_outputs.json", True,
                                   "sampling.structured_outputs.json"),
                                  ("logit_bias[7]", True, "sampling.logit_bias[7]"),
                                  ("prompt_token_ids", True, "token_ids"),
                                  ("prompt_token_ids", False, "token_ids"),
                                  ("temperature", False, "temperature"),  # not an Embed field
                                  ("prompt", True, "prompt"), ("lora_name", True, "lora_name")):
        error = wire_error(FieldError(field, "bad"), sampling=sampling)
        assert (error.field, str(error)) == (wire, f"{wire}: bad")
    plain = ValueError("temperature: no field carried")
    assert wire_error(plain, sampling=True) is plain
    missing = renamed(UnknownLoRAError("x"), "sampling.x")
    assert isinstance(missing, NotFoundError) and missing.field == "sampling.x"
    assert status_for(missing, ENGINE_KINDS)[0] == grpc.StatusCode.NOT_FOUND
