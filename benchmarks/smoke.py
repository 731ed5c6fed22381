"""Each benchmark's smoke size: ``--smoke`` (standard library only).

A smoke run goes through the benchmark's whole path at a tiny size (a few jobs, seconds), so a
change that breaks a benchmark fails the test suite (tests/benchmarks/test_smoke.py runs each one
so, on the work tree). It shows that the benchmark runs and what its output looks like, never a
figure worth keeping. ``--smoke`` only changes defaults: an option given explicitly wins.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Mapping, Sequence


def _shown(value: object) -> str:
    if isinstance(value, list | tuple):
        return ",".join(str(v) for v in value)
    return str(value)


def parse_args(
    parser: argparse.ArgumentParser, smoke: Mapping[str, object], argv: Sequence[str] | None = None
) -> argparse.Namespace:
    """Add ``--smoke`` to ``parser`` and parse ``argv`` (default: the command line); with
    ``--smoke``, the options named in ``smoke`` (by their ``dest``) default to its values."""
    sizes = " ".join(f"--{dest.replace('_', '-')} {_shown(v)}" for dest, v in smoke.items())
    parser.add_argument(
        "--smoke",
        action="store_true",
        help=f"a tiny run that only shows the benchmark works: {sizes} (explicit options win)",
    )
    known, _ = parser.parse_known_args(argv)
    if known.smoke:
        parser.set_defaults(**smoke)
    return parser.parse_args(argv)


def exit_now(code: int) -> None:
    """Flush and leave with ``os._exit``: a process that loaded the Temporal SDK's runtime can
    crash while the interpreter finalizes (sdk-python #300; CI saw ``PyGILState_Release`` abort a
    benchmark after its output was complete), so a benchmark must not depend on a clean
    finalization for its exit code."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
