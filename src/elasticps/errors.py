"""The one exception tree of elasticps.

Every error elasticps raises on purpose derives from :class:`ElasticPSError`.
Errors are translated at boundaries (``raise X from exc``): gRPC status codes
in the master service, error frames on the tensor plane, and a one-line
message with a non-zero exit code in the CLI.

``UserError`` and its subclasses are mistakes a user can fix (a missing file,
a bad flag, a model file that breaks the contract). The CLI prints them as one
line, without a traceback, and exits with status 2.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence


def one_line(exc: BaseException, *, with_type: bool = False) -> str:
    """``exc``'s message on one line, for an error message of ours.

    Args:
        exc: the exception.
        with_type: prefix the exception's type name (``"OSError: ..."``).

    Returns:
        The message with its whitespace runs folded to single spaces; the
        type name alone if the message is empty.
    """
    message = " ".join(str(exc).split())
    if not message:
        return type(exc).__name__
    return f"{type(exc).__name__}: {message}" if with_type else message


class ElasticPSError(Exception):
    """Base class of every error raised by elasticps."""


# --- user mistakes: one line, no traceback, exit status 2 -------------------


class UserError(ElasticPSError):
    """A mistake the user can fix; reported as one line without a traceback."""


class ConfigError(UserError, ValueError):
    """A configuration value is invalid (for example ``--trainers 0``)."""


class DataError(UserError):
    """A dataset is missing, unreadable, or does not have the expected columns."""


class ModelContractError(UserError):
    """A model file does not follow the contract of docs/model-contract.md."""


class MissingExtraError(UserError):
    """A command needs an optional part of elasticps that is not installed.

    The message names the extra to install, e.g. ``pip install 'elasticps[kubernetes]'``.
    """


class PortInUseError(UserError):
    """A port the user asked for is already bound by another process."""


class BadRecordError(DataError):
    """A mini-batch could not be trained: the model file raised on it.

    Raised by a trainer when the model file's ``batch_to_tensors``,
    ``forward`` or ``loss`` raises on a mini-batch. The message is one line
    naming the model file and line, the exception, and the task (file and
    row range) the mini-batch came from.
    """


class OutputInUseError(UserError):
    """Another job holds the lock of the output directory (``OUTPUT/.lock``)."""


class CheckpointFailureError(UserError):
    """Checkpoints could not be written for longer than the job allows (a full disk, say).

    The message says where the trained parameters were saved instead, or, if
    that failed too, where the last checkpoints are.
    """


class JobUserError(UserError):
    """A process of the job stopped on a user error (exit status 2).

    The message is that process's own one-line error, prefixed with its role.
    """


# --- protocol and coordination -------------------------------------------


class ProtocolError(ElasticPSError):
    """A message on the wire is malformed; the connection that sent it is closed."""


class FrameError(ProtocolError):
    """A tensor-plane frame header or body failed validation."""


class RemoteError(ElasticPSError):
    """A server answered a request with an error.

    Attributes:
        code: a short machine-readable error code sent by the server.
    """

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code


class AuthenticationError(ElasticPSError):
    """A peer failed authentication, or the two sides disagree on whether to authenticate.

    Attributes:
        reason: a short code: ``bad_mac``, ``refused``, ``short``, ``timeout``, ``peer_uid``,
            ``no_secret`` (the peer asks for one this side lacks),
            ``unauthenticated_server``, ``bad_challenge`` or ``wrong_epoch``.
    """

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


class CoordinationError(ElasticPSError):
    """etcd could not be reached, or a lease, lock or slot claim failed."""


class SteppedDownError(CoordinationError):
    """This master no longer holds the master lock (or cannot prove it does).

    Its ledger write was refused by the fence, its lease is lost, or etcd did
    not accept the write for a whole lease TTL. The master must stop serving:
    its in-memory queue may be ahead of the ledger, which is the truth a
    standby restores from.
    """


class InvalidRecordError(CoordinationError, ValueError):
    """A persisted task record or queue meta record does not have the expected shape.

    Raised by :meth:`TaskQueue.restore`; the message names the task and the field.
    """


class ServiceUnavailableError(ElasticPSError):
    """A peer (master or parameter server) did not answer before a deadline."""


# --- task dispatch and updates ----------------------------------------------


class StaleTaskError(ElasticPSError):
    """A report names a task attempt that is no longer current.

    The attempt timed out and was re-dispatched, or belongs to an earlier pass.
    The report is rejected so that a task is never counted twice.
    """


class UnknownTaskError(ElasticPSError):
    """A report names a task id the master never created."""


class UnknownTrainerError(ElasticPSError):
    """A call to the master names a trainer id that holds no live registration in etcd."""


class LayoutMismatchError(ElasticPSError):
    """A trainer's parameter layout differs from the one a parameter server holds."""


class JobFailedError(ElasticPSError):
    """A process of the job (master, parameter server or trainer) failed.

    Args:
        message: the one-line reason.
        decisions: the job's supervision decisions up to the failure, oldest
            first, each as ``run.json``'s ``decisions`` lists it (``at`` in
            seconds since the epoch, ``role``, ``worker``, ``happened``,
            ``decided``); empty where the raiser kept none.

    Attributes:
        decisions: ``decisions``, as a tuple of dicts.
    """

    def __init__(self, message: str, *, decisions: Sequence[Mapping[str, object]] = ()) -> None:
        super().__init__(message)
        self.decisions: tuple[dict[str, object], ...] = tuple(dict(d) for d in decisions)


class UnschedulableError(ElasticPSError):
    """A backend cannot place a worker now (no capacity, quota); retried with backoff."""


class FrozenParameterError(UserError):
    """A gradient was pushed for a frozen parameter, or a frozen one was asked to change."""


class MissingParameterError(UserError, KeyError):
    """A model needs parameters that a ParameterSet does not have (the message names them)."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class KubernetesError(ElasticPSError):
    """The Kubernetes API refused a request (other than a quota) or could not be reached."""


class KVStoreError(UserError, ValueError):
    """A KVStore call is invalid: unknown or duplicate key, wrong shape, an ``init``
    after the layout was fixed, or a ``dist_*`` push without an optimizer."""


class SparseTableError(UserError, ValueError):
    """A sparse-table call is invalid: an id out of range, duplicate ids in a push,
    gradients of the wrong shape, or state that does not fit the table."""
