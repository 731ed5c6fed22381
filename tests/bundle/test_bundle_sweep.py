"""A peer's bundle store keeps a bundle while a job references it or someone asked for it within
the retention period, then deletes it with its unpacked copy (docs/DESIGN.md, "Workspace bundles":
deletion). The store's own rules, without a controller; tests/controller/test_controller_workspaces.py
shows the same through a root controller's retention."""

from __future__ import annotations

import os
import threading
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


OLD = 1_000_000_000.0  # an mtime long before any retention period


def aged_store(tmp_path: Path, workspace: Bundle) -> tuple[BundleStore, str]:
    """A store holding ``workspace``, unpacked, last asked for long ago."""
    store = BundleStore(tmp_path / "bundles", overlays=False)
    sha = workspace.ref.sha256
    store.put(sha, workspace.data)
    store.unpacked(sha)
    os.utime(store.path(sha), (OLD, OLD))
    return store, sha


def test_a_bundle_is_kept_while_referenced_or_recently_asked_for(tmp_path: Path, workspace: Bundle) -> None:
    store, sha = aged_store(tmp_path, workspace)
    assert store.sweep({sha}, older_than_s=60) == []  # a job references it
    assert store.info(sha) is not None  # asked for: in use again
    assert store.sweep(set(), older_than_s=60) == []
    os.utime(store.path(sha), (OLD, OLD))
    assert store.sweep(set(), older_than_s=60) == [sha]
    assert not store.has(sha) and not (tmp_path / "bundles" / "unpacked" / sha).exists()
    # A copy whose bundle a crash removed first goes at the next sweep.
    store.put(sha, workspace.data)
    store.unpacked(sha)
    store.path(sha).unlink()
    assert store.sweep(set(), older_than_s=60) == []
    assert not (tmp_path / "bundles" / "unpacked" / sha).exists()


def test_a_launch_claims_the_bundle_before_a_sweep_can_take_it(tmp_path: Path, workspace: Bundle) -> None:
    """Since launch-before-staging-v1 no check precedes a launch: the launch's own claim marks the
    bundle in use, so a sweep whose list of referenced bundles predates the job keeps it; a sweep
    that took it first leaves the launch a 404 (claim False), and the home side stages it again."""
    store, sha = aged_store(tmp_path, workspace)
    assert store.claim(sha)
    assert store.sweep(set(), older_than_s=60) == []  # the snapshot has no job, the claim keeps it
    os.utime(store.path(sha), (OLD, OLD))
    assert store.sweep(set(), older_than_s=60) == [sha]
    assert not store.claim(sha)
    # What a crash left mid-removal (the copy renamed, not yet deleted) goes at the next sweep.
    store.put(sha, workspace.data)
    copy = store.unpacked(sha)
    left = copy.parent / f".gone-{sha}-0000"
    copy.rename(left)
    assert store.sweep({sha}, older_than_s=60) == []
    assert not left.exists() and store.has(sha)


def test_claims_and_sweeps_in_threads_never_leave_a_claimed_bundle_deleted(
    tmp_path: Path, workspace: Bundle
) -> None:
    """Many rounds of a claim racing a sweep: whenever the claim answers True, the bundle is still
    there after the sweep (the sweep looked after the claim, saw it in use, and kept it)."""
    store = BundleStore(tmp_path / "bundles", overlays=False)
    sha = workspace.ref.sha256
    for _ in range(200):
        store.put(sha, workspace.data)
        os.utime(store.path(sha), (OLD, OLD))
        claimed: list[bool] = []
        start = threading.Barrier(2)

        def claim(into: list[bool] = claimed, together: threading.Barrier = start) -> None:
            together.wait()
            into.append(store.claim(sha))

        thread = threading.Thread(target=claim)
        thread.start()
        start.wait()
        swept = store.sweep(set(), older_than_s=60)
        thread.join()
        assert claimed[0] is (swept == []), (claimed, swept)
        assert store.has(sha) is claimed[0]
