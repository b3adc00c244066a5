"""The Python-API examples run as tests, each to its stated threshold.

- ``examples/ranking_shared_params.py`` on local servers: three towers, three
  parameters on the PS (the snapshot's shard map is counted), accuracy >= 0.9.
- ``examples/gan_frozen.py``: frozen parameters are bit-identical across the
  step that froze them, in-process and on local servers; the in-process run
  reaches the generated-mean bar.
- ``examples/loss_curve.ipynb`` under Jupyter (nbclient, a ``python3`` kernel
  running this interpreter): the plot is written and the loss falls.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

import elasticps
from elasticps.testing import child_pids, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def load_example(name: str) -> ModuleType:
    path = EXAMPLES / name
    spec = importlib.util.spec_from_file_location(f"_example_{path.stem}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def no_children_left() -> bool:
    return not child_pids()


def test_ranking_towers_share_three_parameters_on_the_ps_and_rank_well(tmp_path: Path) -> None:
    ranking = load_example("ranking_shared_params.py")
    snapshot = tmp_path / "snapshot"
    result = ranking.run(
        elasticps.Local(trainers=2, ps=2, mode="sync", checkpoint_dir=snapshot),
        train_size=1024,
        num_passes=4,
    )
    assert result["parameters"] == ["embedding.weight", "semantic.weight", "semantic.bias"]
    assert result["accuracy"] >= ranking.ACCURACY_BAR
    assert result["tower_output_shape"] == [5, ranking.TOPICS]
    # Count the keys on the parameter servers: the snapshot's shard map.
    manifest = json.loads((snapshot / "manifest.json").read_text())
    pieces = [piece for shard in manifest["shards"] for piece in shard["pieces"]]
    assert sorted({piece[0] for piece in pieces}) == sorted(result["parameters"])
    stored = sum(piece[2] - piece[1] for piece in pieces)
    assert stored == result["numel"] == ranking.VOCAB * ranking.DIM + ranking.DIM * 8 + 8
    wait_for(no_children_left, what="the job's processes to be stopped", timeout_s=10)


def test_gan_in_process_reaches_the_bar_with_frozen_steps_bit_identical() -> None:
    gan = load_example("gan_frozen.py")
    result = gan.run(gan.DEFAULT_ROUNDS)  # train_round checks both freezes every round
    assert result["ok"], result


def test_gan_round_on_local_servers_keeps_frozen_parameters_bit_identical() -> None:
    gan = load_example("gan_frozen.py")
    torch.manual_seed(0)
    before = elasticps.parameters.create(gan.GAN())
    after = gan.train_round(before, 0, elasticps.Local(trainers=1, ps=2, mode="sync"))
    # train_round asserted G.* unchanged by the D step and D.* by the G step;
    # over the round both networks moved.
    assert not torch.equal(after["G.0.weight"], before["G.0.weight"])
    assert not torch.equal(after["D.0.weight"], before["D.0.weight"])
    wait_for(no_children_left, what="the job's processes to be stopped", timeout_s=10)


def test_loss_curve_notebook_runs_under_nbclient(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    # A python3 kernel spec that runs this very interpreter (the venv's ipykernel).
    kernel_dir = tmp_path / "jupyter" / "kernels" / "python3"
    kernel_dir.mkdir(parents=True)
    (kernel_dir / "kernel.json").write_text(
        json.dumps(
            {
                "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
                "display_name": "Python 3 (elasticps tests)",
                "language": "python",
            }
        )
    )
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "jupyter"))
    out = tmp_path / "loss_curve.png"
    monkeypatch.setenv("ELASTICPS_NOTEBOOK_OUT", str(out))
    monkeypatch.delenv("ELASTICPS_NOTEBOOK_CLUSTER", raising=False)
    notebook = nbformat.read(EXAMPLES / "loss_curve.ipynb", as_version=4)
    client = nbclient.NotebookClient(
        notebook, timeout=120, kernel_name="python3", resources={"metadata": {"path": tmp_path}}
    )
    client.execute()
    assert out.stat().st_size > 1000
    printed = [
        output.get("text", "")
        for cell in notebook.cells
        if cell.cell_type == "code"
        for output in cell.get("outputs", [])
        if output.get("output_type") == "stream"
    ]
    summary = json.loads(next(line for line in "".join(printed).splitlines() if "{" in line))
    assert summary["last_pass_cost"] < summary["first_pass_cost"]
    assert summary["accuracy"] >= 0.85
