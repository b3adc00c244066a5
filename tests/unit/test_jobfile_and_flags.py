"""Job files (``train --config``), ``--version``, ``--output`` spellings and the trainers rule."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from elasticps import __version__, cli
from elasticps.errors import ConfigError
from elasticps.jobfile import config_toml, resolved_config


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "job.toml"
    path.write_text(text)
    return path


def test_job_file_values_are_defaults_that_flags_override(tmp_path: Path) -> None:
    job = write(
        tmp_path,
        'model = "m.py"\ndata = "d"\nepochs = 3\nlr = 1\ntrainers = 4\n'
        'mode = "async"\nno_progress = true\n',
    )
    args = cli.parse_args(["train", "--config", str(job), "--epochs", "7"])
    assert (args.model, args.data) == (Path("m.py"), Path("d"))
    assert (args.epochs, args.lr, args.trainers, args.mode) == (7, 1.0, "4", "async")
    assert args.no_progress is True
    assert args.batch_size == 32  # untouched default


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('model = "m.py"\ndata = "d"\nbogus = 1\n', "'bogus' is not a flag of elasticps train"),
        ('model = "m.py"\ndata = "d"\nepochs = "five"\n', "epochs: expected an integer"),
        ('model = "m.py"\ndata = "d"\nmode = "fast"\n', "mode: 'fast' is not one of"),
        ('model = "m.py"\ndata = "d"\nno-progress = 1\n', "expected true or false"),
        ('model = 3\ndata = "d"\n', "model: expected a path"),
        ("model = \n", "not a TOML file"),
    ],
)
def test_a_bad_job_file_is_one_error_naming_file_and_key(
    tmp_path: Path, text: str, message: str
) -> None:
    job = write(tmp_path, text)
    with pytest.raises(ConfigError, match=message) as caught:
        cli.parse_args(["train", "--config", str(job)])
    assert str(job) in str(caught.value)


def test_a_missing_job_file_is_a_user_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="No such file"):
        cli.parse_args(["train", "--config", str(tmp_path / "nope.toml")])


def test_resolved_configuration_reads_back_as_the_same_arguments(tmp_path: Path) -> None:
    argv = ["train", "--model", "m.py", "--data", "d", "--trainers", "1:3", "--seed", "5",
            "--chaos", "kill:trainer@20s", "--overwrite"]  # fmt: skip
    args = cli.parse_args(argv)
    train = cli.subparser(cli.build_parser(), "train")
    values = resolved_config(train, args)
    assert "overwrite" not in values and "config" not in values
    assert "initial-trainers" not in values  # None: left out
    text = config_toml(values, header=["a comment"])
    assert text.startswith("# a comment\n")
    assert tomllib.loads(text) == values
    again = cli.parse_args(["train", "--config", str(write(tmp_path, text))])
    assert resolved_config(train, again) == values
    again.overwrite = True  # not recorded: what the command does to OUTPUT, not the job
    assert cli.job_config(again) == cli.job_config(args)


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as caught:
        cli.parse_args(["--version"])
    assert caught.value.code == 0
    assert capsys.readouterr().out.strip() == f"elasticps {__version__}"


@pytest.mark.parametrize(
    ("argv", "old"),
    [
        (["data", "mnist", "--out", "x"], "--out"),
        (["checkpoint", "--etcd", "e", "--out", "x"], "--out"),
        (["evaluate", "--model", "m", "--data", "d", "--checkpoint", "x"], "--checkpoint"),
    ],
)
def test_old_spellings_of_output_work_with_a_warning(
    argv: list[str], old: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.parse_args(argv).output == Path("x")
    err = capsys.readouterr().err
    assert f"elasticps: warning: {old} is deprecated" in err and "use --output" in err
    new = [("--output" if a == old else a) for a in argv]
    assert cli.parse_args(new).output == Path("x")
    assert capsys.readouterr().err == ""


def test_output_is_required_where_it_has_no_default() -> None:
    with pytest.raises(ConfigError, match="required: --output"):
        cli.parse_args(["data", "mnist"])


def test_an_elastic_range_starts_at_max_unless_told() -> None:
    base = ["train", "--model", "m.py", "--data", "d"]
    config = cli.job_config(cli.parse_args([*base, "--trainers", "1:4"]))
    assert (config.trainers, config.min_trainers, config.max_trainers) == (4, 1, 4)
    config = cli.job_config(cli.parse_args([*base, "--trainers", "1:4", "--initial-trainers", "2"]))
    assert config.trainers == 2
