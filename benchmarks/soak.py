"""Soak test: one long job under a steady rain of SIGKILLs.

Runs ``elasticps train`` as a subprocess (3 trainers, 2 PS, a standby
master, ``--max-restarts 100``, lease TTL 2 s by default) while random
processes of the job are SIGKILLed at random moments, and prints one JSON
line per run:

- ``rc``, ``wall_s``, ``error`` (the launcher's last line if it failed);
- ``kills`` by role and ``kills_total``; ``damaged_files`` (``--damage``:
  checkpoint files damaged after a PS kill), ``records_repaired`` and
  ``records_lost`` from ``run.json``; ``restarts`` (the launcher's
  ``restarts`` and ``etcd_restarts`` from ``run.json``) and
  ``trainers_replaced`` (trainers the worker manager created beyond the first);
- ``passes_audited`` / ``passes_expected``: pass audits found in ``run.json``
  vs ``--epochs``, and ``passes_missing``;
- ``samples_trained`` (the job's own figure) vs ``samples_expected``
  (``--epochs`` x rows), and ``exactly_once`` as ``run.json`` reports it;
- ``check``: the post-job check of the final parameters, if the model has one
  (:data:`CHECKS`; ``--model audit`` uses :mod:`elasticps.testing.audit`: every
  record's counter must equal the number of passes).

Who kills (``--killer``):

- ``launcher`` (default): the launcher's own random chaos,
  ``--chaos random:every=LOW-HIGHs,roles=...,seed=S``: one random process of
  a random role (``trainer``, ``ps``, ``master``: the active one, ``standby``:
  a standby master, ``etcd``) a random delay after the job recovered from the
  previous kill (every server runs again and a task was done), while the job
  trains;
- ``external``: this script, from outside, any process named in the job's
  ``pids.json`` (a master is active or standby alike), every ``LOW-HIGH``
  seconds without waiting for recovery, and on until the launcher exits:
  faults do not stop because training ended, so the end of the job (final
  checkpoint, reading the ledger) is under fire too.

Usage::

    .venv/bin/python benchmarks/soak.py                      # sync MLP, 150 passes
    .venv/bin/python benchmarks/soak.py --mode async --epochs 50 --seed 2
    .venv/bin/python benchmarks/soak.py --model audit --killer external
    .venv/bin/python benchmarks/soak.py --model audit --damage 0.5 --kills 60
    .venv/bin/python benchmarks/soak.py --quick              # a short smoke run

This is a stress test of correctness, not a measurement: figures of a run on a
shared machine say nothing about speed.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODELS = {
    "mlp": ROOT / "examples" / "mnist_mlp.py",
    "cnn": ROOT / "examples" / "mnist_cnn.py",
}
ROLES = ("trainer", "ps", "master", "standby", "etcd")


@dataclass(frozen=True)
class Dataset:
    """What a model trains on: the data directory, its model file and row count."""

    data: Path
    model: Path
    rows: int
    extra: tuple[str, ...] = ()


PostCheck = Callable[[Path, int], dict[str, object]]


def audit_check(out: Path, epochs: int) -> dict[str, object]:
    """The audit model's check: every record's counter equals the number of passes."""
    from elasticps.testing.audit import check_run

    return check_run(out, epochs).as_dict()


CHECKS: dict[str, PostCheck] = {
    "audit": audit_check,
    "audit-sparse": audit_check,
    "audit-shared": audit_check,
}
"""Post-job checks of the final parameters, by ``--model`` name."""


def prepare(model: str, work: Path, audit_records: int) -> Dataset:
    """The data set and model file of ``--model`` (built under ``work``)."""
    if model in ("audit", "audit-sparse", "audit-shared"):
        from elasticps.testing.audit import DEFAULT_RECORDS, write_dataset

        if audit_records != DEFAULT_RECORDS and model == "audit-sparse":
            raise SystemExit(f"soak: the sparse audit model holds {DEFAULT_RECORDS} rows")
        data = work / "audit"
        write_dataset(data, audit_records)
        return Dataset(
            data,
            data / "audit_model.py",
            audit_records,
            # The settings that make the audit exact (see elasticps.testing.audit).
            ("--optimizer", "sgd", "--lr", "1", "--sync-reduction", "sum",
             "--big-array-bound", str(max(1, audit_records // 8)),
             # A counter per record (32,768 or more make a paged layout on 2 PS).
             *(("--model-args", json.dumps({"records": audit_records}))
               if audit_records != DEFAULT_RECORDS else ()),
             # The sparse variant: one row of a sparse table per record.
             *(("--model-class", "SparseModel") if model == "audit-sparse" else ()),
             # The tied variant: the counters reached through two names.
             *(("--model-class", "SharedModel") if model == "audit-shared" else ())),
        )  # fmt: skip
    data = work / "mnist"
    if not (data / "train.parquet").exists():
        subprocess.run(
            [sys.executable, "-m", "elasticps", "data", "mnist", "--output", str(data)],
            check=True,
            capture_output=True,
        )
    import pyarrow.parquet as pq

    rows = pq.ParquetFile(data / "train.parquet").metadata.num_rows
    path = MODELS.get(model, Path(model))
    if not path.exists():
        raise SystemExit(f"soak: --model {model}: no such model file")
    return Dataset(data, path.resolve(), rows)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class ExternalKiller:
    """SIGKILLs random processes named in a job's ``pids.json`` until stopped."""

    def __init__(
        self, pids_file: Path, every_s: tuple[float, float], roles: tuple[str, ...], seed: int
    ) -> None:
        self._pids_file = pids_file
        self._every_s = every_s
        self._roles = tuple("master" if r == "standby" else r for r in roles)
        self._rng = random.Random(seed)
        self._stop = threading.Event()
        self.kills: list[dict[str, object]] = []
        self._thread = threading.Thread(target=self._run, name="external-killer", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def _victims(self) -> dict[str, list[int]]:
        try:
            named = json.loads(self._pids_file.read_text())
        except (OSError, ValueError):
            return {}
        by_role: dict[str, list[int]] = collections.defaultdict(list)
        for name, pid in named.items():
            role = name.split("-", 1)[0].split(".", 1)[0]
            if role in self._roles and isinstance(pid, int) and _alive(pid):
                by_role[role].append(pid)
        return by_role

    def _run(self) -> None:
        started = time.monotonic()
        while not self._stop.wait(self._rng.uniform(*self._every_s)):
            victims = self._victims()
            if not victims:
                continue
            role = self._rng.choice(sorted(victims))
            pid = self._rng.choice(sorted(victims[role]))
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            self.kills.append(
                {"target": role, "pid": pid, "at_s": round(time.monotonic() - started, 3)}
            )


def _stop_leftovers(pids_file: Path) -> list[int]:
    """SIGKILL every process of the job still alive (by pid); return them."""
    left: list[int] = []
    with contextlib.suppress(OSError, ValueError):
        for pid in json.loads(pids_file.read_text()).values():
            if isinstance(pid, int) and _alive(pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
                left.append(pid)
    return left


def run_once(args: argparse.Namespace, dataset: Dataset, out: Path, seed: int) -> dict[str, object]:
    """One soak run; returns its JSON line."""
    low, high = args.every
    roles = tuple(args.roles.split("+"))
    cmd = [
        sys.executable, "-m", "elasticps", "train",
        "--model", str(dataset.model), "--data", str(dataset.data), "--output", str(out),
        "--trainers", str(args.trainers), "--ps", str(args.ps),
        "--standby-masters", str(args.standby_masters), "--max-restarts", str(args.max_restarts),
        "--mode", args.mode, "--epochs", str(args.epochs),
        "--records-per-task", str(args.records_per_task), "--lease-ttl-s", str(args.lease_ttl_s),
        "--checkpoint-every-s", "1", "--seed", str(seed), "--no-progress", *dataset.extra,
    ]  # fmt: skip
    if args.killer == "launcher":
        chaos = f"random:every={low:g}-{high:g}s,roles={'+'.join(roles)},seed={seed}"
        if args.kills is not None:
            chaos += f",kills={args.kills}"
        if args.damage:
            chaos += f",damage={args.damage:g}"
        cmd += ["--chaos", chaos]
    killer = (
        ExternalKiller(out / "pids.json", (low, high), roles, seed)
        if args.killer == "external"
        else None
    )
    started = time.monotonic()
    log_path = out.parent / f"{out.name}.log"
    with log_path.open("w") as log_file:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log_file, text=True)
        if killer is not None:
            killer.start()
        try:
            stdout, _ = proc.communicate(timeout=args.timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            stdout, _ = proc.communicate()
        finally:
            if killer is not None:
                killer.stop()
            leftovers = _stop_leftovers(out / "pids.json")
    wall_s = time.monotonic() - started
    record: dict[str, object] = {}
    with contextlib.suppress(OSError, ValueError):
        record = json.loads((out / "run.json").read_text())
    lines = stdout.strip().splitlines()
    summary: dict[str, object] = {}
    with contextlib.suppress(ValueError, IndexError):
        summary = json.loads(lines[-1])
    kills = killer.kills if killer is not None else _list(record.get("chaos"))
    by_role = collections.Counter(
        str(k.get("target")).split("-")[0] for k in kills if isinstance(k, dict)
    )
    damaged = sum(
        len(_list(k.get("files")))
        for k in kills
        if isinstance(k, dict) and k.get("action") == "damage"
    )
    passes = _list(record.get("passes"))
    audited = sorted(int(str(p.get("pass_id"))) for p in passes if isinstance(p, dict))
    scaling = _list(record.get("scaling"))
    created = sum(1 for s in scaling if isinstance(s, dict) and s.get("action") == "create")
    line: dict[str, object] = {
        "model": args.model,
        "mode": args.mode,
        "killer": args.killer,
        "seed": seed,
        "rc": proc.returncode,
        "wall_s": round(wall_s, 1),
        "kills_total": sum(by_role.values()),
        "kills": dict(sorted(by_role.items())),
        "restarts": record.get("restarts", {}),
        "etcd_restarts": record.get("etcd_restarts", 0),
        "trainers_replaced": max(0, created - args.trainers),
        "passes_audited": len(audited),
        "passes_expected": args.epochs,
        "passes_missing": sorted(set(range(args.epochs)) - set(audited))[:20],
        "samples_trained": summary.get("samples_trained"),
        "samples_expected": args.epochs * dataset.rows,
        "exactly_once": record.get("exactly_once"),
        "damaged_files": damaged,
        "records_repaired": record.get("records_repaired"),
        "records_lost": record.get("records_lost"),
        "leftover_processes": len(leftovers),
    }
    if proc.returncode != 0:
        with contextlib.suppress(OSError):
            tail = log_path.read_text().strip().splitlines()
            line["error"] = tail[-1] if tail else ""
    check = CHECKS.get(args.model)
    if check is not None and proc.returncode == 0:
        try:
            line["check"] = check(out, args.epochs)
        except Exception as exc:  # report it in the line, do not stop the soak
            line["check"] = {"error": f"{type(exc).__name__}: {exc}"}
    line["ok"] = bool(
        proc.returncode == 0
        and line["passes_audited"] == args.epochs
        and line["samples_trained"] == line["samples_expected"]
        and not leftovers
        and (check is None or _check_ok(line.get("check")))
    )
    return line


def _check_ok(check: object) -> bool:
    return isinstance(check, dict) and bool(check.get("exactly_once"))


def _list(value: object) -> list[object]:
    return value if isinstance(value, list) else []


def _every(text: str) -> tuple[float, float]:
    low, _, high = text.removesuffix("s").partition("-")
    return float(low), float(high or low)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument(
        "--model",
        default="mlp",
        help="mlp, cnn, audit (exact per-record check), audit-sparse (the same, with the "
        "counters as rows of a sparse table), audit-shared (the same, with the counters "
        "reached through two names, as tied weights are), or a model file",
    )
    parser.add_argument("--mode", choices=("sync", "async"), default="sync")
    parser.add_argument("--epochs", type=int, default=150)
    parser.add_argument("--trainers", type=int, default=3)
    parser.add_argument("--ps", type=int, default=2)
    parser.add_argument("--standby-masters", type=int, default=1)
    parser.add_argument("--max-restarts", type=int, default=100)
    parser.add_argument("--lease-ttl-s", type=float, default=2.0)
    parser.add_argument("--records-per-task", type=int, default=200)
    parser.add_argument(
        "--audit-records",
        type=int,
        default=4000,
        help="records (and counters) of the audit data set; audit-sparse: 4000 only",
    )
    parser.add_argument(
        "--every", type=_every, default=(0.75, 2.25), help="seconds between kills, LOW-HIGH"
    )
    parser.add_argument("--roles", default="+".join(ROLES), help="roles to kill, joined by +")
    parser.add_argument("--kills", type=int, default=None, help="stop after N kills")
    parser.add_argument(
        "--damage",
        type=float,
        default=0.0,
        help="launcher killer: probability that a killed PS's newest checkpoint file is "
        "then damaged (64 bytes flipped)",
    )
    parser.add_argument("--killer", choices=("launcher", "external"), default="launcher")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--runs", type=int, default=1, help="runs, with seeds seed, seed+1, ...")
    parser.add_argument("--timeout-s", type=float, default=3600.0)
    parser.add_argument("--keep", type=Path, default=None, help="keep run directories here")
    parser.add_argument("--quick", action="store_true", help="a short smoke run (5 passes)")
    args = parser.parse_args(argv)
    if args.quick:
        args.epochs, args.kills = 5, 4
    with tempfile.TemporaryDirectory(prefix="elasticps-soak-") as tmp:
        work = args.keep if args.keep is not None else Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        dataset = prepare(args.model, work, args.audit_records)
        failures = 0
        for i in range(args.runs):
            seed = args.seed + i
            line = run_once(args, dataset, work / f"run-{seed}", seed)
            failures += not line["ok"]
            print(json.dumps(line), flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
