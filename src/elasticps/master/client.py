"""gRPC client of the master, used by trainers and the launcher."""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Sequence

import grpc
import tenacity

from elasticps.errors import (
    AuthenticationError,
    ElasticPSError,
    ServiceUnavailableError,
    StaleTaskError,
    UnknownTaskError,
    UnknownTrainerError,
)
from elasticps.master.auth import TOKEN_METADATA
from elasticps.proto import master_pb2, master_pb2_grpc
from elasticps.security import JobSecret, secret_or_env
from elasticps.tls import JobTLS, role_host, tls_from_env

_RETRYABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)

# Numbers every call that may dispatch a task (``ask`` in the protocol), retries
# included: one counter per process, so a trainer's calls only go up whichever
# client sends them. next() on a count is atomic under the GIL.
_ASKS = itertools.count(1)


def _is_retryable(exc: BaseException) -> bool:
    if isinstance(exc, _NoMasterYetError):
        return True
    return isinstance(exc, grpc.RpcError) and exc.code() in _RETRYABLE


class MasterClient:
    """Calls the master's ``GetTask`` / ``ReportTask`` / ``ReportProgress`` / ``GetJobStatus``.

    The master may move: a standby takes over, or a restarted master binds a
    new port. So the client is given a *resolver* that returns the current
    master's address (trainers read it from etcd); when a call finds the
    master unavailable, the client resolves again and retries, with
    exponential backoff and jitter (tenacity), for up to ``retry_s`` seconds.

    Args:
        resolve: returns the current master's ``host:port``; may raise
            :class:`~elasticps.errors.ElasticPSError` while there is none.
        rpc_timeout_s: deadline of one call, seconds.
        retry_s: total time to keep retrying while no master answers, seconds.
        max_backoff_s: longest wait between two attempts, seconds.
        secret: the job secret whose token every call carries
            (:meth:`~elasticps.security.JobSecret.grpc_token`); None: this
            process's (:func:`~elasticps.security.secret_from_env`).
        tls: the channel's TLS setup (:mod:`elasticps.tls`): the master must show
            a ``master`` certificate of the job's CA, and is shown this role's;
            None: this process's (:func:`~elasticps.tls.tls_from_env`).
    """

    def __init__(
        self,
        resolve: str | Callable[[], str],
        *,
        rpc_timeout_s: float = 10.0,
        retry_s: float = 60.0,
        max_backoff_s: float = 0.5,
        secret: JobSecret | None = None,
        tls: JobTLS | None = None,
    ) -> None:
        job_secret = secret_or_env(secret)
        job_tls = tls if tls is not None else tls_from_env()
        self._credentials = None if job_tls is None else job_tls.grpc_channel_credentials()
        self._metadata: tuple[tuple[str, str], ...] = (
            () if job_secret is None else ((TOKEN_METADATA, job_secret.grpc_token()),)
        )
        self._resolve: Callable[[], str] = (
            (lambda: resolve) if isinstance(resolve, str) else resolve
        )
        self._rpc_timeout_s = rpc_timeout_s
        self._lock = threading.Lock()
        self.address: str | None = None
        self._channel: grpc.Channel | None = None
        self._stub: master_pb2_grpc.MasterStub | None = None
        self._retired: list[grpc.Channel] = []  # replaced channels, closed by close()
        self._retrying = tenacity.Retrying(
            retry=tenacity.retry_if_exception(_is_retryable),
            wait=tenacity.wait_random_exponential(multiplier=0.02, max=max_backoff_s),
            stop=tenacity.stop_after_delay(retry_s),
            reraise=True,
        )

    def close(self) -> None:
        """Close the channel."""
        with self._lock:
            for channel in [*self._retired, self._channel]:
                if channel is not None:
                    channel.close()
            self._retired.clear()
            self._channel = self._stub = None

    def get_task(
        self, trainer_id: str, holding: Sequence[int] = (), *, wait_for_work: bool = False
    ) -> master_pb2.GetTaskResponse:
        """Ask for a task; while holding tasks (their ids), for the one to train after them.

        With ``wait_for_work`` (an async trainer with nothing to do) the
        master may hold the call while other trainers finish the pass's last
        tasks (see ``GetTaskRequest.wait_for_work``), up to half a second.

        Raises:
            UnknownTrainerError: ``trainer_id`` holds no live registration in etcd.
            ServiceUnavailableError: no master answered within the retry budget.
        """
        reply = self._call(
            "GetTask",
            master_pb2.GetTaskRequest(
                trainer_id=trainer_id, holding=holding, wait_for_work=wait_for_work
            ),
        )
        assert isinstance(reply, master_pb2.GetTaskResponse)
        return reply

    def report_task(
        self, request: master_pb2.ReportTaskRequest
    ) -> master_pb2.GetTaskResponse | None:
        """Report a task attempt's outcome.

        Returns:
            With ``request.get_next`` (and ``success``), the next task as
            :meth:`get_task` would answer it; None without, or from a master
            that does not know ``get_next``.

        Raises:
            StaleTaskError: the attempt timed out and was re-dispatched (or, on
                a retry, the first call was applied); nothing was dispatched.
            UnknownTaskError: the master does not know the task.
            UnknownTrainerError: the trainer holds no live registration in etcd.
            ServiceUnavailableError: no master answered within the retry budget.
        """
        reply = self._call("ReportTask", request)
        assert isinstance(reply, master_pb2.ReportTaskResponse)
        if not reply.HasField("next") or reply.next.WhichOneof("result") is None:
            return None
        return reply.next

    def report_progress(self, request: master_pb2.ReportProgressRequest) -> None:
        """Report the records of a task trained and acknowledged so far.

        Raises:
            StaleTaskError: the attempt is no longer current.
            UnknownTaskError: the master does not know the task.
            UnknownTrainerError: the trainer holds no live registration in etcd.
            ServiceUnavailableError: no master answered within the retry budget.
        """
        self._call("ReportProgress", request)

    def job_status(self) -> master_pb2.JobStatus:
        """The job's progress counters."""
        reply = self._call("GetJobStatus", master_pb2.GetJobStatusRequest())
        assert isinstance(reply, master_pb2.JobStatus)
        return reply

    def _stub_now(self) -> master_pb2_grpc.MasterStub:
        with self._lock:
            if self._stub is None:
                try:
                    address = self._resolve()
                except ElasticPSError as exc:
                    # No master right now (failover in progress): retry later.
                    raise _NoMasterYetError(str(exc)) from exc
                self.address = address
                if self._credentials is None:
                    self._channel = grpc.insecure_channel(address)
                else:
                    self._channel = grpc.secure_channel(
                        address,
                        self._credentials,
                        options=(("grpc.ssl_target_name_override", role_host("master")),),
                    )
                self._stub = master_pb2_grpc.MasterStub(self._channel)  # type: ignore[no-untyped-call]
            return self._stub

    def _forget(self, stub: master_pb2_grpc.MasterStub) -> None:
        with self._lock:
            if self._stub is stub and self._channel is not None:
                # Not closed here: another thread (the progress reporter) may
                # have a call in flight on it, which closing would cancel.
                self._retired.append(self._channel)
                self._channel = self._stub = None

    def _attempt(self, method: str, request: object) -> object:
        stub = self._stub_now()
        if isinstance(request, master_pb2.GetTaskRequest) or (
            isinstance(request, master_pb2.ReportTaskRequest) and request.get_next
        ):
            # Each attempt a new number: the master refuses an earlier attempt
            # that reaches it after a later one (see GetTaskRequest.ask).
            request.ask = next(_ASKS)
        try:
            return getattr(stub, method)(
                request, timeout=self._rpc_timeout_s, metadata=self._metadata
            )
        except grpc.RpcError as exc:
            if _is_retryable(exc):
                self._forget(stub)  # resolve the master again on the next attempt
            raise

    def _call(self, method: str, request: object) -> object:
        try:
            return self._retrying(self._attempt, method, request)
        except _NoMasterYetError as exc:
            raise ServiceUnavailableError(f"no master is available: {exc}") from exc
        except grpc.RpcError as exc:
            if _is_retryable(exc):
                raise ServiceUnavailableError(
                    f"master at {self.address} is unavailable: {exc.details()}"
                ) from exc
            if exc.code() is grpc.StatusCode.FAILED_PRECONDITION:
                raise StaleTaskError(exc.details()) from exc
            if exc.code() is grpc.StatusCode.NOT_FOUND:
                raise UnknownTaskError(exc.details()) from exc
            if exc.code() is grpc.StatusCode.PERMISSION_DENIED:
                raise UnknownTrainerError(exc.details()) from exc
            if exc.code() is grpc.StatusCode.UNAUTHENTICATED:
                raise AuthenticationError("bad_token", f"master: {exc.details()}") from exc
            raise


class _NoMasterYetError(ElasticPSError):
    """The resolver found no master (retryable)."""
