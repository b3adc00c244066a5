"""Evaluate trained parameters on a Parquet dataset: mean loss and metrics.

Used by the job's final evaluation, ``--eval-each-pass``, ``elasticps
evaluate`` on a checkpoint, and the examples' tests. Every model gets the
sample-weighted mean of its ``loss``; the metrics that fit the shapes of its
outputs and targets are added (:class:`MetricSet`), then the model file's own
``metrics()``, if it defines one. Accuracy, MSE and MAE are computed here as
``torchmetrics`` computes them; the AUC by ``torchmetrics``, imported only
then (its import, with the scipy.signal and matplotlib it pulls in, was the
largest CPU cost of a small job's launcher: benchmarks/README.md). A metric
that cannot be computed is left out with a warning in the log: a job never
fails because of its metrics.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn
from torch.nn.parameter import is_lazy

from elasticps.data.parquet import FileName, RangeReader, check_columns, count_rows
from elasticps.errors import BadRecordError, ConfigError, DataError, ModelContractError, one_line
from elasticps.model_file import ModelSpec, call_model, describe_model_error, output_tensor
from elasticps.sharing import state_aliases, with_aliases, without_aliases

if TYPE_CHECKING:
    from elasticps.tables import TableSet

__all__ = ["MetricSet", "checkpoint_tables", "evaluate", "evaluate_batches", "load_parameters"]

log = logging.getLogger(__name__)


def _shape(values: torch.Size) -> str:
    return "[" + ", ".join(str(size) for size in values) + "]"


def load_parameters(model: nn.Module, tensors: Mapping[str, Tensor], *, what: str) -> None:
    """Load ``tensors`` into ``model`` with ``strict=True`` semantics.

    Names and shapes are compared first so that a mismatch is reported as one
    readable line rather than PyTorch's multi-line error. A tensor the model
    holds under several names (tied weights, :mod:`elasticps.sharing`) is
    looked for under its first name only, as elasticps saves it, and loaded
    once, so the names stay one tensor. Lazy (uninitialized) parameters take
    the shapes of ``tensors``.

    Args:
        model: the freshly built model.
        tensors: name -> tensor, names as in ``model.state_dict()``
            (parameters and persistent buffers); a shared tensor's other
            names may be left out, and are ignored if present.
        what: how to name the model in error messages.

    Raises:
        ModelContractError: names or shapes differ from ``model.state_dict()``.
    """
    aliases = state_aliases(model)
    expected = without_aliases(model.state_dict(keep_vars=True), aliases)
    given = without_aliases(tensors, aliases)
    missing = sorted(set(expected) - set(given))
    unexpected = sorted(set(given) - set(expected))
    wrong_shape = [
        f"{name} {_shape(given[name].shape)} vs model {_shape(expected[name].shape)}"
        for name in sorted(set(expected) & set(given))
        if not is_lazy(expected[name]) and given[name].shape != expected[name].shape
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
        model.load_state_dict(with_aliases(given, aliases), strict=True)
    except RuntimeError as exc:  # e.g. a dtype that cannot be copied
        message = " ".join(str(exc).split())
        raise ModelContractError(f"cannot load parameters into {what}: {message}") from exc


def checkpoint_tables(model: nn.Module, directory: Path) -> TableSet | None:
    """The trained sparse tables of ``model``, read from a checkpoint, to evaluate it with.

    A model with :mod:`elasticps.nn` tables keeps their rows on the parameter
    servers, not in ``model.safetensors``; evaluating it without them would
    use every row's initial value. The tables are looked for, in order:

    - in ``directory`` itself: a consistent checkpoint (its servers'
      ``shard-<i>.tables`` parts, e.g. a job's ``OUTPUT/snapshot`` or what
      ``elasticps checkpoint`` wrote) or a set saved by
      :meth:`~elasticps.tables.TableSet.save` (a ``sparse/`` directory);
    - in ``directory/snapshot``: a job's output directory, whose final
      consistent checkpoint holds them.

    Args:
        model: the model (built from its model file; only its sparse
            modules' specs are read).
        directory: a job's output directory or a checkpoint directory.

    Returns:
        The tables (:class:`~elasticps.tables.TableSet`, every table whole in
        memory), or None if the model has no sparse table.

    Raises:
        DataError: the model has sparse tables but neither place holds any,
            or their files are missing or corrupt.
        MissingParameterError: a table of the model is not in the checkpoint.
        ModelContractError: two modules declare one table name differently.
    """
    from elasticps.errors import MissingParameterError
    from elasticps.nn import table_specs
    from elasticps.tables import load_tables

    specs = table_specs(model)
    if not specs:
        return None
    root = Path(directory)
    for candidate in (root, root / "snapshot"):
        if any(candidate.glob("shard-*.tables")) or (candidate / "sparse").is_dir():
            tables = load_tables(candidate)
            missing = sorted(set(specs) - set(tables))
            if missing:
                raise MissingParameterError(
                    f"the checkpoint in {candidate} has no rows for sparse table(s) "
                    f"{', '.join(missing)}"
                )
            return tables
    raise DataError(
        f"the model has sparse tables ({', '.join(sorted(specs))}) but {root} holds none: "
        "give a job's output directory (its snapshot/ holds the trained rows) or a "
        "consistent checkpoint"
    )


def _number(value: float) -> float:
    """A metric value as reported: a float of float32 precision (7 significant digits)."""
    return float(f"{value:.7g}")


def _flatten(name: str, value: object, out: dict[str, float]) -> None:
    """A metric's computed value as ``name -> float`` entries (``name.i``, ``name.key``)."""
    if isinstance(value, Mapping):
        for key, item in value.items():
            _flatten(f"{name}.{key}", item, out)
        return
    tensor = torch.as_tensor(value).detach().reshape(-1)
    if tensor.numel() == 1:
        out[name] = _number(float(tensor[0]))
        return
    for i, item in enumerate(tensor.tolist()):
        out[f"{name}.{i}"] = _number(float(item))


class _Metrics:
    """Named metric objects updated together; one that fails is dropped with a warning.

    Args:
        metrics: name -> metric object.
        what: how to name the model in warnings.
        owner: whose metrics they are, as the reasons in :attr:`failed` name
            them (e.g. ``"the model file's metrics()"``); empty for the
            default metrics.
    """

    def __init__(self, metrics: Mapping[str, Any], what: str, owner: str = "") -> None:
        self._metrics = dict(metrics)
        self._what = what
        self._owner = owner
        self.failed: dict[str, str] = {}
        """name -> why the metric was left out (one line)."""

    def _drop(self, name: str, step: str, exc: Exception) -> None:
        reason = f"{step} raised {one_line(exc, with_type=True)}"
        if self._owner:
            reason = f"{self._owner}: {reason}"
        log.warning("metric %r of %s left out: %s", name, self._what, reason)
        self.failed[name] = reason

    def update(self, preds: object, target: object) -> None:
        for name in list(self._metrics):
            try:
                self._metrics[name].update(preds, target)
            except Exception as exc:
                self._drop(name, "update", exc)
                del self._metrics[name]

    def compute(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for name, metric in self._metrics.items():
            try:
                values: dict[str, float] = {}
                _flatten(name, metric.compute(), values)
            except Exception as exc:
                self._drop(name, "compute", exc)
                continue
            out.update({k: v for k, v in values.items() if math.isfinite(v)})
        return out


# The default metrics. Accuracy, MSE and MAE are counts and sums, computed
# here as torchmetrics' MulticlassAccuracy (micro), BinaryAccuracy,
# MeanSquaredError and MeanAbsoluteError compute them: the same float32
# arithmetic, and the same checks raising the same errors. The AUC is
# torchmetrics' BinaryAUROC. Importing torchmetrics is costly (it imports
# scipy.signal and matplotlib when they are installed), so it is imported only
# for a model that gets an AUC or returns its own metrics.


class _MulticlassAccuracy:
    """Micro-averaged accuracy of ``[B, C]`` class scores against ``[B]`` class indices."""

    def __init__(self, num_classes: int) -> None:
        self._num_classes = num_classes
        self._correct = torch.tensor(0)
        self._total = torch.tensor(0)

    def update(self, preds: Tensor, target: Tensor) -> None:
        if preds.shape[1] != self._num_classes:
            raise ValueError(
                "If `preds` have one dimension more than `target`, `preds.shape[1]` should be"
                " equal to number of classes."
            )
        self._correct += (preds.argmax(dim=1) == target).sum()
        self._total += target.numel()

    def compute(self) -> Tensor:
        return _safe_divide(self._correct, self._total)


class _BinaryAccuracy:
    """Accuracy of ``[N]`` probabilities (threshold 0.5) against ``[N]`` 0/1 targets."""

    def __init__(self) -> None:
        self._correct = torch.tensor(0)
        self._total = torch.tensor(0)

    def update(self, preds: Tensor, target: Tensor) -> None:
        if not torch.all((preds >= 0) * (preds <= 1)):  # e.g. a NaN: read as logits
            preds = preds.sigmoid()
        self._correct += ((preds > 0.5) == target).sum()
        self._total += target.numel()

    def compute(self) -> Tensor:
        return _safe_divide(self._correct, self._total)


class _MeanError:
    """Mean squared (``squared``) or absolute error of ``[N]`` float32 predictions."""

    def __init__(self, *, squared: bool) -> None:
        self._squared = squared
        self._sum = torch.zeros(())
        self._total = torch.tensor(0)

    def update(self, preds: Tensor, target: Tensor) -> None:
        if preds.shape != target.shape:
            raise RuntimeError(
                "Predictions and targets are expected to have the same shape, but got "
                f"{preds.shape} and {target.shape}."
            )
        diff = preds.reshape(-1) - target.reshape(-1)
        self._sum += torch.sum(diff * diff if self._squared else torch.abs(diff), dim=0)
        self._total += diff.numel()

    def compute(self) -> Tensor:
        return self._sum / self._total


def _safe_divide(num: Tensor, denom: Tensor) -> Tensor:
    """``num / denom`` in float32, 0 where ``denom`` is 0."""
    num, denom = num.float(), denom.float()
    return torch.where(denom != 0, num / denom, torch.zeros((), dtype=num.dtype))


def _binary_auroc() -> Any:
    from torchmetrics.classification import BinaryAUROC

    # One process evaluates: the metric must not wait for other ranks of a
    # process group the caller may be in (a DDP worker evaluating).
    return BinaryAUROC(sync_on_compute=False)


class _OnFirstUpdate:
    """A metric made by ``make()`` when it is first updated (so its library is imported then)."""

    def __init__(self, make: Callable[[], Any]) -> None:
        self._make = make
        self._metric: Any = None

    def update(self, preds: Tensor, target: Tensor) -> None:
        if self._metric is None:
            self._metric = self._make()
        self._metric.update(preds, target)

    def compute(self) -> Any:
        if self._metric is None:
            raise ValueError("no batch was given to the metric")
        return self._metric.compute()


_CLASSES = "classes"
_SAME_SHAPE = "same shape"


def _kind(outputs: Tensor, targets: object) -> str | None:
    """Which default metrics fit one batch's shapes, or None."""
    if not isinstance(targets, Tensor):
        return None
    if not outputs.dtype.is_floating_point or outputs.dim() == 0:
        return None
    rows = outputs.shape[0]
    if (
        outputs.dim() == 2
        and outputs.shape[1] >= 2
        and targets.shape == (rows,)
        and not targets.dtype.is_floating_point
        and targets.dtype != torch.bool
    ):
        return _CLASSES
    if targets.dim() >= 1 and targets.shape[0] == rows and outputs.numel() == targets.numel():
        return _SAME_SHAPE
    return None


class MetricSet:
    """The default metrics that fit a model's shapes, and the model's own, over batches.

    Default metrics, chosen from each batch's shapes (``B`` rows):

    - ``[B, C]`` float outputs (logits, ``C >= 2``) with integer ``[B]``
      targets: ``accuracy`` (``argmax`` equals the target; as
      ``torchmetrics`` ``MulticlassAccuracy``, micro-averaged);
    - float outputs with as many elements as the targets (``[B]``, or the
      targets' own shape): if every target is 0 or 1, the outputs are
      logits of a binary classifier: ``accuracy`` (logit > 0, i.e.
      probability > 0.5; as ``BinaryAccuracy``) and ``auc`` (area under
      the ROC curve, ``torchmetrics`` ``BinaryAUROC``, exact; left out if
      the targets hold one class only); else a regression: ``mse`` and
      ``mae`` (as ``MeanSquaredError``, ``MeanAbsoluteError``);
    - anything else, or shapes that change from batch to batch: none (the
      loss alone).

    The outputs' tensor is found by
    :func:`~elasticps.model_file.output_tensor`: the outputs themselves, the
    first element of a tuple or list, or the ``logits`` of a dict or
    dataclass. The model's own metrics receive the outputs as ``forward``
    returned them.

    Args:
        user_metrics: the model file's ``metrics()`` result (name -> a
            ``torchmetrics`` metric, or any object with ``update(preds,
            target)`` and ``compute()``), or None. A name equal to a default
            metric's replaces it.
        what: how to name the model in warnings.
        owner: whose ``user_metrics`` they are, as :attr:`failed` names them.
    """

    def __init__(
        self,
        user_metrics: Mapping[str, Any] | None = None,
        *,
        what: str = "model",
        owner: str = "the model's metrics()",
    ) -> None:
        self._what = what
        self._user = _Metrics(user_metrics or {}, what, owner)
        self._kind: str | None = None
        self._mixed = False
        self._classes: _Metrics | None = None
        self._binary: _Metrics | None = None
        self._regression: _Metrics | None = None
        self._all_binary = True
        self._seen_targets: set[int] = set()

    @property
    def failed(self) -> dict[str, str]:
        """name -> why that metric could not be computed (one line), for the metrics left out."""
        out: dict[str, str] = {}
        for metrics in (self._classes, self._binary, self._regression, self._user):
            if metrics is not None:
                out.update(metrics.failed)
        return out

    def update(self, outputs: object, targets: Tensor) -> None:
        """Update every metric with one batch (``outputs`` as ``forward`` returned them)."""
        self._user.update(outputs, targets)
        if self._mixed:
            return
        tensor = output_tensor(outputs)
        if tensor is None:  # no tensor to read: the model's own metrics alone
            self._mixed = True
            return
        kind = _kind(tensor, targets)
        if self._kind is None and kind is not None and not self._started():
            self._start(kind, tensor)
        if kind is None or kind != self._kind:
            self._mixed = True
            return
        if kind == _CLASSES:
            assert self._classes is not None
            self._classes.update(tensor, targets)
            return
        preds = tensor.reshape(-1).to(torch.float32)
        target = targets.reshape(-1)
        assert self._regression is not None and self._binary is not None
        self._regression.update(preds, target.to(torch.float32))
        if self._all_binary:
            ints = target.to(torch.float64)
            if bool(((ints == 0) | (ints == 1)).all()):
                self._seen_targets.update(int(v) for v in torch.unique(ints).tolist())
                self._binary.update(torch.sigmoid(preds), target.to(torch.int64))
            else:
                self._all_binary = False

    def _started(self) -> bool:
        return self._classes is not None or self._regression is not None

    def _start(self, kind: str, outputs: Tensor) -> None:
        self._kind = kind
        if kind == _CLASSES:
            accuracy = _MulticlassAccuracy(num_classes=int(outputs.shape[1]))
            self._classes = _Metrics({"accuracy": accuracy}, self._what)
        else:
            self._binary = _Metrics(
                {"accuracy": _BinaryAccuracy(), "auc": _OnFirstUpdate(_binary_auroc)}, self._what
            )
            self._regression = _Metrics(
                {"mse": _MeanError(squared=True), "mae": _MeanError(squared=False)}, self._what
            )

    def compute(self) -> dict[str, float]:
        """The metrics' values: default ones first, then the model's own."""
        out: dict[str, float] = {}
        if not self._mixed:
            if self._classes is not None:
                out.update(self._classes.compute())
            elif self._binary is not None and self._regression is not None:
                if self._all_binary:
                    values = self._binary.compute()
                    if self._seen_targets != {0, 1}:
                        values.pop("auc", None)  # undefined with one class only
                    out.update(values)
                else:
                    out.update(self._regression.compute())
        for name, value in self._user.compute().items():
            out.pop(name, None)
            out[name] = value
        return out


def _user_metrics(spec: ModelSpec, failed: dict[str, str]) -> Mapping[str, Any] | None:
    """The model file's fresh metrics, or None (a broken ``metrics()`` is logged, in ``failed``)."""
    if spec.metrics is None:
        return None
    try:
        metrics = spec.metrics()
        if not isinstance(metrics, Mapping) or not all(isinstance(k, str) for k in metrics):
            raise TypeError(
                f"metrics() must return a dict of names to metrics, got {metrics!r:.80}"
            )
    except Exception as exc:
        reason = f"metrics() of model file {spec.path.name} raised {one_line(exc, with_type=True)}"
        log.warning("metrics left out: %s", reason)
        failed["metrics"] = reason
        return None
    return metrics


def evaluate_batches(
    model: nn.Module,
    loss: Callable[[Any, Any], Tensor],
    batches: Iterable[tuple[Tensor, Tensor]],
    *,
    metrics: Mapping[str, Any] | None = None,
    what: str = "model",
    owner: str = "the model's metrics()",
    failed: dict[str, str] | None = None,
) -> dict[str, float]:
    """Mean loss and metrics of ``model`` over ``(inputs, targets)`` batches.

    The model runs in eval mode under ``torch.no_grad()``, called on each
    batch's inputs as :func:`~elasticps.model_file.call_model` does; its
    training flag is restored afterwards. ``loss`` and ``metrics`` receive
    the outputs as ``forward`` returned them.

    Args:
        model: the model, with its trained parameters and buffers loaded.
        loss: ``loss(outputs, targets) -> Tensor``, a scalar mean loss.
        batches: the mini-batches.
        metrics: extra metrics by name (see :class:`MetricSet`).
        what: how to name the model in warnings.
        owner: whose ``metrics`` they are, as the reasons in ``failed`` name them.
        failed: if given, filled with name -> reason (one line) for each
            metric that could not be computed and was left out.

    Returns:
        The metrics (see :class:`MetricSet`), then ``loss`` (the
        sample-weighted mean of ``loss`` over the batches, a batch's weight
        being ``len(targets)``) and ``samples`` (the number of samples, a float).

    Raises:
        DataError: no batch, or no sample.
        Exception: whatever ``model`` or ``loss`` raises.
    """
    scores = MetricSet(metrics, what=what, owner=owner)
    loss_sum = 0.0
    samples = 0
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            for inputs, targets in batches:
                outputs = call_model(model, inputs)
                rows = len(targets)
                loss_sum += float(loss(outputs, targets)) * rows
                samples += rows
                scores.update(outputs, targets)
    finally:
        model.train(was_training)
    if samples == 0:
        raise DataError("no samples to evaluate")
    computed = scores.compute()
    if failed is not None:
        failed.update(scores.failed)
    return {**computed, "loss": loss_sum / samples, "samples": float(samples)}


def evaluate(
    spec: ModelSpec,
    tensors: Mapping[str, Tensor],
    data_path: FileName,
    *,
    batch_size: int = 500,
    tables: Mapping[str, object] | None = None,
    failed: dict[str, str] | None = None,
) -> dict[str, float]:
    """Compute the mean loss and the metrics of a model on a Parquet file.

    The model is built with ``spec.build()`` and loaded with ``tensors``; the
    file is read in row ranges of ``batch_size`` rows with a
    :class:`~elasticps.data.parquet.RangeReader`, under ``torch.no_grad()``
    and ``model.eval()``.

    Args:
        spec: the loaded model file.
        tensors: name -> tensor, the model's full ``state_dict`` (parameters
            and persistent buffers; e.g. from
            :func:`elasticps.checkpoint.load_checkpoint`).
        data_path: a Parquet file with the columns ``spec.columns``.
        batch_size: rows per forward pass (>= 1).
        tables: the trained sparse tables of a model with :mod:`elasticps.nn`
            modules (a :class:`~elasticps.tables.TableSet`), bound to it before
            the first batch.
        failed: if given, filled with name -> reason (one line) for each
            metric left out because it could not be computed (``metrics`` if
            the file's ``metrics()`` itself raised).

    Returns:
        The metrics that fit the model's shapes and its file's own
        ``metrics()`` (see :class:`MetricSet`; ``accuracy`` for class
        scores), then ``loss``, the sample-weighted mean of ``spec.loss``
        over the batches, and ``samples``, the row count (a float).

    Raises:
        ConfigError: ``batch_size`` < 1.
        DataError: the file is missing, not Parquet, lacks a column, or is empty.
        ModelContractError: ``tensors`` do not match the model, or the loss
            is not a scalar.
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
    position = {"start": 0, "end": 0, "called": "batch_to_tensors"}

    def batches(reader: RangeReader) -> Iterable[tuple[Tensor, Tensor]]:
        for start in range(0, total_rows, batch_size):
            end = min(start + batch_size, total_rows)
            position.update(start=start, end=end, called="batch_to_tensors")
            inputs, targets = spec.batch_to_tensors(
                reader.read_rows(data_path, start, end, spec.columns)
            )
            position["called"] = "forward"
            yield inputs, targets

    def checked_loss(outputs: Tensor, targets: Tensor) -> Tensor:
        position["called"] = "loss"
        value = spec.loss(outputs, targets)
        if value.dim() != 0:
            raise ModelContractError(
                f"{what}: loss must return a scalar, got shape {_shape(value.shape)}"
            )
        return value

    left_out: dict[str, str] = {} if failed is None else failed
    owner = f"metrics() of model file {spec.path.name}"
    with RangeReader() as reader:
        try:
            return evaluate_batches(
                model, checked_loss, batches(reader), metrics=_user_metrics(spec, left_out),
                what=what, owner=owner, failed=left_out,
            )  # fmt: skip
        except (ModelContractError, DataError):
            raise
        except Exception as exc:
            called = str(position["called"])
            raise BadRecordError(
                f"{describe_model_error(exc, spec.path, str(spec.path), called)}; on rows "
                f"[{position['start']}, {position['end']}) of {data_path}"
            ) from exc
