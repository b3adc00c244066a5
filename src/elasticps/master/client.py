"""gRPC client of the master, used by trainers and the launcher."""

from __future__ import annotations

from collections.abc import Callable

import grpc
import tenacity

from elasticps.errors import ServiceUnavailableError, StaleTaskError, UnknownTaskError
from elasticps.proto import master_pb2, master_pb2_grpc

_RETRYABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


def _is_retryable(exc: BaseException) -> bool:
    return isinstance(exc, grpc.RpcError) and exc.code() in _RETRYABLE


class MasterClient:
    """Calls the master's ``GetTask`` / ``ReportTask`` / ``GetJobStatus``.

    Unavailable masters are retried with exponential backoff and jitter
    (tenacity) for up to ``retry_s`` seconds.

    Args:
        address: ``host:port`` of the master.
        rpc_timeout_s: deadline of one call, seconds.
        retry_s: total time to keep retrying an unavailable master, seconds.
    """

    def __init__(self, address: str, *, rpc_timeout_s: float = 10.0, retry_s: float = 30.0) -> None:
        self.address = address
        self._channel = grpc.insecure_channel(address)
        self._stub = master_pb2_grpc.MasterStub(self._channel)  # type: ignore[no-untyped-call]
        self._rpc_timeout_s = rpc_timeout_s
        self._retrying = tenacity.Retrying(
            retry=tenacity.retry_if_exception(_is_retryable),
            wait=tenacity.wait_random_exponential(multiplier=0.05, max=2.0),
            stop=tenacity.stop_after_delay(retry_s),
            reraise=True,
        )

    def close(self) -> None:
        """Close the channel."""
        self._channel.close()

    def get_task(self, trainer_id: str) -> master_pb2.GetTaskResponse:
        """Ask for a task.

        Raises:
            ServiceUnavailableError: the master did not answer within the retry budget.
        """
        request = master_pb2.GetTaskRequest(trainer_id=trainer_id)
        reply = self._call(self._stub.GetTask, request)
        assert isinstance(reply, master_pb2.GetTaskResponse)
        return reply

    def report_task(self, request: master_pb2.ReportTaskRequest) -> None:
        """Report a task attempt's outcome.

        Raises:
            StaleTaskError: the attempt timed out and was re-dispatched.
            UnknownTaskError: the master does not know the task.
            ServiceUnavailableError: the master did not answer within the retry budget.
        """
        try:
            self._call(self._stub.ReportTask, request)
        except grpc.RpcError as exc:
            if exc.code() is grpc.StatusCode.FAILED_PRECONDITION:
                raise StaleTaskError(exc.details()) from exc
            if exc.code() is grpc.StatusCode.NOT_FOUND:
                raise UnknownTaskError(exc.details()) from exc
            raise

    def job_status(self) -> master_pb2.JobStatus:
        """The job's progress counters."""
        reply = self._call(self._stub.GetJobStatus, master_pb2.GetJobStatusRequest())
        assert isinstance(reply, master_pb2.JobStatus)
        return reply

    def _call(self, method: Callable[..., object], request: object) -> object:
        try:
            return self._retrying(method, request, timeout=self._rpc_timeout_s)
        except grpc.RpcError as exc:
            if _is_retryable(exc):
                raise ServiceUnavailableError(
                    f"master at {self.address} is unavailable: {exc.details()}"
                ) from exc
            raise
