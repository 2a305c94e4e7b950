"""Every help text the CLI shows is plain text: no reStructuredText or Markdown markup from
docstrings (double backticks, :class:/:func:/:mod: roles, single backticks)."""

from __future__ import annotations

import re
from collections.abc import Iterator

from typer.main import get_command
from typer.testing import CliRunner

from apiary.cli import main as cli

MARKUP = re.compile(r"``|`|:(?:class|func|mod|meth|attr|data|exc):")


def command_paths(command, path: tuple[str, ...] = ()) -> Iterator[tuple[str, ...]]:
    """Every command and group under ``command`` (hidden ones too), as CLI word paths."""
    yield path
    for name, sub in getattr(command, "commands", {}).items():
        yield from command_paths(sub, (*path, name))


def test_every_help_is_plain_text() -> None:
    paths = list(command_paths(get_command(cli.app)))
    assert ("job", "list") in paths and ("sim", "trace") in paths and ("cluster", "status") in paths
    runner = CliRunner()
    for path in paths:
        result = runner.invoke(cli.app, [*path, "--help"])
        assert result.exit_code == 0, (path, result.output)
        found = MARKUP.findall(result.output)
        assert not found, f"apiary {' '.join(path)} --help shows markup {found}:\n{result.output}"
