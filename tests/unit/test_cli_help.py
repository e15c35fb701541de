"""`meshforge --version` and `meshforge --help`, in-process: the version, and the
commands listed under their groups (run, inspect, plan, cluster) in plain text."""

import re

import typer.main
from typer.testing import CliRunner

import meshforge
from meshforge.cli import app

runner = CliRunner()

GROUPS = {
    "Run": {"train", "worker", "scale", "data"},
    "Inspect": {"report", "top", "diagnose", "sample", "export"},
    "Plan": {"plan", "cost"},
    "Cluster": {"submit", "preflight", "bench"},
}


def _sections(text: str) -> dict[str, set[str]]:
    """The help's sections: a line `Name:` at column 0, then its indented entries."""
    sections: dict[str, set[str]] = {}
    current = None
    for line in text.splitlines():
        header = re.fullmatch(r"(\w[\w ]*):", line)
        if header:
            current = sections.setdefault(header.group(1), set())
        elif current is not None and re.match(r"  \S", line):
            current.add(line.split()[0])
    return sections


def test_version_prints_the_package_version():
    result = runner.invoke(app, ["--version"])
    assert result.exit_code == 0, result.output
    assert result.output.strip() == f"meshforge {meshforge.__version__}"


def test_help_lists_every_command_under_its_group():
    result = runner.invoke(app, ["--help"])
    assert result.exit_code == 0, result.output
    sections = _sections(result.output)
    for group, commands in GROUPS.items():
        assert sections.get(group) == commands, (group, sections)
    # every command is in one of the groups, none left in a catch-all section
    assert "Commands" not in sections, sections
    listed = [name for group in GROUPS for name in sections[group]]
    assert sorted(listed) == sorted(typer.main.get_command(app).commands)
    # the groups come in their order, and the text is plain: no colours, no boxes
    positions = [result.output.index(f"\n{group}:\n") for group in GROUPS]
    assert positions == sorted(positions)
    assert "\x1b[" not in result.output and "─" not in result.output
    assert "--version" in sections["Options"]
