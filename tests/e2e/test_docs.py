"""The README and docs/: a short front page, links that resolve, and every command shown valid for the CLI
(`make docs-check` runs them all: tests/docs_commands.py)."""

from __future__ import annotations

import re

import pytest
import typer

import reproduce.cli  # noqa: F401  (registers every command on the app)
from docs_commands import DOCS, ROOT, doc_commands
from reproduce.cli.app import app


def test_the_readme_is_a_front_page_under_300_lines():
    assert len((ROOT / "README.md").read_text().splitlines()) < 300


@pytest.mark.parametrize("path", DOCS, ids=lambda p: p.name)
def test_every_relative_link_resolves(path):
    text = path.read_text()
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text)
    missing = [link for link in links if "://" not in link and not (path.parent / link).exists()]
    assert not missing, f"{path.name}: links to missing files: {missing}"


def test_every_docs_topic_is_in_the_index():
    index = (ROOT / "docs" / "README.md").read_text()
    pages = {p.name for p in (ROOT / "docs").glob("*.md")} - {"README.md"}
    assert {page for page in pages if f"({page})" not in index} == set()


def _command(argv: list[str]):
    command = typer.main.get_command(app)
    rest = list(argv)
    while hasattr(command, "commands") and rest and rest[0] in command.commands:
        command = command.commands[rest.pop(0)]
    return command, rest


COMMANDS = [command for command in doc_commands() if command.module == "reproduce"]


def test_the_docs_show_commands():
    assert len(COMMANDS) >= 15
    assert {c.argv[0] for c in COMMANDS} >= {"plan", "run", "probe", "verify", "papers"}


@pytest.mark.parametrize("shown", COMMANDS, ids=str)
def test_each_command_shown_exists_with_its_options_and_files(shown):
    command, rest = _command(shown.argv)
    assert not hasattr(command, "commands") or not rest, f"{shown}: no such command"
    options = {name for param in command.params for name in (*param.opts, *param.secondary_opts)}
    unknown = [token.split("=")[0] for token in rest if token.startswith("-") and token.split("=")[0] not in options]
    assert not unknown, f"{shown}: unknown options {unknown}"
    files = [token for token in rest if re.match(r"^(papers|reproduce)/.*\.yaml$", token)]
    assert all((ROOT / f).exists() for f in files), f"{shown}: missing {files}"
