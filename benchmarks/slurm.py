"""Jobs on Slurm: the main job on three Slurm nodes against one machine, and node loss.

Makes a test Slurm cluster (:class:`elasticps.testing.slurm.SlurmCluster`: munged
and slurmctld here, a slurmd on each of three network-namespace hosts), then
prints one JSON line per run and a summary line, as ``hosts.py`` does for
``--hosts`` (whose helpers it reuses):

- ``case: "main-job"``: the README's main job (MNIST CNN, 2 trainers, 2 PS,
  sync, ``--epochs``), alternately on this machine (``where: "one-machine"``)
  and with ``train --launcher slurm`` inside ``salloc -N3``
  (``where: "3-slurm-nodes"``), ``--reps`` times each: ``samples_per_s`` is
  ``samples_trained`` over ``wall_s``; ``training_samples_per_s`` the rate
  from the first trained samples to the end.
- ``case: "node-loss"``: the audit model (async) in an allocation of three
  nodes; once a shard checkpoint exists, the node of the first PS is killed
  (link down, every process SIGKILLed, its slurmd too).
  ``to_first_gradient_s`` is the time from the kill to the re-placed PS's
  first accepted gradient, ``to_ps_placed_s`` to the launcher starting it on
  another node; ``exact`` says whether every counter came out exact.
- ``case: "summary"``: ``slurm_over_one_machine`` and
  ``training_slurm_over_one_machine``, the ratios of the medians.

The nodes share this machine's cores: the ratio shows the cost of srun
steps, TCP between namespaces and placement, not the gain of more machines.

Usage (as root, with ``scripts/install-system-packages.sh`` run)::

    .venv/bin/python benchmarks/slurm.py             # 3 reps, 5 epochs
    .venv/bin/python benchmarks/slurm.py --quick     # 1 rep, 1 epoch
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType

from elasticps.testing import kill_leftovers, wait_for_shard_checkpoint
from elasticps.testing.audit import check_run, train_args, write_dataset
from elasticps.testing.slurm import SlurmCluster, unavailable

ROOT = Path(__file__).resolve().parents[1]


def _hosts_bench() -> ModuleType:
    """``benchmarks/hosts.py``, whose job runs and log parsing this reuses."""
    spec = importlib.util.spec_from_file_location("hosts_bench", ROOT / "benchmarks" / "hosts.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


HB = _hosts_bench()


def in_allocation(env: dict[str, str], nodes: int, argv: list[str]) -> list[str]:
    return ["timeout", "900", "salloc", f"-N{nodes}", "--no-kill", "--quiet", *argv]


def train_slurm(env: dict[str, str], args: list[str], out: Path) -> dict[str, object]:
    argv = [sys.executable, "-m", "elasticps", "train", "--launcher", "slurm", *args,
            "--output", str(out), "--overwrite", "--no-progress"]  # fmt: skip
    proc = subprocess.run(in_allocation(env, 3, argv), env=env, capture_output=True, text=True,
                          timeout=960, check=False)  # fmt: skip
    kill_leftovers(out / "pids.json")
    if proc.returncode != 0:
        raise SystemExit(f"the Slurm job failed: {proc.stderr[-2000:]}")
    result: dict[str, object] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def main_job(cluster: SlurmCluster, work: Path, epochs: int, reps: int) -> tuple[float, float]:
    data = work / "mnist"
    subprocess.run([sys.executable, "-m", "elasticps", "data", "mnist", "--output", str(data)],
                   check=True, capture_output=True, timeout=300)  # fmt: skip
    job = ["--model", str(ROOT / "examples" / "mnist_cnn.py"), "--data", str(data),
           "--trainers", "2", "--ps", "2", "--mode", "sync", "--epochs", str(epochs)]  # fmt: skip
    rates: dict[str, list[float]] = {"one-machine": [], "3-slurm-nodes": []}
    training: dict[str, list[float]] = {"one-machine": [], "3-slurm-nodes": []}
    for rep in range(reps):
        for where in ("one-machine", "3-slurm-nodes"):
            out = work / where
            if where == "one-machine":
                result = HB.train(job, out)
            else:
                result = train_slurm(cluster.env(), job, out)
            rate = float(str(result["samples_trained"])) / float(str(result["wall_s"]))
            rates[where].append(rate)
            start_s, training_rate = HB.timeline(out)
            training[where].append(training_rate)
            print(json.dumps({"case": "main-job", "where": where, "rep": rep,
                              "samples_per_s": round(rate, 1), "wall_s": result["wall_s"],
                              "start_s": start_s, "training_samples_per_s": training_rate,
                              "accuracy": result.get("accuracy")}), flush=True)  # fmt: skip
    return (
        statistics.median(rates["3-slurm-nodes"]) / statistics.median(rates["one-machine"]),
        statistics.median(training["3-slurm-nodes"]) / statistics.median(training["one-machine"]),
    )


def node_loss(cluster: SlurmCluster, work: Path, mode: str) -> None:
    audit = work / "audit"
    if not audit.exists():
        write_dataset(audit, 4000)
    out = work / f"loss-{mode}"
    argv = [sys.executable, "-m", "elasticps", "train", "--launcher", "slurm",
            *train_args(audit, out, mode, 100), "--overwrite", "--no-progress"]  # fmt: skip
    proc = subprocess.Popen(in_allocation(cluster.env(), 3, argv), env=cluster.env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    victim = ""
    try:
        wait_for_shard_checkpoint(out)
        log = (out / "logs" / "launcher.log").read_text()
        victim = re.findall(r"started ps on (h\d+)", log)[0]
        killed_at = time.time()
        cluster.kill_node(victim)
        stdout, stderr = proc.communicate(timeout=900)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
        kill_leftovers(out / "pids.json")
        if victim:
            cluster.revive_node(victim)
    if proc.returncode != 0:
        raise SystemExit(f"the node-loss job failed: {stderr[-2000:]}")
    log = (out / "logs" / "launcher.log").read_text()
    placed = [HB._stamp(m) for m in HB._PLACED.findall(log) if HB._stamp(m) > killed_at]
    firsts = []
    for path in (out / "logs").glob("ps-*.log"):
        firsts += [HB._stamp(m) for m in HB._FIRST.findall(path.read_text())]
    firsts = [when for when in firsts if placed and when > min(placed)]
    print(json.dumps({"case": "node-loss", "mode": mode, "node": victim,
                      "to_ps_placed_s": round(min(placed) - killed_at, 2) if placed else None,
                      "to_first_gradient_s": round(min(firsts) - killed_at, 2) if firsts else None,
                      "exact": check_run(out).exactly_once,
                      "samples_trained": json.loads(stdout.splitlines()[-1])["samples_trained"]}),
          flush=True)  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="1 rep, 1 epoch")
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
            work = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="eps-bench-slurm-")))
        else:
            work = args.workdir
            work.mkdir(parents=True, exist_ok=True)
        cluster = stack.enter_context(SlurmCluster(3))
        ratio, training_ratio = main_job(cluster, work, epochs, reps)
        node_loss(cluster, work, "async")
        summary = {"case": "summary", "slurm_over_one_machine": round(ratio, 3),
                   "training_slurm_over_one_machine": round(training_ratio, 3)}  # fmt: skip
        print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
