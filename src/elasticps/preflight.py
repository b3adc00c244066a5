"""Checks of a job's inputs that import nothing heavy: a mistake is refused in under a second.

``elasticps train`` imports torch, gRPC and pyarrow (about 3.5 s of CPU) before
it loads the model file, and a job's first checks need the model (its
``COLUMNS``). The mistakes that need neither, a mistyped path or a port in use,
are refused here first, before those imports:

- the model file exists;
- the training data names at least one Parquet file (a local dataset);
- a local ``--resume`` is a directory, and not a job's output directory;
- ``--etcd-port`` and ``--master-port`` are free;
- ``--output`` is, or can be created as, a writable directory.

Nothing here touches the network or starts a thread: the launcher forks its
fork server after these checks (see :mod:`elasticps.launcher.spawn`), and a URL
(``s3://...``) is left to :meth:`elasticps.launcher.local.LocalLauncher.validate`,
which repeats every check here and adds the rest.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from elasticps.errors import DataError, ModelContractError
from elasticps.netutil import check_port_free
from elasticps.storage import Location, dir_exists, file_exists, is_url

if TYPE_CHECKING:
    from elasticps.config import JobConfig

__all__ = ["check_before_import", "check_resume_location", "require_model_file"]


def require_model_file(path: str | Path) -> Path:
    """The model file's absolute path.

    Raises:
        ModelContractError: no file is at ``path``.
    """
    resolved = Path(path).resolve()
    if not resolved.is_file():
        raise ModelContractError(f"model file not found: {path}")
    return resolved


def check_resume_location(resume: str | Path) -> None:
    """Refuse a ``--resume`` that is no directory, or a job's output directory.

    Args:
        resume: the ``--resume`` value, a path or a URL.

    Raises:
        DataError: either case (the second names the checkpoint to resume
            from), or the storage cannot be reached.
    """
    where = Location.of(resume)
    if not dir_exists(where):
        raise DataError(f"--resume {resume}: no such directory")
    if file_exists(where / "run.json") and dir_exists(where / "snapshot"):
        raise DataError(
            f"--resume {resume} is a job's output directory; its consistent checkpoint is "
            f"{where / 'snapshot'}"
        )


def check_before_import(config: JobConfig) -> None:
    """The checks of this module's docstring, for a local job.

    Raises:
        ModelContractError: the model file is missing.
        DataError: no training file, or a bad ``--resume``.
        PortInUseError: ``--etcd-port`` or ``--master-port`` is taken.
        ConfigError: ``--output`` cannot be a writable directory.
    """
    from elasticps.launcher.output import check_output_location

    require_model_file(config.model_path)
    if not config.stream and not is_url(config.data):
        from elasticps.data.parquet import resolve_dataset_files

        resolve_dataset_files(config.data, "train")
    if config.resume is not None and not is_url(config.resume):
        check_resume_location(config.resume)
    if config.etcd_port:
        check_port_free(config.etcd_port, what="--etcd-port")
    if config.master_port:
        check_port_free(config.master_port, what="--master-port")
    check_output_location(config.output)
