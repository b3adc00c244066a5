"""A stand-in for ``grpc.ServicerContext`` to call a gRPC servicer's methods directly.

Tests of :class:`elasticps.master.service.MasterService` call its methods with
:data:`ABORTING_CONTEXT`; an RPC that would answer with an error status raises
:class:`AbortedError` instead.
"""

from __future__ import annotations

from typing import Any

import grpc

__all__ = ["ABORTING_CONTEXT", "AbortedError", "AbortingContext"]


class AbortedError(Exception):
    """What ``context.abort(code, details)`` raised.

    Attributes:
        code: the gRPC status code the servicer answered with.
    """

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code = code


class AbortingContext:
    """The part of ``grpc.ServicerContext`` the servicers use: ``abort``."""

    def abort(self, code: grpc.StatusCode, details: str) -> None:
        """Raise :class:`AbortedError` (as gRPC's ``abort`` raises to end the RPC)."""
        raise AbortedError(code, details)


ABORTING_CONTEXT: Any = AbortingContext()
"""An :class:`AbortingContext`, typed to pass where a ``grpc.ServicerContext`` is expected."""
