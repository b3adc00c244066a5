"""Jobs across hosts: the main job on three namespace hosts against one machine, and host loss.

Makes three hosts in network namespaces (:class:`elasticps.testing.hosts.NamespaceHosts`:
own network stack, hostname and sshd each, one file system), then prints one
JSON line per run and a summary line:

- ``case: "main-job"``: the README's main job (MNIST CNN, 2 trainers, 2 PS,
  sync, ``--epochs``), alternately on this machine (``where: "one-machine"``)
  and with ``--hosts`` over ssh (``where: "3-hosts"``), ``--reps`` times each:
  ``samples_per_s`` is the job's ``samples_trained`` over its ``wall_s``
  (launch to final checkpoint), ``accuracy`` its test accuracy.
- ``case: "host-loss"``: the audit model (one counter per record, async or
  sync) on the hosts; once a shard checkpoint exists, the host of the first
  PS is killed (link down, every process SIGKILLed). ``to_first_gradient_s``
  is the time from the kill to the re-placed PS's log line
  ``first gradient accepted by this server``; ``exact`` says whether every
  counter came out exact. ``to_restart_s`` is when the launcher saw the PS's
  session end, ``to_ps_placed_s`` when it started the PS on another host.
  ``start_s`` is the time from the launch to the first trained samples, and
  ``training_samples_per_s`` the rate from then to the end (the launcher's
  timeline in ``run.json``).
- ``case: "summary"``: ``hosts_over_one_machine`` and
  ``training_hosts_over_one_machine``, the ratios of the medians.

The hosts share this machine's cores: the ratio shows the cost of ssh, TCP
between network namespaces and placement, not the gain of more machines.

With ``--tls`` it runs instead the main job on the hosts alternately with
``--tls on`` (every TCP connection between hosts in TLS 1.3) and ``--tls off``
(plain TCP), ``--reps`` times each, with ``--ps-transport tcp`` so that every
push and pull is a TCP one (``case: "tls"``), and a summary with
``tls_over_plain`` and ``training_tls_over_plain`` (``case: "tls-summary"``).

With ``--soak N`` it runs instead one long audit job (``--mode``) under N
host faults, one every 8-15 s (``--seed``): a host killed (link down, every
process SIGKILLed, back 10 s later as after a reboot) or its link cut for
4-12 s, and prints the faults, the job's result and whether every counter
came out exact (``case: "soak"``). A correctness test, not a measurement.
``--workdir DIR`` keeps the jobs' outputs and logs (default: a temporary
directory, removed).

Usage (as root, with ``scripts/install-system-packages.sh`` run)::

    .venv/bin/python benchmarks/hosts.py                # 3 reps, 5 epochs
    .venv/bin/python benchmarks/hosts.py --quick        # 1 rep, 1 epoch, one host loss
    .venv/bin/python benchmarks/hosts.py --soak 20 --mode async --seed 1
    .venv/bin/python benchmarks/hosts.py --tls --reps 3 --epochs 3
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from elasticps.testing import kill_leftovers, wait_for_shard_checkpoint
from elasticps.testing.audit import check_run, train_args, write_dataset
from elasticps.testing.hosts import NamespaceHosts, unavailable

ROOT = Path(__file__).resolve().parents[1]
_RESTART = re.compile(r"^(\S+ \S+) INFO .*ps-\d+ \(pid \d+\) exit 255; restarting", re.MULTILINE)
_PLACED = re.compile(r"^(\S+ \S+) INFO train elasticps.launcher.ssh: started ps on", re.MULTILINE)
_FIRST = re.compile(r"^(\S+ \S+) INFO ps \S+: ps \d+: first gradient accepted", re.MULTILINE)


def train(args: list[str], out: Path) -> dict[str, object]:
    proc = subprocess.run(
        [sys.executable, "-m", "elasticps", "train", *args, "--output", str(out),
         "--overwrite", "--no-progress"],
        capture_output=True, text=True, timeout=900, check=False,
    )  # fmt: skip
    kill_leftovers(out / "pids.json")
    if proc.returncode != 0:
        raise SystemExit(f"the job failed: {proc.stderr[-2000:]}")
    result: dict[str, object] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def timeline(out: Path) -> tuple[float, float]:
    """From the launcher's timeline in ``run.json``: seconds from the start to the first
    trained samples, and samples/s from then to the end."""
    points = json.loads((out / "run.json").read_text())["timeline"]
    first = next(p for p in points if p[2] > 0)
    last = points[-1]
    rate = (last[2] - first[2]) / (last[0] - first[0]) if last[0] > first[0] else 0.0
    return round(first[0] - points[0][0], 2), round(rate, 1)


def _stamp(text: str) -> float:
    return datetime.datetime.strptime(text, "%Y-%m-%d %H:%M:%S,%f").timestamp()


def main_job(
    hosts: NamespaceHosts, host_file: Path, work: Path, epochs: int, reps: int
) -> tuple[float, float]:
    data = work / "mnist"
    subprocess.run([sys.executable, "-m", "elasticps", "data", "mnist", "--output", str(data)],
                   check=True, capture_output=True, timeout=300)  # fmt: skip
    job = ["--model", str(ROOT / "examples" / "mnist_cnn.py"), "--data", str(data),
           "--trainers", "2", "--ps", "2", "--mode", "sync", "--epochs", str(epochs)]  # fmt: skip
    over_ssh = ["--hosts", str(host_file), "--ssh-config", str(hosts.ssh_config)]
    rates: dict[str, list[float]] = {"one-machine": [], "3-hosts": []}
    training: dict[str, list[float]] = {"one-machine": [], "3-hosts": []}
    for rep in range(reps):
        for where, extra in (("one-machine", []), ("3-hosts", over_ssh)):
            result = train([*job, *extra], work / where)
            rate = float(str(result["samples_trained"])) / float(str(result["wall_s"]))
            rates[where].append(rate)
            start_s, training_rate = timeline(work / where)
            training[where].append(training_rate)
            print(json.dumps({"case": "main-job", "where": where, "rep": rep,
                              "samples_per_s": round(rate, 1), "wall_s": result["wall_s"],
                              "start_s": start_s, "training_samples_per_s": training_rate,
                              "accuracy": result.get("accuracy")}), flush=True)  # fmt: skip
    return (
        statistics.median(rates["3-hosts"]) / statistics.median(rates["one-machine"]),
        statistics.median(training["3-hosts"]) / statistics.median(training["one-machine"]),
    )


def tls_compare(
    hosts: NamespaceHosts, host_file: Path, work: Path, epochs: int, reps: int
) -> dict[str, float]:
    """The main job on the hosts over TCP only, with TLS on and off, interleaved."""
    data = work / "mnist"
    if not data.exists():
        subprocess.run([sys.executable, "-m", "elasticps", "data", "mnist", "--output", str(data)],
                       check=True, capture_output=True, timeout=300)  # fmt: skip
    job = ["--model", str(ROOT / "examples" / "mnist_cnn.py"), "--data", str(data),
           "--trainers", "2", "--ps", "2", "--mode", "sync", "--epochs", str(epochs),
           "--ps-transport", "tcp",
           "--hosts", str(host_file), "--ssh-config", str(hosts.ssh_config)]  # fmt: skip
    rates: dict[str, list[float]] = {"on": [], "off": []}
    training: dict[str, list[float]] = {"on": [], "off": []}
    for rep in range(reps):
        for tls in ("on", "off") if rep % 2 == 0 else ("off", "on"):
            out = work / f"tls-{tls}"
            result = train([*job, "--tls", tls], out)
            rate = float(str(result["samples_trained"])) / float(str(result["wall_s"]))
            rates[tls].append(rate)
            start_s, training_rate = timeline(out)
            training[tls].append(training_rate)
            print(json.dumps({"case": "tls", "tls": tls, "rep": rep,
                              "samples_per_s": round(rate, 1), "wall_s": result["wall_s"],
                              "start_s": start_s, "training_samples_per_s": training_rate,
                              "accuracy": result.get("accuracy")}), flush=True)  # fmt: skip
    return {
        "tls_over_plain": round(
            statistics.median(rates["on"]) / statistics.median(rates["off"]), 3
        ),
        "training_tls_over_plain": round(
            statistics.median(training["on"]) / statistics.median(training["off"]), 3
        ),
    }


def host_loss(hosts: NamespaceHosts, host_file: Path, work: Path, mode: str) -> None:
    audit = work / "audit"
    if not audit.exists():
        write_dataset(audit, 4000)
    out = work / f"loss-{mode}"
    epochs = 200
    proc = subprocess.Popen(
        [sys.executable, "-m", "elasticps", "train", *train_args(audit, out, mode, epochs),
         "--overwrite", "--no-progress",
         "--hosts", str(host_file), "--ssh-config", str(hosts.ssh_config)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        wait_for_shard_checkpoint(out)
        log = (out / "logs" / "launcher.log").read_text()
        victim = re.findall(r"started ps on (h\d+)", log)[0]
        killed_at = time.time()
        hosts.cut_link(victim)
        hosts.kill_host(victim)
        stdout, stderr = proc.communicate(timeout=900)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
        kill_leftovers(out / "pids.json")
        hosts.restore_link(victim)
        hosts.revive(victim)
    if proc.returncode != 0:
        raise SystemExit(f"the host-loss job failed: {stderr[-2000:]}")
    firsts = []
    for path in (out / "logs").glob("ps-*.log"):
        for stamp in _FIRST.findall(path.read_text()):
            when = _stamp(stamp)
            if when > killed_at:
                firsts.append(when)
    log = (out / "logs" / "launcher.log").read_text()
    seen = [_stamp(m) for m in _RESTART.findall(log)]
    placed = [_stamp(m) for m in _PLACED.findall(log) if _stamp(m) > killed_at]
    # The re-placed PS's first gradient (a surviving PS may log its own again).
    firsts = [when for when in firsts if placed and when > min(placed)]
    audit_result = check_run(out)
    print(json.dumps({"case": "host-loss", "mode": mode, "host": victim,
                      "to_restart_s": round(min(seen) - killed_at, 2) if seen else None,
                      "to_ps_placed_s": round(min(placed) - killed_at, 2) if placed else None,
                      "to_first_gradient_s": round(min(firsts) - killed_at, 2) if firsts else None,
                      "exact": audit_result.exactly_once,
                      "samples_trained": json.loads(stdout.splitlines()[-1])["samples_trained"]}),
          flush=True)  # fmt: skip


def soak(
    hosts: NamespaceHosts, host_file: Path, work: Path, *, mode: str, faults: int, seed: int
) -> None:
    rng = random.Random(seed)
    audit = work / "audit"
    write_dataset(audit, 4000)
    out = work / "soak"
    epochs = faults * 70  # about 0.15 s a pass: the job outlasts the faults
    # The launcher's stderr goes to a file: a pipe nobody reads during the soak fills up.
    stderr_file = (work / "soak-stderr.txt").open("w+")
    proc = subprocess.Popen(
        [sys.executable, "-m", "elasticps", "train", *train_args(audit, out, mode, epochs),
         "--max-restarts", "100", "--no-progress",
         "--hosts", str(host_file), "--ssh-config", str(hosts.ssh_config)],
        stdout=subprocess.PIPE, stderr=stderr_file, text=True,
    )  # fmt: skip
    done: list[dict[str, object]] = []
    started = time.monotonic()
    try:
        wait_for_shard_checkpoint(out)
        for _ in range(faults):
            time.sleep(rng.uniform(8, 15))
            if proc.poll() is not None:
                break
            name = rng.choice(sorted(hosts.hosts))
            at = round(time.monotonic() - started, 1)
            if rng.random() < 0.5:
                hosts.cut_link(name)
                hosts.kill_host(name)
                time.sleep(10)
                hosts.restore_link(name)
                hosts.revive(name)
                done.append({"at_s": at, "fault": "kill", "host": name})
            else:
                cut_s = rng.uniform(4, 12)
                hosts.cut_link(name)
                time.sleep(cut_s)
                hosts.restore_link(name)
                done.append({"at_s": at, "fault": "cut", "host": name, "for_s": round(cut_s, 1)})
        stdout, _ = proc.communicate(timeout=1800)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
        kill_leftovers(out / "pids.json")
        for name in hosts.hosts:
            hosts.restore_link(name)
            hosts.revive(name)
        stderr_file.seek(0)
        stderr = stderr_file.read()
        stderr_file.close()
    result = json.loads(stdout.splitlines()[-1]) if proc.returncode == 0 else None
    record = json.loads((out / "run.json").read_text())
    audit_result = check_run(out) if proc.returncode == 0 else None
    print(json.dumps({
        "case": "soak", "mode": mode, "seed": seed, "rc": proc.returncode,
        "faults": done, "kills": sum(f["fault"] == "kill" for f in done),
        "cuts": sum(f["fault"] == "cut" for f in done),
        "restarts": record.get("restarts"), "wall_s": round(time.monotonic() - started, 1),
        "passes": epochs, "result": result,
        "audit": audit_result.as_dict() if audit_result else None,
        "error": stderr.strip().splitlines()[-1] if proc.returncode else "",
    }), flush=True)  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="1 rep, 1 epoch, one host loss")
    parser.add_argument(
        "--soak",
        type=int,
        default=0,
        metavar="N",
        help="instead: one audit job under N host faults",
    )
    parser.add_argument(
        "--tls", action="store_true", help="instead: the main job with --tls on against off"
    )
    parser.add_argument("--mode", choices=("sync", "async"), default="async")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--workdir", type=Path, default=None, help="keep the jobs' outputs and logs here"
    )
    args = parser.parse_args()
    why = unavailable()
    if why is not None:
        print(json.dumps({"case": "skipped", "why": why}))
        return 0
    reps, epochs = (1, 1) if args.quick else (args.reps, args.epochs)
    with contextlib.ExitStack() as stack:
        if args.workdir is None:
            work = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="eps-bench-hosts-")))
        else:
            work = args.workdir
            work.mkdir(parents=True, exist_ok=True)
        hosts = stack.enter_context(NamespaceHosts(3))
        host_file = work / "hosts.txt"
        host_file.write_text("".join(f"{name} slots=3\n" for name in hosts.hosts))
        if args.soak:
            soak(hosts, host_file, work, mode=args.mode, faults=args.soak, seed=args.seed)
            return 0
        if args.tls:
            ratios = tls_compare(hosts, host_file, work, epochs, reps)
            print(json.dumps({"case": "tls-summary", **ratios}))
            return 0
        ratio, training_ratio = main_job(hosts, host_file, work, epochs, reps)
        for mode in ("async",) if args.quick else ("async", "sync"):
            host_loss(hosts, host_file, work, mode)
        summary = {"case": "summary", "hosts_over_one_machine": round(ratio, 3),
                   "training_hosts_over_one_machine": round(training_ratio, 3)}  # fmt: skip
        print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
