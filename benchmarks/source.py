"""Which code a benchmark measures: a frozen copy of a git revision (standard library only).

Other people edit the work tree while a benchmark runs, and the worker's workflow sandbox
re-imports workflow modules from disk for every new workflow: a half-written file would be measured,
or break the run. So ``python -m benchmarks.e2e`` / ``benchmarks.scale`` re-execute themselves on
``git archive <rev>`` of the project (default ``HEAD``; ``--source REV`` for another revision, e.g.
to compare before and after a change) plus this ``benchmarks/`` package, in a temp directory that
is first on ``PYTHONPATH`` for the driver and every process it starts (worker, controllers).
``--source worktree`` measures the work tree as it is; ``--source DIR`` measures a copy of another
checkout or a scratch prototype (its ``iris/``, ``workflows/``... directories).

This runs from ``benchmarks/__init__.py`` before any project module is imported, so a broken
work tree cannot stop a benchmark of ``HEAD``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

PROJECT_ROOT = Path(__file__).resolve().parent.parent
SOURCE_ENV = "IRIS_BENCH_SOURCE"
SOURCE_DIR_ENV = "IRIS_BENCH_SOURCE_DIR"
SNAPSHOTTED = ("benchmarks.e2e", "benchmarks.scale")
_PROJECT_PATHS = ("iris", "workflows", "activities", "worker", "cli", "config", "pyproject.toml")


def _git(*args: str) -> bytes:
    return subprocess.run(
        ["git", *args], cwd=PROJECT_ROOT, capture_output=True, check=True, timeout=60
    ).stdout


def add_source_argument(parser: argparse.ArgumentParser) -> None:
    """The ``--source`` option every benchmark that runs on a frozen copy takes."""
    parser.add_argument(
        "--source",
        default="HEAD",
        help="git revision whose code is measured (a frozen copy), or 'worktree' (default: HEAD)",
    )


def requested_revision(argv: Sequence[str]) -> str:
    """The value of ``--source`` in ``argv`` (default ``HEAD``)."""
    for i, arg in enumerate(argv):
        if arg == "--source" and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith("--source="):
            return arg.split("=", 1)[1]
    return "HEAD"


def run_from_snapshot(module: str, argv: Sequence[str]) -> None:
    """Re-execute ``python -m module argv...`` on a snapshot; returns only when there is nothing to do."""
    rev = requested_revision(argv)
    if os.environ.get(SOURCE_ENV) or rev == "worktree":
        return
    dest = Path(tempfile.mkdtemp(prefix="iris-bench-src-"))
    if Path(rev).is_dir():
        src = Path(rev).resolve()
        for name in _PROJECT_PATHS:
            if (src / name).is_dir():
                shutil.copytree(src / name, dest / name, ignore=shutil.ignore_patterns("__pycache__"))
            elif (src / name).exists():
                shutil.copy2(src / name, dest / name)
        commit = f"dir:{src}"
    else:
        try:
            commit = _git("rev-parse", "--verify", f"{rev}^{{commit}}").decode().strip()
            archive = _git("archive", "--format=tar", commit, *_PROJECT_PATHS)
        except (OSError, subprocess.SubprocessError) as exc:
            shutil.rmtree(dest, ignore_errors=True)
            sys.exit(f"benchmark: cannot export git revision {rev!r}: {exc}")
        subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True, timeout=60)
    shutil.copytree(
        Path(__file__).resolve().parent, dest / "benchmarks", ignore=shutil.ignore_patterns("__pycache__")
    )
    env = {**os.environ, SOURCE_ENV: commit, SOURCE_DIR_ENV: str(dest), "PYTHONPATH": str(dest)}
    print(
        f"measuring {rev} = {commit if commit.startswith('dir:') else commit[:12]} (a copy in {dest})",
        flush=True,
    )
    os.chdir(dest)
    os.execve(sys.executable, [sys.executable, "-m", module, *argv], env)


def maybe_snapshot() -> None:
    """Called on package import: snapshot when started as ``python -m benchmarks.e2e|scale``."""
    argv = list(getattr(sys, "orig_argv", []))
    if "-m" not in argv:
        return
    i = argv.index("-m")
    if i + 1 < len(argv) and argv[i + 1] in SNAPSHOTTED:
        run_from_snapshot(argv[i + 1], argv[i + 2 :])


def source_label() -> str:
    commit = os.environ.get(SOURCE_ENV, "")
    if commit.startswith("dir:"):
        return f"a copy of {commit[4:]}"
    if commit:
        return f"git {commit[:12]} (frozen copy)"
    try:
        head = _git("rev-parse", "--short=12", "HEAD").decode().strip()
    except (OSError, subprocess.SubprocessError):
        head = "?"
    return f"work tree at HEAD {head}, uncommitted changes included"


def cleanup_snapshot() -> None:
    d = os.environ.get(SOURCE_DIR_ENV)
    if d and Path(d).name.startswith("iris-bench-src-"):
        shutil.rmtree(d, ignore_errors=True)
