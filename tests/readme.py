"""The README's blocks as tests (issue 27): every fenced block in README.md is named and owned by one
test, and that test checks the real output against the block.

A block is announced by an HTML comment on the line before its fence (invisible on the rendered
page)::

    <!-- block: seed-examples · test: tests/e2e/test_readme.py::test_the_seeds_examples -->

``tests/test_readme_blocks.py`` checks that every block has one, that names are unique and that each
owning test exists and names its block. A console block is a sequence of ``$ command`` lines (a
trailing ``\\`` continues one), each followed by its output; ``check_output`` compares one command's
real stdout and stderr with that output after ``normalise``: clock times, job-id suffixes, hashes,
epoch milliseconds, ages and dates are placeholders, whitespace runs are one space, and a line that
is only ``…`` stands for any number of lines. Status lines go to stderr and the job's output to
stdout, so the block's lines must be one interleaving of the two streams, each in its own order.
"""

from __future__ import annotations

import functools
import re
import shlex
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

PROJECT_ROOT = Path(__file__).resolve().parents[1]
README = PROJECT_ROOT / "README.md"
# The checkout the README's examples were recorded in: its paths stand for the test's directories.
RECORDED_ROOT = "/work/main"

MARKER_RE = re.compile(r"^<!-- block: (?P<name>[\w.-]+) · test: (?P<test>\S+::\w+) -->$")
FENCE_RE = re.compile(r"^```(?P<lang>\w*)\s*$")
ELLIPSIS = "…"


@dataclass
class Block:
    name: str | None
    test: str | None
    lang: str
    text: str
    line: int  # of the opening fence, 1-based


@dataclass
class Command:
    command: str
    output: list[str] = field(default_factory=list)


def blocks(text: str | None = None) -> list[Block]:
    """Every fenced block of the README, with the marker on the line before it (if any)."""
    lines = (README.read_text() if text is None else text).splitlines()
    found: list[Block] = []
    i = 0
    while i < len(lines):
        fence = FENCE_RE.match(lines[i])
        if fence is None:
            i += 1
            continue
        end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
        marker = MARKER_RE.match(lines[i - 1]) if i > 0 else None
        found.append(
            Block(
                name=marker["name"] if marker else None,
                test=marker["test"] if marker else None,
                lang=fence["lang"],
                text="\n".join(lines[i + 1 : end]),
                line=i + 1,
            )
        )
        i = end + 1
    return found


def block(name: str) -> Block:
    """The README block named ``name``."""
    matches = [b for b in blocks() if b.name == name]
    assert len(matches) == 1, f"README.md has {len(matches)} blocks named {name!r}"
    return matches[0]


def commands(console: str) -> list[Command]:
    """A console block's commands, each with the output the README prints for it."""
    out: list[Command] = []
    lines = console.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("$ "):
            cmd = line[2:]
            while i + 1 < len(lines):
                if cmd.endswith("\\"):  # a continuation line
                    i += 1
                    cmd = cmd[:-1].rstrip() + " " + lines[i].strip()
                elif not _complete(cmd):  # a quoted argument spanning lines (the seed's SDK snippet)
                    i += 1
                    cmd += "\n" + lines[i]
                else:
                    break
            out.append(Command(cmd))
        elif out:
            out[-1].output.append(line)
        else:
            raise AssertionError(f"output before any command: {line!r}")
        i += 1
    for c in out:
        while c.output and not c.output[-1].strip():
            c.output.pop()
    return out


def _complete(command: str) -> bool:
    try:
        shlex.split(command)
    except ValueError:  # "No closing quotation"
        return False
    return True


_PLACEHOLDERS = [
    (re.compile(r"\b\d{4}-\d\d-\d\d\b"), "<date>"),
    (re.compile(r"\b\d\d:\d\d:\d\d\b"), "<time>"),
    (re.compile(r"sha256:[0-9a-f]{12,64}\b"), "sha256:<hash>"),
    (re.compile(r"\b\d{13}\b"), "<epoch-ms>"),
    (re.compile(r"\b\d+(\.\d+)?s ago\b"), "<age> ago"),
    (re.compile(r"(?<=\s)\d+[smhd](?=\s)"), "<age>"),
    # A generated job name's random suffix (the command's stem, or the SDK's, plus six hex digits).
    (re.compile(r"(?P<stem>\b[a-z][\w.@-]*/[\w.-]+?)-[0-9a-f]{6}\b"), r"\g<stem>-<suffix>"),
]


def normalise(line: str, paths: dict[str, str] | None = None) -> str:
    for real, placeholder in sorted((paths or {}).items(), key=lambda kv: -len(kv[0])):
        line = line.replace(real, placeholder)
    for pattern, placeholder in _PLACEHOLDERS:
        line = pattern.sub(placeholder, line)
    return " ".join(line.split())


def interleaves(expected: Sequence[str], out: Sequence[str], err: Sequence[str]) -> bool:
    """Whether ``expected`` is one interleaving of ``out`` and ``err`` (each kept in order), a line
    that is only ``…`` matching any number of lines of either."""

    @functools.cache
    def match(i: int, j: int, k: int) -> bool:
        if i == len(expected):
            return j == len(out) and k == len(err)
        want = expected[i]
        if want == ELLIPSIS:
            return (
                match(i + 1, j, k)
                or (j < len(out) and match(i, j + 1, k))
                or (k < len(err) and match(i, j, k + 1))
            )
        return (j < len(out) and out[j] == want and match(i + 1, j + 1, k)) or (
            k < len(err) and err[k] == want and match(i + 1, j, k + 1)
        )

    return match(0, 0, 0)


def check_output(command: Command, stdout: str, stderr: str, *, paths: dict[str, str] | None = None) -> None:
    """Fail, showing both, unless the real output is what the README prints for ``command``."""
    expected = [normalise(line, paths) for line in command.output]
    out = [normalise(line, paths) for line in stdout.splitlines() if line.strip()]
    err = [normalise(line, paths) for line in stderr.splitlines() if line.strip()]
    expected = [line for line in expected if line]
    if interleaves(expected, out, err):
        return
    raise AssertionError(
        f"the README's output of `{command.command}` is not what it prints now\n"
        + "--- README (normalised)\n"
        + "\n".join(expected)
        + "\n--- stdout (normalised)\n"
        + "\n".join(out)
        + "\n--- stderr (normalised)\n"
        + "\n".join(err)
    )
