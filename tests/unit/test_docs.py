"""Docs that stay true: every `eaglet ...` command quoted in README.md and docs/ names a real
subcommand and real flags, and every relative link or repository path they name exists."""

from __future__ import annotations

import argparse
import re
import shlex
from pathlib import Path

import pytest

from eaglet.cli import parser

from ..conftest import ROOT

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("**/*.md"))]
COMMAND = re.compile(r"(?:^\s*|/|[$&|;]\s*)eaglet\s+([a-z][a-z-]*)(?=\s|$)([^#\n]*)")
SPAN = re.compile(r"`([^`]*)`")
LINK = re.compile(r"\]\(([^)\s]+)\)")
CODE_PATH = re.compile(r"`([A-Za-z0-9_.\-/]+)`")
TOP = ("src/", "tests/", "benchmarks/", "examples/", "rules/", "docs/", "profiles/", "envs/")
FILE_ARG = re.compile(r"(?:--params|--target-config|--overlay|params=|overlay=)[\s=]*([\w./-]+)")
COPIED = re.compile(r"\bcp\s+\S+\s+([\w./-]+)")
PLACEHOLDER = re.compile(r"[<>{}*$]|\.\.\.")
MODULE = re.compile(r"-m\s+(benchmarks\.\w+)")


def _subcommands() -> dict[str, argparse.ArgumentParser]:
    sub = next(a for a in parser()._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


def code(text: str) -> list[tuple[int, str]]:
    """The code in a Markdown page, by line: fenced or indented blocks whole, else inline spans."""
    out, fenced = [], False
    for n, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif fenced or line.startswith("    "):
            out.append((n, line))
        else:
            out += [(n, span) for span in SPAN.findall(line)]
    return out


def command_errors(text: str, where: str) -> list[str]:
    """Each `eaglet SUB --flag ...` in the code of `text` whose subcommand or flag is gone."""
    subs, errors = _subcommands(), []
    for n, line in code(text):
        for m in COMMAND.finditer(line):
            name, rest = m.group(1), m.group(2)
            if name not in subs:
                errors.append(f"{where}:{n}: 'eaglet {name}': no such subcommand")
                continue
            flags = subs[name]._option_string_actions
            try:
                words = shlex.split(rest.replace("[", " ").replace("]", " "), comments=True)
            except ValueError:
                words = rest.split()
            for w in words:
                flag = w.split("=", 1)[0]
                if flag.startswith("--") and flag not in flags:
                    errors.append(f"{where}:{n}: 'eaglet {name} {flag}': no such flag")
    return errors


def anchors(text: str) -> set[str]:
    """The anchors GitHub gives a page's headings: lowercased, punctuation dropped, spaces as
    hyphens; a repeated heading gets -1, -2, ..."""
    seen: dict[str, int] = {}
    out = set()
    for line in text.splitlines():
        m = re.match(r"#{1,6}\s+(.*)", line)
        if not m:
            continue
        slug = re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(f"{slug}-{n}" if n else slug)
    return out


def path_errors(text: str, page: Path, root: Path = ROOT) -> list[str]:
    """Each relative link, or repository path in backticks, that names nothing in the checkout;
    each link to a section that its page does not have."""
    errors = []
    for n, line in enumerate(text.splitlines(), 1):
        for link in LINK.findall(line):
            target, _, section = link.partition("#")
            if re.match(r"[a-z]+:", target):
                continue
            linked = page.parent / target if target else page
            if not linked.exists():
                errors.append(f"{page.name}:{n}: link '{target}' names nothing")
            elif section and linked.suffix == ".md" and section not in anchors(linked.read_text()):
                errors.append(f"{page.name}:{n}: link '{link}': no such section")
        for p in CODE_PATH.findall(line):
            if p.startswith(TOP) and not PLACEHOLDER.search(p) and not (root / p).exists():
                errors.append(f"{page.name}:{n}: path '{p}' names nothing")
    for n, line in code(text):
        for mod in MODULE.findall(line):
            if mod.isupper() or mod.split(".")[-1].isupper():  # a placeholder: benchmarks.NAME
                continue
            if not (root / (mod.replace(".", "/") + ".py")).exists():
                errors.append(f"{page.name}:{n}: module '{mod}' names nothing")
    made = {m for _, line in code(text) for m in COPIED.findall(line)}  # the page's `cp X Y`
    for n, line in code(text):
        for p in FILE_ARG.findall(line):
            if p in made:
                continue
            if not PLACEHOLDER.search(p) and p[:1].islower() and not (root / p).exists():
                errors.append(f"{page.name}:{n}: file '{p}' names nothing")
    return errors


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_commands_exist(page: Path) -> None:
    assert command_errors(page.read_text(), page.name) == []


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_paths_exist(page: Path) -> None:
    assert path_errors(page.read_text(), page) == []


def test_the_checks_catch_what_disappears(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    text = (
        "    eaglet generate DATASET --threads 2 --no-such-flag\n"
        "    .venv/bin/eaglet frobnicate x\n"
        "    eaglet plan --params examples/kimi-k2.5.params.yaml --json   # fine\n"
        "    snakemake --cores 2 --config params=params.nowhere.yaml\n"
        "    .venv/bin/python -m benchmarks.nowhere --runs 3\n"
        "See [it](docs/nowhere.md) and `src/eaglet/nowhere.py`; `src/eaglet/cli.py` is real.\n"
        "[ok](docs/pipeline.md#keys-rebuild-only-what-is-stale) [gone](docs/pipeline.md#nowhere)\n"
    )
    assert command_errors(text, "page.md") == [
        "page.md:1: 'eaglet generate --no-such-flag': no such flag",
        "page.md:2: 'eaglet frobnicate': no such subcommand",
    ]
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "pipeline.md").write_text((ROOT / "docs" / "pipeline.md").read_text())
    assert path_errors(text, page) == [
        "page.md:6: link 'docs/nowhere.md' names nothing",
        "page.md:6: path 'src/eaglet/nowhere.py' names nothing",
        "page.md:7: link 'docs/pipeline.md#nowhere': no such section",
        "page.md:5: module 'benchmarks.nowhere' names nothing",
        "page.md:4: file 'params.nowhere.yaml' names nothing",
    ]
