"""A file removed between the workspace's listing and its packing (a live SQLite journal beside a
running `iris dev`: CI run K) is left out of the bundle, not an error."""

from __future__ import annotations

from pathlib import Path

import pytest

from iris import bundle


def test_a_file_that_vanishes_while_packing_is_left_out(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "train.py").write_text("print('hi')\n")
    journal = tmp_path / "data" / "temporal.db-journal"
    journal.parent.mkdir()
    journal.write_bytes(b"journal")
    real_scan = bundle._scan

    def scan_then_remove(root: Path):  # type: ignore[no-untyped-def]
        entries = list(real_scan(root))
        journal.unlink()
        yield from entries

    monkeypatch.setattr(bundle, "_scan", scan_then_remove)
    packed = bundle.pack(tmp_path)

    assert packed is not None
    assert bundle.contains(packed, "train.py")
    assert not bundle.contains(packed, "data/temporal.db-journal")
