"""Job files: the flags of ``elasticps train`` as a TOML file.

``elasticps train --config job.toml`` takes every flag from the file, one key
per flag, named as the flag without its dashes::

    model = "examples/mnist_cnn.py"
    data = "data/mnist"
    trainers = 2
    ps = 2
    mode = "sync"
    epochs = 5
    output = "runs/mnist"

Flags given on the command line override the file. Paths are read as on
the command line: relative to the directory where ``elasticps`` runs. A key
that is no flag of ``train``, or a value of the wrong type, is a one-line
error naming the file and the key.

Every run writes its resolved configuration (every flag's value, defaults
included) as ``OUTPUT/config.toml`` (:func:`config_toml`), so that
``elasticps train --config OUTPUT/config.toml --overwrite`` repeats it. The
file leaves out ``overwrite``: it is what the command does to the output
directory, not part of the job.

TOML is read with the standard library's :mod:`tomllib` and written with
``tomli-w``.
"""

from __future__ import annotations

import argparse
import tomllib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Final

from elasticps.errors import ConfigError
from elasticps.storage import path_or_url

__all__ = ["CONFIG_FILE", "NOT_RECORDED", "apply_config_file", "config_toml", "resolved_config"]

CONFIG_FILE: Final = "config.toml"
"""The name of the resolved configuration in a run's output directory."""

NOT_RECORDED: Final = frozenset({"help", "config", "overwrite"})
"""Destinations of ``train`` that a job file does not hold."""


def _key(action: argparse.Action) -> str:
    """The job-file key of a flag: its first long option without the dashes."""
    longs = [s for s in action.option_strings if s.startswith("--")]
    return longs[0][2:]


def _flags(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """Job-file key -> action, for every recordable flag of ``parser``."""
    return {
        _key(a): a
        for a in parser._actions
        if a.option_strings and a.dest not in NOT_RECORDED and a.help != argparse.SUPPRESS
    }


def _coerce(action: argparse.Action, value: object, where: str) -> object:
    """A TOML value as argparse would have made it from the command line.

    Raises:
        ConfigError: the value has the wrong type or is not one of the choices.
    """
    if isinstance(action, argparse._StoreTrueAction | argparse._StoreFalseAction):
        if not isinstance(value, bool):
            raise ConfigError(f"{where}: expected true or false, got {value!r}")
        return value
    if action.nargs in ("+", "*"):
        items = value if isinstance(value, list) else [value]
        return [_coerce_one(action, item, where) for item in items]
    return _coerce_one(action, value, where)


def _coerce_one(action: argparse.Action, value: object, where: str) -> object:
    kind = action.type
    if isinstance(value, bool | dict | list):
        raise ConfigError(f"{where}: expected a single value, got {value!r}")
    if kind is int:
        if not isinstance(value, int):
            raise ConfigError(f"{where}: expected an integer, got {value!r}")
        result: object = value
    elif kind is float:
        if not isinstance(value, int | float):
            raise ConfigError(f"{where}: expected a number, got {value!r}")
        result = float(value)
    elif kind is Path or kind is path_or_url:
        if not isinstance(value, str):
            raise ConfigError(f"{where}: expected a path (a string), got {value!r}")
        result = path_or_url(value) if kind is path_or_url else Path(value)
    else:
        # Flags taken as text (--trainers 2 or "1:4", --chaos ...): numbers as written.
        if not isinstance(value, str | int | float):
            raise ConfigError(f"{where}: expected a string, got {value!r}")
        result = str(value)
    if action.choices is not None and result not in action.choices:
        choices = ", ".join(repr(c) for c in action.choices)
        raise ConfigError(f"{where}: {value!r} is not one of {choices}")
    return result


def apply_config_file(parser: argparse.ArgumentParser, path: Path) -> None:
    """Make the values of the job file ``path`` the defaults of ``parser``'s flags.

    A flag the file sets is no longer required on the command line; one given
    there still overrides the file.

    Args:
        parser: the ``train`` subparser.
        path: the TOML job file.

    Raises:
        ConfigError: the file cannot be read or is not TOML, or a key is no
            flag, or a value has the wrong type.
    """
    try:
        data = tomllib.loads(path.read_text())
    except OSError as exc:
        raise ConfigError(f"--config {path}: {exc.strerror or exc}") from None
    except (UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"--config {path}: not a TOML file: {exc}") from None
    flags = _flags(parser)
    defaults: dict[str, object] = {}
    for raw_key, value in data.items():
        key = raw_key.replace("_", "-")
        action = flags.get(key)
        if action is None:
            raise ConfigError(f"--config {path}: {raw_key!r} is not a flag of elasticps train")
        defaults[action.dest] = _coerce(action, value, f"--config {path}: {raw_key}")
        action.required = False
    parser.set_defaults(**defaults)


def resolved_config(parser: argparse.ArgumentParser, args: argparse.Namespace) -> dict[str, Any]:
    """Every recordable flag's value after parsing, keyed as in a job file.

    Flags whose value is unset (None) are left out: TOML has no null, and
    their default is None.

    Args:
        parser: the ``train`` subparser.
        args: what it parsed.

    Returns:
        A TOML-ready mapping: strings, numbers, booleans and lists of strings.
    """
    values: dict[str, Any] = {}
    for key, action in _flags(parser).items():
        value = getattr(args, action.dest, None)
        if value is None:
            continue
        values[key] = _plain(value)
    return values


def _plain(value: object) -> object:
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value


def config_toml(values: Mapping[str, Any], header: Sequence[str] = ()) -> str:
    """The TOML text of a job file, with ``header`` lines as comments on top.

    Args:
        values: as :func:`resolved_config` returns.
        header: comment lines (without ``#``).

    Returns:
        The file's text.
    """
    import tomli_w

    comments = "".join(f"# {line}\n" for line in header)
    return comments + tomli_w.dumps(dict(values))
