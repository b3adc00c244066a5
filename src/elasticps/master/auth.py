"""The master's gRPC authentication: a per-call token derived from the job secret.

Every call a :class:`~elasticps.master.client.MasterClient` makes carries the
metadata ``x-elasticps-token: <token>``, the job secret's
:meth:`~elasticps.security.JobSecret.grpc_token`. :class:`TokenInterceptor`
answers a call without the right token ``UNAUTHENTICATED`` before the
service sees it (compared with :func:`hmac.compare_digest`), and counts it.
The gRPC health service (``grpc.health.v1.Health``) stays open, for probes:
it answers SERVING or NOT_SERVING and nothing about the job.

Whatever the token, the service itself answers only trainer ids that hold a
live registration in etcd (:class:`~elasticps.master.service.MasterService`).
"""

from __future__ import annotations

import hmac
import logging
from collections.abc import Callable
from typing import Any, Final

import grpc

from elasticps.security import JobSecret, Refusals

__all__ = ["HEALTH_SERVICE_PREFIX", "TOKEN_METADATA", "TokenInterceptor"]

log = logging.getLogger(__name__)

TOKEN_METADATA: Final = "x-elasticps-token"
"""The metadata key of the per-call token."""

HEALTH_SERVICE_PREFIX: Final = "/grpc.health.v1.Health/"
"""Methods open without a token."""


class TokenInterceptor(grpc.ServerInterceptor):  # type: ignore[misc,type-arg]
    """Refuses every call but the health service's that lacks the job's token.

    Args:
        secret: the job secret.

    Attributes:
        refusals: the calls refused so far.
    """

    def __init__(self, secret: JobSecret) -> None:
        self._token = secret.grpc_token().encode("ascii")
        self.refusals = Refusals()

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler[Any, Any] | None],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[Any, Any] | None:
        method = handler_call_details.method
        if method.startswith(HEALTH_SERVICE_PREFIX):
            return continuation(handler_call_details)
        token = ""
        for key, value in handler_call_details.invocation_metadata or ():
            if key == TOKEN_METADATA and isinstance(value, str):
                token = value
        if hmac.compare_digest(token.encode("utf-8", "replace"), self._token):
            return continuation(handler_call_details)
        refused = self.refusals.add("bad_token")
        if refused is not None:
            log.warning(
                "master: refused a call to %s without the job's token; %d refused so far",
                method, refused,
            )  # fmt: skip
        handler = continuation(handler_call_details)
        return _refusal(handler)


def _abort(request: Any, context: grpc.ServicerContext) -> Any:
    context.abort(grpc.StatusCode.UNAUTHENTICATED, "this call needs the job's token")


def _refusal(
    handler: grpc.RpcMethodHandler[Any, Any] | None,
) -> grpc.RpcMethodHandler[Any, Any] | None:
    """A handler of the same kind as ``handler`` that answers UNAUTHENTICATED."""
    if handler is None:
        return None
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(_abort)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(_abort)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(_abort)
    return grpc.unary_unary_rpc_method_handler(_abort)
