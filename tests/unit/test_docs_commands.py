"""Every ``elasticps`` command in the code blocks of the README and docs/ parses.

Each command line is parsed by the real argument parser: a flag that no
longer exists, a missing required one, a bad value, a placeholder such as
``...`` or a deprecated spelling fails the test, naming the file and line.
"""

from __future__ import annotations

import contextlib
import io
import re
import shlex
from pathlib import Path

import pytest

from elasticps import cli
from elasticps.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^\s*(```|~~~)")
SEPARATORS = {"&&", "||", ";", "|", "&"}


def code_lines(path: Path) -> list[tuple[int, str]]:
    """The logical lines of the file's fenced code blocks (continuations joined)."""
    lines: list[tuple[int, str]] = []
    in_block = False
    pending: tuple[int, str] | None = None
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if FENCE.match(line):
            in_block = not in_block
            continue
        if not in_block:
            continue
        start, text = pending if pending is not None else (number, "")
        text += line
        if text.endswith("\\"):
            pending = (start, text[:-1] + " ")
            continue
        pending = None
        lines.append((start, text))
    return lines


def commands(text: str) -> list[list[str]]:
    """The ``elasticps`` invocations in a shell line, as argument lists (without the program)."""
    lexer = shlex.shlex(text, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    lexer.commenters = "#"
    try:
        tokens = list(lexer)
    except ValueError:  # not shell (e.g. unbalanced quotes in other examples)
        return []
    found: list[list[str]] = []
    segment: list[str] = []
    for token in [*tokens, ";"]:
        if token not in SEPARATORS:
            segment.append(token)
            continue
        words = [w for w in segment if w != "$"]
        while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", words[0]):
            words = words[1:]  # VAR=value elasticps ...
        if words and Path(words[0]).name == "elasticps":
            found.append(words[1:])
        segment = []
    return found


def documented_commands() -> list[tuple[str, list[str]]]:
    found = []
    for path in DOCS:
        for number, line in code_lines(path):
            for argv in commands(line):
                found.append((f"{path.relative_to(ROOT)}:{number}", argv))
    return found


DOCUMENTED = documented_commands()


def test_the_docs_show_commands() -> None:
    places = {where.split(":")[0] for where, _ in DOCUMENTED}
    assert "README.md" in places
    assert len(DOCUMENTED) >= 10


@pytest.mark.parametrize(("where", "argv"), DOCUMENTED, ids=[w for w, _ in DOCUMENTED])
def test_documented_command_parses(where: str, argv: list[str], tmp_path: Path) -> None:
    command = "elasticps " + shlex.join(argv)
    placeholders = [a for a in argv if "..." in a or "…" in a]
    assert not placeholders, f"{where}: placeholder {placeholders} in `{command}`"
    if "--config" in argv:
        # The documented job file holds at least the two flags train requires.
        job_file = tmp_path / "job.toml"
        job_file.write_text('model = "m.py"\ndata = "d"\n')
        argv = list(argv)
        argv[argv.index("--config") + 1] = str(job_file)
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr), contextlib.redirect_stdout(io.StringIO()):
            cli.parse_args(argv)
    except ConfigError as exc:
        pytest.fail(f"{where}: `{command}` does not parse: {exc}")
    except SystemExit as exc:  # --help, --version
        assert exc.code == 0, f"{where}: `{command}` exits with {exc.code}"
    assert "deprecated" not in stderr.getvalue(), f"{where}: `{command}`: {stderr.getvalue()}"


def test_a_wrong_flag_placeholder_or_old_spelling_is_caught() -> None:
    (bad_flag,) = commands("elasticps train --model m.py --data d --no-such-flag")
    with pytest.raises(ConfigError):
        cli.build_parser().parse_args(bad_flag)
    assert commands(".venv/bin/elasticps train ... --resume DIR") == [
        ["train", "...", "--resume", "DIR"]
    ]
    assert commands("X=1 elasticps list && elasticps status j # comment") == [
        ["list"],
        ["status", "j"],
    ]
    assert commands("elasticps: error: a message") == []
