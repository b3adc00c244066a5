"""A local job's temporary directory and its etcd, which can start before torch is imported.

``elasticps train`` creates this first and starts etcd in it (:meth:`EtcdServer.spawn`,
which returns at once), then imports torch and the role modules (about 1.5 s
here) while etcd starts; :class:`~elasticps.launcher.local.LocalLauncher`
then waits for etcd to answer. Nothing here imports torch.
"""

from __future__ import annotations

import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from elasticps.coord.etcd_server import EtcdProcess, EtcdServer, EtcdServerConfig

__all__ = ["JobScratch"]


@dataclass(frozen=True)
class JobScratch:
    """The job's temporary directory and the etcd whose data lives in it.

    Attributes:
        path: the directory (``elasticps-<job>-*`` under the system's temporary
            directory); removed by :meth:`close`.
        etcd: the job's etcd, data in ``path/etcd``, log in ``path/etcd.log``;
            not started.
    """

    path: Path
    etcd: EtcdProcess

    @classmethod
    def create(cls, job: str, etcd_port: int = 0, host: str = "127.0.0.1") -> JobScratch:
        """A new directory and an etcd for it on ``host``:``etcd_port`` (0: a free port).

        Raises:
            OSError: the directory cannot be created.
        """
        path = Path(tempfile.mkdtemp(prefix=f"elasticps-{job}-"))
        etcd = EtcdServer(
            EtcdServerConfig(data_dir=path / "etcd", client_port=etcd_port, host=host),
            log_path=path / "etcd.log",
        )
        return cls(path, etcd)

    def close(self) -> None:
        """Stop etcd (by PID: SIGTERM, then SIGKILL after 10 s) and remove the directory.

        Idempotent.
        """
        self.etcd.stop()
        shutil.rmtree(self.path, ignore_errors=True)
