"""Rerunnable measurements (not tests): see benchmarks/README.md and docs/BENCHMARKS.md.

``python -m benchmarks.e2e`` and ``python -m benchmarks.scale`` measure a frozen copy of a git
revision (``--source``, default HEAD), not the live work tree: see ``benchmarks/source.py``. The
switch happens here, before any project module is imported.
"""

from benchmarks.source import maybe_snapshot

maybe_snapshot()
