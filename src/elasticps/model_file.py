"""Load a user's model file and check that it follows the model-file contract.

A model file is a plain Python file (see ``examples/mnist_mlp.py``) that defines::

    COLUMNS = ("pixels", "label")      # Parquet columns it reads

    class Model(torch.nn.Module):      # name chosen by --model-class (default "Model");
        ...                            # constructed with --model-args (default none)

    def loss(outputs: Tensor, targets: Tensor) -> Tensor:
        ...                            # scalar mean loss over the mini-batch

    def batch_to_tensors(batch: pyarrow.Table) -> tuple[Tensor, Tensor]:
        ...                            # (inputs, targets) of one mini-batch

    def metrics() -> dict[str, Metric]:  # optional: fresh torchmetrics objects by name
        ...

``forward`` may return a tensor, a tuple or list, a dict or a dataclass (such
as a Hugging Face ``ModelOutput``); ``loss`` and ``metrics()`` receive it as
returned, and :func:`output_tensor` names the tensor the default metrics
read. Inputs that are a dict of ``forward``'s parameter names are passed as
keyword arguments (:func:`call_model`). Lazy modules (``nn.LazyLinear``) are
materialized with one forward pass of the first training mini-batch
(:meth:`ModelSpec.instantiate`).

Every trainer loads the same file and calls :meth:`ModelSpec.instantiate` with
the job's seed, so all trainers start from identical parameters. Parameters
must be float32 (the tensor plane carries float32 only), and persistent
buffers float32, float16, bfloat16, integer or bool, see :func:`check_model`.

Every violation is reported as a one-line
:class:`~elasticps.errors.ModelContractError`.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import hashlib
import importlib.util
import inspect
import itertools
import sys
import traceback
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any, cast

import pyarrow as pa
import torch
from torch import Tensor, nn
from torch.nn.parameter import is_lazy

from elasticps.buffers import buffer_specs
from elasticps.errors import ElasticPSError, ModelContractError, one_line
from elasticps.preflight import require_model_file

__all__ = [
    "LazyModelError",
    "ModelSpec",
    "call_model",
    "check_model",
    "describe_model_error",
    "in_process_spec",
    "lazy_names",
    "load_model_file",
    "materialize",
    "materialize_as",
    "model_arguments",
    "output_tensor",
]

_module_counter = itertools.count()


@dataclass(frozen=True)
class ModelSpec:
    """What a model file provides, after validation.

    Attributes:
        path: absolute path of the model file.
        model_class: name of the ``nn.Module`` subclass in the file.
        columns: Parquet columns that ``batch_to_tensors`` reads.
        build: constructs a fresh model (the class, called with
            ``model_args``). Raises :class:`ModelContractError` if the
            constructor fails.
        loss: ``loss(outputs, targets) -> Tensor``, a scalar mean loss over the
            mini-batch.
        batch_to_tensors: ``batch_to_tensors(batch) -> (inputs, targets)`` for
            one mini-batch given as a ``pyarrow.Table`` with (at least)
            ``columns``.
        metrics: the file's optional ``metrics()``: returns fresh metric
            objects by name (``torchmetrics`` metrics) for evaluation; None
            if the file defines none.
        model_args: the keyword arguments ``build`` passes to the class
            (``--model-args``).
        example: returns the job's first training mini-batch (a
            ``pyarrow.Table`` of up to ``--batch-size`` rows with
            ``columns``), to materialize lazy modules with; None when the
            job has not given it (:meth:`with_example`).
    """

    path: Path
    model_class: str
    columns: tuple[str, ...]
    build: Callable[[], nn.Module]
    loss: Callable[[Any, Any], Tensor]
    batch_to_tensors: Callable[[pa.Table], tuple[Tensor, Tensor]]
    metrics: Callable[[], Mapping[str, Any]] | None = None
    model_args: Mapping[str, object] = field(default_factory=dict)
    example: Callable[[], pa.Table] | None = None

    def with_example(self, example: Callable[[], pa.Table]) -> ModelSpec:
        """This spec, materializing lazy modules with the mini-batch ``example()`` returns.

        ``example`` is called once, at the first :meth:`instantiate` that
        needs it; later ones reuse its table (a process builds the model
        several times: for its shapes, its initial values, the final model).
        """
        return dataclasses.replace(self, example=functools.cache(example))

    def instantiate(self, seed: int) -> nn.Module:
        """Build the model with parameters initialised from ``seed``.

        The constructor runs under ``torch.manual_seed(seed)`` inside
        ``torch.random.fork_rng``, so equal seeds give bit-identical initial
        parameters on every trainer, and the caller's global RNG state is left
        untouched. A model with lazy modules (uninitialized parameters, such
        as ``nn.LazyLinear``'s) is then materialized under the same seed by
        one forward pass of :attr:`example` (:func:`materialize`): every
        process that reads the same mini-batch builds the same shapes and
        values.

        Args:
            seed: seed of the parameter initialisation.

        Returns:
            A fresh model that passed :func:`check_model`.

        Raises:
            LazyModelError: the model has lazy modules and the spec has no
                :attr:`example`.
            ModelContractError: the constructor fails, the model has
                non-float32 or no trainable parameters, or a buffer of a
                dtype that cannot be carried, or its lazy modules cannot be
                materialized.
        """
        what = f"{self.model_class} from {self.path.name}"
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = self.build()
            lazy = lazy_names(model)
            if lazy:
                if self.example is None:
                    raise LazyModelError(
                        f"{what} has lazy (uninitialized) parameters ({_listed(lazy)}); they are "
                        "materialized with a forward pass of the first training mini-batch, "
                        "which this job cannot read"
                    )
                self._materialize(model, self.example, what)
        check_model(model, what=what)
        return model

    def _materialize(self, model: nn.Module, example: Callable[[], pa.Table], what: str) -> None:
        called = "batch_to_tensors"
        try:
            inputs, _ = self.batch_to_tensors(example())
            called = "forward"
            materialize(model, inputs)
        except ElasticPSError:
            raise
        except Exception as exc:
            raise ModelContractError(
                f"cannot materialize the lazy parameters of {what} with the first training "
                f"mini-batch: {describe_model_error(exc, self.path, self.path.name, called)}"
            ) from exc
        left = lazy_names(model)
        if left:
            raise ModelContractError(
                f"{what}: a forward pass of the first training mini-batch left parameters "
                f"uninitialized ({_listed(left)}); every lazy module must run in forward"
            )


class LazyModelError(ModelContractError):
    """A model has lazy (uninitialized) parameters and no mini-batch to materialize them with."""


def _listed(names: list[str], limit: int = 5) -> str:
    return ", ".join(names[:limit]) + (", ..." if len(names) > limit else "")


def lazy_names(model: nn.Module) -> list[str]:
    """Names of ``model``'s uninitialized (lazy) parameters and buffers, in module order."""
    names = [name for name, p in model.named_parameters() if is_lazy(p)]
    return names + [name for name, b in model.named_buffers() if is_lazy(b)]


def materialize(model: nn.Module, inputs: object) -> None:
    """Materialize ``model``'s lazy modules with one forward pass of ``inputs``.

    The pass runs in eval mode (BatchNorm's running statistics and dropout
    are left alone) under ``torch.no_grad()``; its outputs are dropped and
    the training flag is restored. Lazy modules initialise their parameters
    from the global RNG, as PyTorch's ``LazyModuleMixin`` does: run it under
    a seed for repeatable values.

    Args:
        model: the model, e.g. with ``nn.LazyLinear`` layers.
        inputs: one mini-batch's inputs, passed as :func:`call_model` does.

    Raises:
        Exception: whatever ``forward`` raises.
    """
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            call_model(model, inputs)
    finally:
        model.train(was_training)


def materialize_as(model: nn.Module, tensors: Mapping[str, Tensor]) -> None:
    """Give ``model``'s lazy parameters and buffers the shapes and values of ``tensors``.

    For a lazy model built afresh to be loaded with trained values, looked up
    by name. Lazy tensors that ``tensors`` lacks stay lazy; the model's other
    tensors are left alone.
    """
    lazy = [(n, t) for n, t in (*model.named_parameters(), *model.named_buffers()) if is_lazy(t)]
    with torch.no_grad():
        for name, tensor in lazy:
            value = tensors.get(name)
            if value is not None:
                cast(Any, tensor).materialize(value.shape)
                tensor.copy_(value)


def call_model(model: nn.Module, inputs: object) -> object:
    """Run ``model`` on one mini-batch's inputs, as ``batch_to_tensors`` returned them.

    A dict whose keys ``forward`` accepts as keyword arguments (its parameter
    names, or any name if it takes ``**kwargs``) is passed as keyword
    arguments, ``model(**inputs)``, as Hugging Face's ``Trainer`` does.
    Anything else, a dict that ``forward`` takes whole (its one parameter is
    not named by a key) included, is passed as one argument, ``model(inputs)``.

    Returns:
        What ``forward`` returns: a tensor, tuple, list, dict or dataclass.

    Raises:
        Exception: whatever ``forward`` raises.
    """
    args, kwargs = model_arguments(model, inputs)
    return model(*args, **kwargs)


def model_arguments(model: nn.Module, inputs: object) -> tuple[tuple[object, ...], dict[str, Any]]:
    """The positional and keyword arguments :func:`call_model` calls ``model`` with."""
    if isinstance(inputs, Mapping) and _takes_keywords(cast(Any, type(model)), tuple(inputs)):
        return (), dict(inputs)
    return (inputs,), {}


@functools.lru_cache(maxsize=256)
def _takes_keywords(cls: Any, keys: tuple[object, ...]) -> bool:
    """Whether ``cls.forward`` can be called with exactly ``keys`` as keyword arguments."""
    if not all(isinstance(key, str) for key in keys):
        return False
    try:
        signature = inspect.signature(cls.forward)
    except (TypeError, ValueError):
        return False
    params = list(signature.parameters.values())[1:]  # self
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return True
    named = {
        p.name
        for p in params
        if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    }
    required = {
        p.name
        for p in params
        if p.default is inspect.Parameter.empty
        and p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    }
    return set(keys) <= named and required <= set(keys)  # type: ignore[operator]


def output_tensor(outputs: object) -> Tensor | None:
    """The tensor of ``forward``'s outputs that the default metrics read.

    In order: the outputs themselves if a tensor; the first element of a
    non-empty tuple or list; the ``logits`` entry of a dict, or the
    ``logits`` attribute of a dataclass (a Hugging Face ``ModelOutput`` is
    both). None if none of these is a tensor: the evaluation then reports
    the loss and the model file's own ``metrics()`` only.
    """
    if isinstance(outputs, Tensor):
        return outputs
    found: object = None
    if isinstance(outputs, (tuple, list)) and outputs:
        found = outputs[0]
    elif isinstance(outputs, Mapping):
        found = outputs.get("logits")
    elif dataclasses.is_dataclass(outputs) and not isinstance(outputs, type):
        found = getattr(outputs, "logits", None)
    return found if isinstance(found, Tensor) else None


def check_model(model: nn.Module, *, what: str = "model") -> None:
    """Check that ``model`` can be trained by elasticps.

    Args:
        model: the module to check.
        what: how to name the model in error messages.

    Raises:
        ModelContractError: the model has lazy (uninitialized) parameters
            (:func:`materialize` them first), a parameter is not float32 (the
            tensor plane carries float32 only), the model has no trainable
            parameters, or a persistent buffer is float64, complex or of
            another dtype the tensor plane cannot carry exactly (see
            :mod:`elasticps.buffers`).
    """
    lazy = lazy_names(model)
    if lazy:
        raise ModelContractError(
            f"{what} has lazy (uninitialized) parameters ({_listed(lazy)}); run one forward "
            "pass of a mini-batch to materialize them first"
        )
    wrong_dtype = [
        f"{name} ({str(param.dtype).removeprefix('torch.')})"
        for name, param in model.named_parameters()
        if param.dtype != torch.float32
    ]
    if wrong_dtype:
        shown = ", ".join(wrong_dtype[:5]) + (", ..." if len(wrong_dtype) > 5 else "")
        raise ModelContractError(f"{what}: parameters must be float32; found {shown}")
    if not any(param.requires_grad for param in model.parameters()):
        raise ModelContractError(f"{what} has no trainable parameters")
    buffer_specs(model, what=what)


def _unique_module_name(path: Path) -> str:
    """Return a module name that no other import uses, derived from ``path``."""
    digest = hashlib.sha1(str(path).encode(), usedforsecurity=False).hexdigest()[:12]
    return f"_elasticps_model_file_{digest}_{next(_module_counter)}"


def _error_line(exc: BaseException, path: Path) -> int | None:
    """Return the line of ``path`` where ``exc`` was raised, if it was raised there."""
    if isinstance(exc, SyntaxError) and exc.filename == str(path):
        return exc.lineno
    frames = [
        frame for frame in traceback.extract_tb(exc.__traceback__) if frame.filename == str(path)
    ]
    return frames[-1].lineno if frames else None


def describe_model_error(exc: BaseException, path: Path, shown: str, called: str) -> str:
    """Describe an exception raised by a model file's code, on one line.

    Args:
        exc: the exception, with its traceback.
        path: the model file's resolved path (:attr:`ModelSpec.path`).
        shown: how to name the file to the user (as given on the command line).
        called: the contract function that was called (``batch_to_tensors``,
            ``forward`` or ``loss``); named when no frame of the traceback is
            in the file itself (a library raised before reaching it).

    Returns:
        ``"model file SHOWN, line N, in FUNCTION: Type: message"``, naming the
        innermost line of the file in the traceback.
    """
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if f.filename == str(path)]
    if frames:
        where = f"model file {shown}, line {frames[-1].lineno}, in {frames[-1].name}"
    else:
        where = f"model file {shown}, in {called}"
    return f"{where}: {one_line(exc, with_type=True)}"


def _import_file(path: Path, shown: str) -> ModuleType:
    """Execute a model file as a fresh module under a unique name."""
    name = _unique_module_name(path)
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ModelContractError(f"cannot import model file {shown}: not a Python source file")
    module = importlib.util.module_from_spec(spec)
    # Registered under its unique name while it runs, so that code in the file
    # that looks itself up (dataclasses, typing.get_type_hints) works.
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except (Exception, SystemExit) as exc:
        del sys.modules[name]
        line = _error_line(exc, path)
        where = f"{shown}, line {line}" if line is not None else shown
        raise ModelContractError(
            f"error in model file {where}: {one_line(exc, with_type=True)}"
        ) from exc
    return module


def _module_subclasses(module: ModuleType) -> list[str]:
    """Names of the ``nn.Module`` subclasses defined in (not imported into) ``module``."""
    return sorted(
        name
        for name, value in vars(module).items()
        if inspect.isclass(value)
        and issubclass(value, nn.Module)
        and value.__module__ == module.__name__
    )


def _model_class(module: ModuleType, model_class: str, shown: str) -> type[nn.Module]:
    value = getattr(module, model_class, None)
    if value is None:
        defined = ", ".join(_module_subclasses(module)) or "(none)"
        raise ModelContractError(
            f"model file {shown} has no class {model_class!r}; "
            f"torch.nn.Module subclasses it defines: {defined} (choose one with --model-class)"
        )
    if not inspect.isclass(value) or not issubclass(value, nn.Module):
        kind = "a class" if inspect.isclass(value) else type(value).__name__
        raise ModelContractError(
            f"{model_class!r} in model file {shown} is not a torch.nn.Module subclass "
            f"(it is {kind})"
        )
    return value


def _callable(module: ModuleType, name: str, signature: str, shown: str) -> Callable[..., object]:
    value = getattr(module, name, None)
    if value is None:
        raise ModelContractError(f"model file {shown} does not define {signature}")
    if not callable(value):
        raise ModelContractError(
            f"{name!r} in model file {shown} is not callable (it is {type(value).__name__}); "
            f"expected {signature}"
        )
    return cast(Callable[..., object], value)


def _columns(module: ModuleType, shown: str) -> tuple[str, ...]:
    example = 'e.g. COLUMNS = ("pixels", "label")'
    if not hasattr(module, "COLUMNS"):
        raise ModelContractError(
            f"model file {shown} does not define COLUMNS, the Parquet columns it reads ({example})"
        )
    columns = module.COLUMNS
    if (
        not isinstance(columns, tuple)
        or not columns
        or not all(isinstance(column, str) and column for column in columns)
    ):
        raise ModelContractError(
            f"COLUMNS in model file {shown} must be a non-empty tuple of column names "
            f"({example}); got {columns!r:.80}"
        )
    if len(set(columns)) != len(columns):
        raise ModelContractError(f"COLUMNS in model file {shown} repeats a column: {columns!r}")
    return columns


def load_model_file(
    path: str | Path,
    model_class: str = "Model",
    model_args: Mapping[str, object] | None = None,
) -> ModelSpec:
    """Import a model file and check it against the contract.

    The file is executed as a module under a unique name, so loading two files
    (or one file twice) never mixes their definitions. Its directory is not
    added to ``sys.path``: a model file should import only installed packages.

    Args:
        path: the model file, e.g. ``examples/mnist_mlp.py``.
        model_class: name of the ``torch.nn.Module`` subclass to train.
        model_args: keyword arguments of its constructor (``--model-args``);
            None for none.

    Returns:
        The validated :class:`ModelSpec`.

    Raises:
        ModelContractError: the file is missing, raises while importing, lacks
            the class (the message lists the ``nn.Module`` subclasses it does
            define), the class is not an ``nn.Module`` subclass, ``loss`` or
            ``batch_to_tensors`` is missing or not callable, ``metrics`` is
            defined but not callable, or ``COLUMNS`` is missing or not a
            tuple of strings.
    """
    shown = str(path)
    resolved = require_model_file(path)
    module = _import_file(resolved, shown)
    cls = _model_class(module, model_class, shown)
    loss = _callable(module, "loss", "loss(outputs, targets) -> Tensor", shown)
    batch_to_tensors = _callable(
        module, "batch_to_tensors", "batch_to_tensors(batch) -> (inputs, targets)", shown
    )
    columns = _columns(module, shown)
    metrics = (
        _callable(module, "metrics", "metrics() -> dict of metrics", shown)
        if getattr(module, "metrics", None) is not None
        else None
    )
    kwargs = dict(model_args or {})
    called = f"{model_class}(**{kwargs!r})" if kwargs else f"{model_class}()"

    def build() -> nn.Module:
        try:
            model = cls(**kwargs)
        except Exception as exc:
            reason = one_line(exc, with_type=True)
            raise ModelContractError(
                f"cannot construct {called} from model file {shown}: {reason}"
            ) from exc
        return model

    return ModelSpec(
        path=resolved,
        model_class=model_class,
        columns=columns,
        build=build,
        loss=cast(Callable[[Any, Any], Tensor], loss),
        batch_to_tensors=cast(Callable[[pa.Table], tuple[Tensor, Tensor]], batch_to_tensors),
        metrics=cast(Callable[[], Mapping[str, Any]] | None, metrics),
        model_args=kwargs,
    )


def _no_batch_to_tensors(batch: pa.Table) -> tuple[Tensor, Tensor]:
    raise ModelContractError(
        "this job's data is a reader function, so it has no batch_to_tensors for Parquet rows"
    )


def in_process_spec(
    model: nn.Module,
    loss: Callable[[Any, Any], Tensor],
    *,
    batch_to_tensors: Callable[[pa.Table], tuple[Tensor, Tensor]] | None = None,
    columns: tuple[str, ...] = (),
) -> ModelSpec:
    """A :class:`ModelSpec` for a model object of the Python API (no model file).

    :meth:`ModelSpec.instantiate` returns a deep copy of ``model`` (its current
    values, whatever the seed), so each trainer thread of
    :func:`elasticps.train` has its own module.

    Args:
        model: the module to train; it is checked with :func:`check_model`.
        loss: ``loss(outputs, targets) -> Tensor``, a scalar mean loss.
        batch_to_tensors: for Parquet data: ``pyarrow.Table -> (inputs, targets)``.
        columns: for Parquet data: the columns ``batch_to_tensors`` reads.

    Raises:
        ModelContractError: the model breaks the contract, or ``loss`` is not callable.
    """
    name = type(model).__name__
    check_model(model, what=name)
    if not callable(loss):
        raise ModelContractError(f"loss must be callable, got {type(loss).__name__}")
    if batch_to_tensors is not None and not callable(batch_to_tensors):
        raise ModelContractError(
            f"batch_to_tensors must be callable, got {type(batch_to_tensors).__name__}"
        )
    template = model

    def build() -> nn.Module:
        try:
            return copy.deepcopy(template)
        except Exception as exc:
            raise ModelContractError(
                f"cannot copy {name}: {one_line(exc, with_type=True)}"
            ) from exc

    return ModelSpec(
        path=Path(f"<{name}>"),
        model_class=name,
        columns=columns,
        build=build,
        loss=loss,
        batch_to_tensors=batch_to_tensors or _no_batch_to_tensors,
    )
