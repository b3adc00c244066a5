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
from typing import TYPE_CHECKING

from elasticps.coord.etcd_server import EtcdProcess, EtcdServer, EtcdServerConfig
from elasticps.jobca import JobCA
from elasticps.security import write_etcd_server_tls

if TYPE_CHECKING:
    from elasticps.config import JobConfig

__all__ = ["JobScratch", "user_ca"]


def user_ca(config: JobConfig) -> JobCA | None:
    """The user's own CA (``--ca``), or None to make one for the job.

    Raises:
        ConfigError: the CA's files are missing, unreadable or not a CA.
    """
    if config.ca is None or config.auth != "on":
        return None
    return JobCA.read(config.ca, config.job)


@dataclass(frozen=True)
class JobScratch:
    """The job's temporary directory and the etcd whose data lives in it.

    Attributes:
        path: the directory (``elasticps-<job>-*`` under the system's temporary
            directory); removed by :meth:`close`.
        etcd: the job's etcd, data in ``path/etcd``, log in ``path/etcd.log``;
            not started.
        ca: the job's certificate authority, which etcd's certificate
            (``path/etcd-tls``) comes from and whose client certificates it
            asks for; None: etcd speaks plain TCP and checks no client.
    """

    path: Path
    etcd: EtcdProcess
    ca: JobCA | None = None

    @classmethod
    def create(
        cls,
        job: str,
        etcd_port: int = 0,
        host: str = "127.0.0.1",
        *,
        tls: bool = False,
        ca: JobCA | None = None,
    ) -> JobScratch:
        """A new directory and an etcd for it on ``host``:``etcd_port`` (0: a free port).

        Args:
            job: the job's name.
            etcd_port: etcd's client port; 0 picks a free one.
            host: the address etcd listens on.
            tls: run etcd with client TLS from the job's CA.
            ca: that CA (the user's ``--ca``); None: a new one.

        Raises:
            OSError: the directory cannot be created.
        """
        path = Path(tempfile.mkdtemp(prefix=f"elasticps-{job}-"))
        if tls and ca is None:
            ca = JobCA.generate(job)
        if not tls:
            ca = None
        tls_dir = None
        if ca is not None:
            tls_dir = write_etcd_server_tls(ca, path / "etcd-tls", (host,))
        etcd = EtcdServer(
            EtcdServerConfig(data_dir=path / "etcd", client_port=etcd_port, host=host, tls=tls_dir),
            log_path=path / "etcd.log",
        )
        return cls(path, etcd, ca)

    def close(self) -> None:
        """Stop etcd (by PID: SIGTERM, then SIGKILL after 10 s) and remove the directory.

        Idempotent.
        """
        self.etcd.stop()
        shutil.rmtree(self.path, ignore_errors=True)
