"""Where a job's data and checkpoints live: local paths and storage URLs, through fsspec.

Every path a job reads or writes (``--data``, ``--output``, ``--resume``, a
parameter server's ``--checkpoint-dir``) is a :class:`Location`: a plain
path, a ``file://`` URL, or a URL of a file system that `fsspec
<https://filesystem-spec.readthedocs.io>`_ knows: ``s3://bucket/prefix``
(``s3fs``), ``gs://bucket/prefix`` (``gcsfs``), ``hdfs://namenode/path``
(pyarrow's HDFS client). The rest of elasticps calls this module and never a
storage client.

Local locations keep exactly what the code did before (``pathlib`` and
:func:`elasticps.pserver.atomic.write_atomic`: temp file, fsync, rename,
fsync the directory). On a remote location :meth:`Location.write_atomic`
gives the same guarantee, that a reader sees the old object or the new one
and never a part:

- on object stores (S3, GCS, Azure) an object is one PUT (or one completed
  multipart upload), which is visible whole or not at all;
- on other file systems (HDFS) the bytes go to a temporary name in the same
  directory, which is then renamed over the final one.

Credentials are never passed here: fsspec's clients take them from the
standard places (``AWS_*`` environment variables, ``~/.aws`` profiles, an
instance or pod role; ``GOOGLE_APPLICATION_CREDENTIALS``; Kerberos for HDFS),
and a custom endpoint from ``AWS_ENDPOINT_URL`` or fsspec's own configuration
(``FSSPEC_S3_ENDPOINT_URL``). URLs with a user or password in them are
refused, so that a secret never reaches a log or ``run.json``.
"""

from __future__ import annotations

import contextlib
import os
import posixpath
import re
import shutil
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from elasticps.errors import ConfigError, DataError, one_line

__all__ = [
    "OBJECT_STORES",
    "Location",
    "dir_exists",
    "file_exists",
    "is_url",
    "path_or_url",
    "require_file",
]

_SCHEME = re.compile(r"^([a-zA-Z][a-zA-Z0-9+.-]*)://")

OBJECT_STORES: Final = frozenset({"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "memory"})
"""fsspec protocols whose writes of one object are atomic (no rename needed)."""

_GLOB_CHARS: Final = frozenset("*?[")


def is_url(where: str | os.PathLike[str]) -> bool:
    """Whether ``where`` is a URL (``scheme://...``) other than ``file://``."""
    m = _SCHEME.match(os.fspath(where))
    return m is not None and m.group(1).lower() != "file"


@dataclass(frozen=True)
class Location:
    """A file or directory, local or on a remote file system.

    Build one with :meth:`of`. ``Location.of("runs/x") / "snapshot"`` is the
    directory ``runs/x/snapshot``; ``Location.of("s3://b/runs/x") / "snapshot"``
    the prefix ``s3://b/runs/x/snapshot``. A directory on an object store is
    just a prefix: it exists once an object is under it.

    Attributes:
        url: the location as given, normalised: a local path (``file://``
            stripped), or ``scheme://rest`` without a trailing ``/``.
    """

    url: str

    @classmethod
    def of(cls, where: str | os.PathLike[str] | Location) -> Location:
        """The location named by a path, a URL or another location.

        Raises:
            ConfigError: the URL holds credentials (``user:password@``), or
                is empty.
        """
        if isinstance(where, Location):
            return where
        text = os.fspath(where)
        if not text:
            raise ConfigError("an empty path or URL")
        m = _SCHEME.match(text)
        if m is None:
            return cls(text)
        scheme = m.group(1).lower()
        rest = text[m.end() :]
        if scheme == "file":
            return cls(rest or "/")
        netloc = rest.split("/", 1)[0]
        if "@" in netloc:
            raise ConfigError(
                f"{scheme}:// URLs must not carry credentials; give them in the environment "
                "or a profile (the URL is written to logs)"
            )
        return cls(f"{scheme}://{rest.rstrip('/')}")

    # --- naming -----------------------------------------------------------------

    @property
    def scheme(self) -> str:
        """The URL scheme, lower case (``s3``, ``gs``, ``hdfs``); ``""`` if local."""
        m = _SCHEME.match(self.url)
        return "" if m is None else m.group(1).lower()

    @property
    def is_local(self) -> bool:
        """Whether this is a path of the local file system."""
        return not self.scheme

    @property
    def local_path(self) -> Path:
        """The local path.

        Raises:
            ConfigError: the location is remote.
        """
        if not self.is_local:
            raise ConfigError(f"{self.url} is not a local path")
        return Path(self.url)

    @property
    def name(self) -> str:
        """The last component."""
        if self.is_local:
            return Path(self.url).name
        return posixpath.basename(self.url.split("://", 1)[1])

    @property
    def parent(self) -> Location:
        """The directory holding this location."""
        if self.is_local:
            return Location(str(Path(self.url).parent))
        scheme, rest = self.url.split("://", 1)
        return Location(f"{scheme}://{posixpath.dirname(rest)}")

    def __truediv__(self, name: str) -> Location:
        if self.is_local:
            return Location(str(Path(self.url) / name))
        return Location(f"{self.url}/{name.strip('/')}")

    def __str__(self) -> str:
        return self.url

    def resolve(self) -> Location:
        """An absolute local path (what ``Path.resolve`` gives); a URL as it is."""
        return Location(str(Path(self.url).resolve())) if self.is_local else self

    @property
    def has_glob(self) -> bool:
        """Whether the last component holds a glob pattern (``*``, ``?``, ``[``)."""
        return any(c in _GLOB_CHARS for c in self.name)

    # --- the file system ----------------------------------------------------------

    def _fs(self) -> tuple[Any, str]:
        """``(fsspec file system, path in it)``; remote locations only.

        Raises:
            ConfigError: fsspec (or the protocol's package, e.g. s3fs) is
                not installed, or the scheme is unknown.
        """
        try:
            import fsspec
        except ImportError as exc:  # pragma: no cover - fsspec ships with torch
            raise ConfigError(
                f"{self.url}: storage URLs need fsspec: pip install 'elasticps[storage]'"
            ) from exc
        try:
            # Other processes write here too: never answer from a cached listing.
            options = {"use_listings_cache": False} if self.scheme in OBJECT_STORES else {}
            fs, path = fsspec.core.url_to_fs(self.url, **options)
        except (ImportError, ValueError) as exc:
            raise ConfigError(
                f"{self.scheme}:// URLs need a package that is not installed "
                f"({one_line(exc)}); pip install 'elasticps[storage]'"
            ) from exc
        return fs, str(path)

    def exists(self) -> bool:
        """Whether a file or directory (a non-empty prefix) is here.

        Raises:
            OSError: the storage cannot be reached.
        """
        if self.is_local:
            return os.path.exists(self.url)
        fs, path = self._fs()
        return bool(fs.exists(path))

    def is_file(self) -> bool:
        """Whether a file (an object) is here.

        Raises:
            OSError: the storage cannot be reached.
        """
        if self.is_local:
            return os.path.isfile(self.url)
        fs, path = self._fs()
        return bool(fs.isfile(path))

    def is_dir(self) -> bool:
        """Whether a directory (a prefix with objects under it) is here.

        Raises:
            OSError: the storage cannot be reached.
        """
        if self.is_local:
            return os.path.isdir(self.url)
        fs, path = self._fs()
        return bool(fs.isdir(path))

    def size(self) -> int:
        """Size of the file, bytes.

        Raises:
            OSError: there is no file here (``FileNotFoundError``), or the
                storage cannot be reached.
        """
        if self.is_local:
            return os.path.getsize(self.url)
        fs, path = self._fs()
        return int(fs.size(path))

    def listdir(self) -> list[str]:
        """Names of the entries of this directory, sorted; empty if there is none.

        Raises:
            OSError: the storage cannot be reached.
        """
        if self.is_local:
            try:
                return sorted(os.listdir(self.url))
            except (FileNotFoundError, NotADirectoryError):
                return []
        fs, path = self._fs()
        try:
            entries = fs.ls(path, detail=False, refresh=True)
        except FileNotFoundError:
            return []
        names = {posixpath.basename(str(e).rstrip("/")) for e in entries}
        names.discard("")
        return sorted(names)

    def glob(self) -> list[Location]:
        """The files matching this location's glob pattern, sorted.

        Raises:
            OSError: the storage cannot be reached.
        """
        if self.is_local:
            parent = Path(self.url).parent
            return [Location(str(p)) for p in sorted(parent.glob(self.name))]
        fs, path = self._fs()
        scheme = self.scheme
        return [Location(f"{scheme}://{p}") for p in sorted(fs.glob(path)) if fs.isfile(p)]

    def read_bytes(self) -> bytes:
        """The whole file.

        Raises:
            OSError: it is missing (``FileNotFoundError``) or cannot be read.
        """
        if self.is_local:
            return Path(self.url).read_bytes()
        fs, path = self._fs()
        return bytes(fs.cat_file(path))

    def read_text(self) -> str:
        """The whole file as UTF-8 text (see :meth:`read_bytes`)."""
        return self.read_bytes().decode("utf-8")

    def open_input(self) -> Any:
        """A seekable binary file for reading (pyarrow reads Parquet through it).

        Remote files are opened without read-ahead, so that a reader fetches
        the byte ranges it asks for (a Parquet reader: the footer, then the
        column chunks of the row groups it decodes) and nothing more.

        Raises:
            OSError: the file is missing or cannot be opened.
        """
        if self.is_local:
            return open(self.url, "rb")
        fs, path = self._fs()
        return fs.open(path, "rb", cache_type="none")

    def makedirs(self) -> None:
        """Create this directory (and its parents) where the file system has directories.

        Object stores have none: there it does nothing.

        Raises:
            OSError: it cannot be created.
        """
        if self.is_local:
            Path(self.url).mkdir(parents=True, exist_ok=True)
            return
        fs, path = self._fs()
        if self.scheme not in OBJECT_STORES:
            fs.makedirs(path, exist_ok=True)

    def write_atomic(self, data: bytes) -> None:
        """Replace this file by ``data``, so that a reader sees the old or the new, never a mix.

        Local: temp file, fsync, rename, fsync the directory
        (:func:`elasticps.pserver.atomic.write_atomic`). Object stores: one
        upload, visible whole or not at all. Other remote file systems: a
        temporary name in the same directory, then a rename.

        Raises:
            OSError: the file cannot be written (the previous one is untouched).
        """
        if self.is_local:
            from elasticps.pserver.atomic import write_atomic

            write_atomic(Path(self.url), data)
            return
        fs, path = self._fs()
        if self.scheme in OBJECT_STORES:
            fs.pipe_file(path, data)
            return
        parent = posixpath.dirname(path)
        fs.makedirs(parent, exist_ok=True)
        tmp = posixpath.join(parent, f".{posixpath.basename(path)}.{uuid.uuid4().hex}.tmp")
        try:
            fs.pipe_file(tmp, data)
            with contextlib.suppress(FileNotFoundError):
                fs.rm_file(path)  # HDFS renames do not replace
            fs.mv(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                fs.rm_file(tmp)
            raise

    def write_text(self, text: str) -> None:
        """:meth:`write_atomic` of UTF-8 text."""
        self.write_atomic(text.encode("utf-8"))

    def remove(self) -> None:
        """Delete this file; nothing if it is missing.

        Raises:
            OSError: it exists and cannot be deleted.
        """
        if self.is_local:
            Path(self.url).unlink(missing_ok=True)
            return
        fs, path = self._fs()
        with contextlib.suppress(FileNotFoundError):
            fs.rm_file(path)

    def remove_tree(self) -> None:
        """Delete this directory and all under it; nothing if it is missing.

        Raises:
            OSError: it cannot be deleted.
        """
        if self.is_local:
            shutil.rmtree(self.url, ignore_errors=True)
            return
        fs, path = self._fs()
        with contextlib.suppress(FileNotFoundError):
            fs.rm(path, recursive=True)

    def copy_to(self, target: Location) -> None:
        """Copy this file to ``target`` atomically (a hard link where both are local).

        Raises:
            OSError: it cannot be read or the copy cannot be written.
        """
        if self.is_local and target.is_local:
            try:
                os.link(self.url, target.url)
            except OSError:
                target.write_atomic(self.read_bytes())
            return
        if not self.is_local and self.scheme == target.scheme and self.scheme in OBJECT_STORES:
            fs, path = self._fs()
            _, target_path = target._fs()
            fs.copy(path, target_path)  # a server-side copy: one object, atomic
            return
        target.write_atomic(self.read_bytes())

    def copy_tree_to(self, target: Location) -> None:
        """Copy the files under this directory to ``target``, each atomically.

        Raises:
            OSError: a file cannot be read or written.
        """
        for name in self.listdir():
            source = self / name
            if source.is_dir():
                source.copy_tree_to(target / name)
            else:
                source.copy_to(target / name)


def file_exists(location: Location) -> bool:
    """``location.is_file()``, an unreachable storage reported as a user error.

    Raises:
        DataError: the storage cannot be reached.
    """
    return _ask(location, location.is_file)


def dir_exists(location: Location) -> bool:
    """``location.is_dir()``, an unreachable storage reported as a user error.

    Raises:
        DataError: the storage cannot be reached.
    """
    return _ask(location, location.is_dir)


def require_file(location: Location, what: str = "data file") -> Location:
    """Return ``location`` if a file is there.

    Raises:
        DataError: there is none, or the storage cannot be reached.
    """
    if not _ask(location, location.is_file, what):
        raise DataError(f"{what} not found: {location}")
    return location


def _ask(location: Location, question: Callable[[], bool], what: str = "") -> bool:
    """``question()`` about ``location``; an OSError becomes a DataError naming ``what``."""
    try:
        return question()
    except OSError as exc:
        named = f"{what} {location}" if what else str(location)
        raise DataError(f"cannot reach {named}: {one_line(exc)}") from exc


def path_or_url(text: str) -> str | Path:
    """A command-line value: a URL kept as text, anything else a :class:`~pathlib.Path`.

    A ``Path`` would fold the ``//`` of ``s3://bucket``; a ``file://`` URL
    becomes its path.
    """
    if is_url(text):
        return text
    return Path(Location.of(text).url)
