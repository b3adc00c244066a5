"""Sparse embedding tables in whole jobs: equivalence with dense tables, and recovery.

Every test runs ``elasticps train`` as real local processes (etcd, master,
parameter servers, trainers). The recovery tests use the audit model's
sparse variant (:class:`elasticps.testing.audit.SparseModel`): one row of a
sparse table per record, pulled and pushed by id, so that every applied
gradient adds exactly +1 to a record's row; after P passes every row must
read exactly P, on whichever server holds it.
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from elasticps.checkpoint import load_checkpoint
from elasticps.tables import load_tables
from elasticps.testing import run_elasticps, run_train
from elasticps.testing.audit import AuditResult, check_counters, sparse_counters, write_dataset

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

RECORDS = 4000
JOB_TIMEOUT_S = 200.0


def run_job(out: Path, *args: str, env: dict[str, str] | None = None) -> dict[str, object]:
    """Run ``elasticps train`` to the end; return its run.json with the final line and stderr."""
    line, stderr = run_train(
        ["--output", str(out), *args], pids_file=out / "pids.json", timeout_s=JOB_TIMEOUT_S, env=env
    )
    record: dict[str, object] = json.loads((out / "run.json").read_text())
    record["line"] = line
    record["stderr"] = stderr
    return record


# --- sparse and dense tables train the same parameters ------------------------------------

EQUIVALENCE_MODEL = textwrap.dedent(
    """
    import torch
    from torch import nn

    import elasticps.nn as enn
    from elasticps.pserver.sparse import initial_rows

    COLUMNS = ("ids", "y")
    ROWS, DIM = 50, 4


    class Model(nn.Module):
        \"\"\"Twins: one branch with a torch.nn.Embedding, one with a sparse table, same start.

        The loss is the sum of the branches' losses, so each trains on the same
        mini-batches in the same steps, independently of the other.
        \"\"\"

        def __init__(self):
            super().__init__()
            self.dense_head = nn.Linear(2 * DIM, 1)
            self.sparse_head = nn.Linear(2 * DIM, 1)
            self.dense_emb = nn.Embedding(ROWS, DIM)
            self.sparse_emb = enn.Embedding(ROWS, DIM, name="emb", feature="ids", init_scale=0.5)
            start = initial_rows(self.sparse_emb.spec, torch.arange(ROWS).numpy())
            with torch.no_grad():
                self.dense_emb.weight.copy_(torch.from_numpy(start))
                self.sparse_head.load_state_dict(self.dense_head.state_dict())

        def forward(self, x):
            dense = self.dense_head(self.dense_emb(x["ids"]).flatten(1))[:, 0]
            sparse = self.sparse_head(self.sparse_emb(x["ids"]).flatten(1))[:, 0]
            return torch.stack([dense, sparse], 1)


    def loss(outputs, targets):
        return sum(nn.functional.mse_loss(outputs[:, i], targets) for i in range(2))


    def batch_to_tensors(batch):
        ids = torch.from_numpy(batch.column("ids").combine_chunks().flatten().to_numpy().copy())
        y = torch.from_numpy(batch.column("y").to_numpy().copy())
        return {"ids": ids.reshape(-1, 2)}, y
    """
)


@pytest.mark.parametrize("overlap_pull", ["off", "on"])
def test_sparse_and_dense_tables_train_the_same_parameters_in_sync_mode(
    tmp_path: Path, overlap_pull: str
) -> None:
    """A model with twin branches, one with a torch.nn.Embedding and one with an
    elasticps sparse table starting from the same rows: after a sync job (SGD, 2
    trainers) both branches hold the same parameters, within 1e-5. Lazy SGD
    equals the dense rule on the rows pushed and leaves the others as the dense
    rule does (a zero gradient), and a sync step weights each trainer's rows by
    its samples as it weights the dense gradient.

    One server: with two, a step that one server applies and the other answers
    stale (its generation changed under it) is computed again on fresh
    parameters for the second server only, and the branches' elements are
    spread over the servers differently (a dense table by element range, a
    sparse one by a hash of the id), so such a step moves them differently.
    (AdaGrad and Adam normalise each element by its history, so gradients that
    differ in their last bit, as the two backward passes' sums do, can drift
    further apart than 1e-5; SGD cannot.)

    The same with ``--overlap-pull on`` (pipelined steps): the rows a push
    pulls for the mini-batch after next are those of the same step as the
    dense parameters it computes on."""
    model_file = tmp_path / "model.py"
    model_file.write_text(EQUIVALENCE_MODEL)
    rng = np.random.default_rng(0)
    rows = 600
    ids = rng.zipf(1.5, size=(rows, 2)) % 40  # skewed; rows 40..49 never seen
    y = rng.normal(size=rows).astype(np.float32)
    data = tmp_path / "data"
    data.mkdir()
    table = pa.table({"ids": pa.array(ids.tolist(), pa.list_(pa.int64())), "y": y})
    pq.write_table(table, data / "train.parquet", row_group_size=50)
    run_job(tmp_path / "run", "--model", str(model_file), "--data", str(data),
            "--trainers", "2", "--ps", "1", "--mode", "sync", "--epochs", "2",
            "--batch-size", "20", "--records-per-task", "100", "--optimizer", "sgd",
            "--lr", "0.05", "--overlap-pull", overlap_pull)  # fmt: skip
    params, _ = load_checkpoint(tmp_path / "run")
    assert set(params) == {"dense_head.weight", "dense_head.bias", "sparse_head.weight",
                           "sparse_head.bias", "dense_emb.weight"}  # fmt: skip
    for name in ("weight", "bias"):
        assert not torch.equal(params[f"dense_head.{name}"], torch.zeros(1))
        torch.testing.assert_close(
            params[f"sparse_head.{name}"], params[f"dense_head.{name}"], atol=1e-5, rtol=0
        )
    tables = load_tables(tmp_path / "run" / "snapshot")
    torch.testing.assert_close(
        tables.rows("emb", torch.arange(50)), params["dense_emb.weight"], atol=1e-5, rtol=0
    )
    touched = tables.ids("emb")
    assert torch.equal(touched, torch.from_numpy(np.unique(ids)))  # never-seen rows not stored


# --- evaluation with the trained rows ---------------------------------------------------------

LOOKUP_MODEL = textwrap.dedent(
    """
    import torch
    from torch import nn

    import elasticps.nn as enn

    COLUMNS = ("ids", "y")


    class Model(nn.Module):
        \"\"\"A lookup table: each id's row is its prediction (zero before training).\"\"\"

        def __init__(self):
            super().__init__()
            self.emb = enn.Embedding(20, 1, name="emb", feature="ids", init="zeros")
            self.bias = nn.Parameter(torch.zeros(1))

        def forward(self, x):
            return self.emb(x["ids"])[:, 0] + self.bias


    def loss(outputs, targets):
        return nn.functional.mse_loss(outputs, targets)


    def batch_to_tensors(batch):
        ids = torch.from_numpy(batch.column("ids").to_numpy().astype("int64"))
        y = torch.from_numpy(batch.column("y").to_numpy().astype("float32"))
        return {"ids": ids}, y
    """
)


def test_pass_evaluations_and_evaluate_command_use_the_trained_rows(tmp_path: Path) -> None:
    """A model whose predictions are its sparse rows (zeros before training, so
    a fresh model's test loss is mean(y^2) = 2): the evaluation after the pass
    and ``elasticps evaluate`` on the output directory read the trained rows
    from the checkpoint, and both give the job's final test loss."""
    model_file = tmp_path / "model.py"
    model_file.write_text(LOOKUP_MODEL)
    data = tmp_path / "data"
    data.mkdir()
    for name, rows in (("train", 800), ("test", 100)):
        ids = np.arange(rows) % 20
        y = (ids % 5 - 2).astype(np.float32)  # mean 0, mean square 2
        pq.write_table(pa.table({"ids": ids, "y": y}), data / f"{name}.parquet")
    out = tmp_path / "run"
    record = run_job(out, "--model", str(model_file), "--data", str(data), "--trainers", "1",
                     "--ps", "2", "--mode", "sync", "--epochs", "1", "--batch-size", "20",
                     "--optimizer", "sgd", "--lr", "0.5", "--eval-each-pass")  # fmt: skip
    line = record["line"]
    assert isinstance(line, dict)
    final = float(line["loss"])
    assert final < 0.2, line  # trained rows; fresh ones would give 2.0
    evaluations = record["pass_evaluations"]
    assert isinstance(evaluations, list) and [e["pass_id"] for e in evaluations] == [0]
    assert evaluations[-1]["loss"] == pytest.approx(final, rel=1e-6, abs=1e-9)
    again = run_elasticps(
        ["evaluate", "--model", model_file, "--output", out, "--data", data / "test.parquet"],
        timeout_s=60,
    )
    assert again.returncode == 0, again.stderr[-2000:]
    assert json.loads(again.stdout)["loss"] == pytest.approx(final, rel=1e-6, abs=1e-9)


# --- exactly-once with sparse rows, through failures -----------------------------------------


@pytest.fixture(scope="module")
def audit_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("audit")
    write_dataset(out, RECORDS)
    return out


def run_audit(
    audit_dir: Path,
    out: Path,
    mode: str,
    *,
    epochs: int = 2,
    ps: int = 2,
    extra: tuple[str, ...] = (),
    env: dict[str, str] | None = None,
) -> tuple[dict[str, object], AuditResult]:
    record = run_job(
        out,
        "--model", str(audit_dir / "audit_model.py"), "--model-class", "SparseModel",
        "--data", str(audit_dir), "--optimizer", "sgd", "--lr", "1",
        "--sync-reduction", "sum", "--push-every", "1", "--trainers", "3", "--ps", str(ps),
        "--mode", mode, "--epochs", str(epochs), "--records-per-task", "200",
        "--checkpoint-every-s", "1", "--lease-ttl-s", "2", *extra,
        env=env,
    )  # fmt: skip
    return record, check_counters(sparse_counters(out / "snapshot", RECORDS), epochs)


def assert_exact(record: dict[str, object], audit: AuditResult, out: Path, epochs: int) -> None:
    assert audit.exactly_once, audit.as_dict()
    passes = record["passes"]
    assert isinstance(passes, list) and len(passes) == epochs
    assert all(p["exactly_once"] and p["shards_checked"] for p in passes), passes
    assert record["exactly_once"] is True
    # The dense part of the same pushes: one count per record and pass.
    seen, _ = load_checkpoint(out)
    assert seen["seen"].item() == RECORDS * epochs


def test_sparse_rows_survive_a_killed_parameter_server_exactly_once(
    audit_dir: Path, tmp_path: Path
) -> None:
    """Sync mode: the restarted server reloads its rows, every shard is rolled back
    to one version (tables included), and what it lacks is trained again."""
    out = tmp_path / "run"
    record, audit = run_audit(audit_dir, out, "sync", extra=("--chaos", "kill:ps@30%"))
    assert_exact(record, audit, out, 2)
    assert record["restarts"], "the parameter server was not restarted"


def test_sparse_rows_survive_a_killed_trainer_exactly_once(audit_dir: Path, tmp_path: Path) -> None:
    """Trainer 0 dies right after its 5th push is acknowledged and before it reports
    it: the next attempt pushes the same rows again, and every server drops them
    as a duplicate; another trainer is killed by the chaos schedule mid-pass."""
    out = tmp_path / "run"
    record, audit = run_audit(
        audit_dir,
        out,
        "async",
        extra=("--chaos", "kill:trainer@60%"),
        env={"ELASTICPS_TEST_KILL_AFTER_ACK": "0:5"},
    )
    assert_exact(record, audit, out, 2)
    assert "test hook: SIGKILL after push 5" in str(record["stderr"])


def test_stale_background_pushes_computed_again_across_task_ends_count_once(
    audit_dir: Path, tmp_path: Path
) -> None:
    """Async, --max-staleness 0: a push sent in the background while the next
    mini-batch trains is answered STALE whenever another trainer pushed first,
    and is computed again before the next push, often after its task ended
    and the trainer went on with the task it held (the report waits for it)."""
    out = tmp_path / "run"
    record, audit = run_audit(audit_dir, out, "async", extra=("--max-staleness", "0"))
    assert_exact(record, audit, out, 2)
    logs = "".join(p.read_text() for p in (out / "logs").glob("trainer-*.log"))
    assert "a background push was stale; computing it again" in logs


def test_resume_onto_three_servers_from_two_repartitions_every_row(
    audit_dir: Path, tmp_path: Path
) -> None:
    """A job on 2 servers, then a job resumed from its checkpoint on 3: every row
    moves to the server the new partitioning gives it, intact, and goes on
    counting."""
    first = tmp_path / "first"
    run_audit(audit_dir, first, "async", epochs=1)
    before = sparse_counters(first / "snapshot", RECORDS)
    assert bool((before == 1).all())
    second = tmp_path / "second"
    record, _ = run_audit(
        audit_dir, second, "sync", epochs=1, ps=3, extra=("--resume", str(first / "snapshot"))
    )
    after = check_counters(sparse_counters(second / "snapshot", RECORDS), 2)
    assert after.exactly_once, after.as_dict()
    # Every server holds a third of the rows or so, each row exactly once.
    held = [
        len(load_tables(d).ids("audit_rows"))
        for d in sorted((second / "snapshot").glob("shard-*.tables"))
    ]
    assert len(held) == 3 and sum(held) == RECORDS and min(held) > RECORDS // 5, held
    assert record["exactly_once"] is True
