"""A peer's bundle store keeps a bundle while a job references it or someone asked for it within
the retention period, then deletes it with its unpacked copy (docs/DESIGN.md, "Workspace bundles":
deletion). The store's own rules, without a controller; tests/controller/test_controller_workspaces.py
shows the same through a root controller's retention."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from iris.bundle import Bundle, pack
from iris.controller.bundles import BundleStore


@pytest.fixture
def workspace(tmp_path: Path) -> Bundle:
    src = tmp_path / "ws"
    (src / "pkg").mkdir(parents=True)
    (src / "data.txt").write_text("original")
    (src / "pkg" / "mod.py").write_text("VALUE = 1\n")
    bundle = pack(src)
    assert bundle is not None
    return bundle


def test_a_bundle_is_kept_while_referenced_or_recently_asked_for(tmp_path: Path, workspace: Bundle) -> None:
    store = BundleStore(tmp_path / "bundles", overlays=False)
    sha = workspace.ref.sha256
    store.put(sha, workspace.data)
    store.unpacked(sha)
    old = 1_000_000_000.0
    os.utime(store.path(sha), (old, old))
    assert store.sweep({sha}, older_than_s=60) == []  # a job references it
    assert store.info(sha) is not None  # asked for: in use again
    assert store.sweep(set(), older_than_s=60) == []
    os.utime(store.path(sha), (old, old))
    assert store.sweep(set(), older_than_s=60) == [sha]
    assert not store.has(sha) and not (tmp_path / "bundles" / "unpacked" / sha).exists()
    # A copy whose bundle a crash removed first goes at the next sweep.
    store.put(sha, workspace.data)
    store.unpacked(sha)
    store.path(sha).unlink()
    assert store.sweep(set(), older_than_s=60) == []
    assert not (tmp_path / "bundles" / "unpacked" / sha).exists()
