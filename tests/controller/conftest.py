"""Fixtures for the controller tests: real ``python -m iris.controller`` processes."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from controller_harness import (
    Controller,
    cluster,
    cpu_backend,
    federation,
    gpu_backend,
    shared_dir,
    start_controller,
    write_config,
)


@pytest.fixture(scope="session")
def open_shared_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The directory ``open_controller``'s jobs share with the tests (its sandbox_rw_paths)."""
    return shared_dir(tmp_path_factory.mktemp("open-shared"))


@pytest.fixture(scope="session")
def open_controller(tmp_path_factory: pytest.TempPathFactory, open_shared_dir: Path) -> Iterator[Controller]:
    """A controller without auth (cluster "peer": 16 h100 slots + a 2-slot CPU backend), its jobs
    sandboxed where the host allows it, sharing ``open_shared_dir``."""
    root = tmp_path_factory.mktemp("open")
    peer = cluster(
        "peer",
        backends=[gpu_backend(slots=16, cpu_slots=4), cpu_backend(cpu_slots=2)],
        rw_paths=[open_shared_dir],
    )
    cfg = write_config(root / "clusters.toml", federation(cluster("home"), peer))
    ctl = start_controller(cfg, "peer", root / "state", port=peer["port"], kill_grace=1.0)
    try:
        yield ctl
    finally:
        ctl.stop()


@pytest.fixture
def fresh_dir(tmp_path: Path) -> Path:
    return tmp_path
