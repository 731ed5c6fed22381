"""A controller started by ``iris dev`` or the test stack (``devstack.controller``) holds only its own
cluster's secrets even when its parent holds others' (docs/DESIGN.md, "Where secrets live",
"Credentials"; issue 16, acceptance 3).

The parent here holds a peer's object-store credentials and points ``$IRIS_KEY_DIR`` at the home
cluster's key directory, as a careless launcher might; the real controller process must inherit
neither: its ``/proc/<pid>/environ`` has its own credentials and key directory, and that directory
holds its own private key only.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from iris import devstack
from iris.config import PROJECT_ROOT, load_config
from iris.controller.identity import KEY_DIR_ENV
from iris.keydirs import provision_key_dirs

PEER, OTHER = "cw-rno2a", "cw-us-east-02a"


def _environ(pid: int) -> dict[str, str]:
    items = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(i.decode().partition("=")[::2] for i in items if i)


def test_a_controller_inherits_no_other_clusters_secret(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = load_config(PROJECT_ROOT / "config" / "clusters.toml")
    for c in cfg.clusters:
        c.port = devstack.free_port()
    config_file = tmp_path / "clusters.json"
    config_file.write_text(cfg.model_dump_json())
    dirs = provision_key_dirs(cfg, tmp_path / "keys")
    # The launcher's own environment: a peer's credentials and the home cluster's key directory.
    for var, value in devstack.store_credentials(cfg, OTHER).items():
        monkeypatch.setenv(var, value)
    monkeypatch.setenv(KEY_DIR_ENV, str(dirs.of(cfg.home)))

    svc = devstack.controller(config_file, cfg, PEER, tmp_path, key_dir=dirs.of(PEER))
    svc.start()
    try:
        svc.wait_ready(60)
        assert svc.proc is not None
        env = _environ(svc.proc.pid)
    finally:
        svc.stop()

    for var, value in devstack.store_credentials(cfg, OTHER).items():
        assert var not in env and value not in env.values(), var
    assert all(env.get(var) == value for var, value in devstack.store_credentials(cfg, PEER).items())
    assert env[KEY_DIR_ENV] == str(dirs.of(PEER))
    private = sorted(p.name for p in dirs.of(PEER).iterdir() if p.suffix == ".key")
    assert private == [f"{PEER}.key"]
    for name in (cfg.home, OTHER):
        theirs = (dirs.of(name) / f"{name}.key").read_bytes()
        assert all(p.read_bytes() != theirs for p in dirs.of(PEER).iterdir() if p.is_file())
