"""Evaluate trained parameters on a Parquet dataset: accuracy and mean loss.

Used by ``elasticps evaluate`` on a checkpoint, and by the examples' tests.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch
from torch import Tensor, nn

from elasticps.data.parquet import RangeReader, check_columns, count_rows
from elasticps.errors import BadRecordError, ConfigError, DataError, ModelContractError
from elasticps.model_file import ModelSpec, describe_model_error


def _shape(values: torch.Size) -> str:
    return "[" + ", ".join(str(size) for size in values) + "]"


def load_parameters(model: nn.Module, tensors: Mapping[str, Tensor], *, what: str) -> None:
    """Load ``tensors`` into ``model`` with ``strict=True`` semantics.

    Names and shapes are compared first so that a mismatch is reported as one
    readable line rather than PyTorch's multi-line error.

    Args:
        model: the freshly built model.
        tensors: name -> tensor, names as in ``model.state_dict()``.
        what: how to name the model in error messages.

    Raises:
        ModelContractError: names or shapes differ from ``model.state_dict()``.
    """
    expected = model.state_dict()
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected))
    wrong_shape = [
        f"{name} {_shape(tensors[name].shape)} vs model {_shape(expected[name].shape)}"
        for name in sorted(set(expected) & set(tensors))
        if tensors[name].shape != expected[name].shape
    ]
    problems = []
    if missing:
        problems.append(f"missing {', '.join(missing[:5])}{', ...' if len(missing) > 5 else ''}")
    if unexpected:
        shown = ", ".join(unexpected[:5]) + (", ..." if len(unexpected) > 5 else "")
        problems.append(f"unexpected {shown}")
    if wrong_shape:
        shown = "; ".join(wrong_shape[:3]) + ("; ..." if len(wrong_shape) > 3 else "")
        problems.append(f"shape mismatch {shown}")
    if problems:
        raise ModelContractError(f"parameters do not match {what}: {'; '.join(problems)}")
    try:
        model.load_state_dict(dict(tensors), strict=True)
    except RuntimeError as exc:  # e.g. a dtype that cannot be copied
        message = " ".join(str(exc).split())
        raise ModelContractError(f"cannot load parameters into {what}: {message}") from exc


def evaluate(
    spec: ModelSpec,
    tensors: Mapping[str, Tensor],
    data_path: Path,
    *,
    batch_size: int = 500,
    tables: Mapping[str, object] | None = None,
) -> dict[str, float]:
    """Compute the accuracy and mean loss of a model on a Parquet file.

    The model is built with ``spec.build()`` and loaded with ``tensors``; the
    file is read in row ranges of ``batch_size`` rows with a
    :class:`~elasticps.data.parquet.RangeReader`, under ``torch.no_grad()``
    and ``model.eval()``.

    Args:
        spec: the loaded model file.
        tensors: name -> tensor, the model's full ``state_dict`` (e.g. from
            :func:`elasticps.checkpoint.load_checkpoint`).
        data_path: a Parquet file with the columns ``spec.columns``.
        batch_size: rows per forward pass (>= 1).
        tables: the trained sparse tables of a model with :mod:`elasticps.nn`
            modules (a :class:`~elasticps.tables.TableSet`), bound to it before
            the first batch.

    Returns:
        ``{"accuracy": ..., "loss": ..., "samples": ...}``: the fraction of
        rows where ``argmax(outputs, dim=1) == targets``; the sample-weighted
        mean of ``spec.loss`` over the batches; and the row count (a float).
        A model whose outputs are one logit per row (``[B]``, binary
        classification against float 0/1 targets) is right where ``(logit > 0) ==
        target``, and gets ``"auc"`` too (ROC AUC, scikit-learn's
        ``roc_auc_score``; absent when the targets hold one class only).

    Raises:
        ConfigError: ``batch_size`` < 1.
        DataError: the file is missing, not Parquet, lacks a column, or is empty.
        ModelContractError: ``tensors`` do not match the model, or the model's
            outputs are not [B, classes] with int64 [B] targets.
        BadRecordError: the model file's ``batch_to_tensors``, ``forward`` or
            ``loss`` raised on a batch (a bad record); one line naming the
            model file's line and the rows.
    """
    if batch_size < 1:
        raise ConfigError(f"batch_size must be >= 1, got {batch_size}")
    what = f"{spec.model_class} from {spec.path.name}"
    check_columns(data_path, spec.columns)
    total_rows = count_rows(data_path)
    if total_rows == 0:
        raise DataError(f"data file {data_path} has no rows to evaluate")

    model = spec.build()
    load_parameters(model, tensors, what=what)
    if tables is not None:
        from elasticps.tables import TableSet

        if not isinstance(tables, TableSet):
            raise ModelContractError(f"{what}: tables must be a TableSet")
        tables.bind(model)
    model.eval()

    correct = 0
    loss_sum = 0.0
    logits: list[Tensor] = []
    labels: list[Tensor] = []
    with RangeReader() as reader, torch.no_grad():
        for start in range(0, total_rows, batch_size):
            end = min(start + batch_size, total_rows)
            batch = reader.read_rows(data_path, start, end, spec.columns)
            called = "batch_to_tensors"
            try:
                inputs, targets = spec.batch_to_tensors(batch)
                called = "forward"
                outputs = model(inputs)
                binary = (
                    outputs.dim() == 1
                    and outputs.shape == targets.shape
                    and targets.is_floating_point()
                )
                if not binary and (outputs.dim() != 2 or targets.shape != (end - start,)):
                    raise ModelContractError(
                        f"{what}: evaluation needs outputs [B, classes] and targets [B] "
                        f"with B={end - start}; got outputs {_shape(outputs.shape)}, "
                        f"targets {_shape(targets.shape)}"
                    )
                called = "loss"
                loss_sum += float(spec.loss(outputs, targets)) * (end - start)
            except (ModelContractError, DataError):
                raise
            except Exception as exc:
                raise BadRecordError(
                    f"{describe_model_error(exc, spec.path, str(spec.path), called)}; on rows "
                    f"[{start}, {end}) of {data_path}"
                ) from exc
            if binary:
                correct += int(((outputs > 0).to(targets.dtype) == targets).sum())
                logits.append(outputs.detach().reshape(-1))
                labels.append(targets.detach().reshape(-1))
            else:
                correct += int((outputs.argmax(dim=1) == targets).sum())
    result = {
        "accuracy": correct / total_rows,
        "loss": loss_sum / total_rows,
        "samples": float(total_rows),
    }
    if logits:
        y = torch.cat(labels).numpy()
        if len(set(y.tolist())) == 2:
            from sklearn.metrics import roc_auc_score  # type: ignore[import-untyped]

            result["auc"] = float(roc_auc_score(y, torch.cat(logits).numpy()))
    return result
