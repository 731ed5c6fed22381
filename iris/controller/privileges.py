"""Who a controller's jobs run as, and the file modes that keep them out of the controller's state
(docs/DESIGN.md, "Job → controller").

Without the job sandbox (iris/controller/sandbox.py: a host that cannot sandbox, or
``sandbox = "off"``), a controller running as root starts each job of its process backends as the
cluster's ``run_as`` user (default ``nobody``): its uid, its primary group and no supplementary
groups; in the sandbox, a uid of the cluster's pool replaces it. A controller
that is not root cannot switch users; its jobs run with its own privileges, and it says so once at
start-up. Either way the state directory, ``controller.db`` and the controller's private key are
readable by the controller's user only.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pwd
import stat
from dataclasses import dataclass
from pathlib import Path

from iris.config import ClusterConfig, ConfigError

log = logging.getLogger("iris.controller")

DEFAULT_RUN_AS = "nobody"
PRIVATE_DIR = 0o700
PRIVATE_FILE = 0o600
# A state dir whose jobs run as another uid: they reach their own working directory by its path
# (work/<random name>/, 0700 and theirs) but can list nothing and open nothing else in it.
SEARCH_ONLY_DIR = 0o711


@dataclass(frozen=True)
class RunAs:
    """The identity jobs start with. ``switch`` is False when they keep the controller's own."""

    user: str
    uid: int
    gid: int
    switch: bool


def resolve_run_as(cluster: ClusterConfig) -> RunAs:
    """The cluster's ``run_as`` on this host; ConfigError (one line) for an unknown user."""
    name = cluster.run_as
    try:
        entry = pwd.getpwuid(int(name)) if name.isdigit() else pwd.getpwnam(name)
    except (KeyError, OverflowError):
        raise ConfigError(
            f"cluster {cluster.name}: run_as names an unknown user {name!r} on this host"
        ) from None
    switch = os.geteuid() == 0 and entry.pw_uid != 0
    return RunAs(user=entry.pw_name, uid=entry.pw_uid, gid=entry.pw_gid, switch=switch)


def privilege_warning(run_as: RunAs) -> str | None:
    """The one start-up warning of a controller whose jobs keep its privileges, or None."""
    if run_as.switch:
        return None
    if os.geteuid() != 0:
        return (
            f"the controller is not root and cannot switch users: jobs run with the controller's own "
            f"privileges (uid {os.geteuid()}), run_as = {run_as.user!r} is not applied"
        )
    return f"run_as = {run_as.user!r} is root: jobs run with the controller's own privileges"


def harden_state_dir(state_dir: Path, run_as: RunAs, *, traverse: bool | None = None) -> None:
    """State dir and ``logs/`` 0700; ``work/`` too, or search-only (0711) with the state dir when
    jobs run as another uid and must reach their own directories by path (``traverse``, default
    ``run_as.switch``; a sandboxed job sees its directory by a bind and needs no path to it)."""
    open_dir = SEARCH_ONLY_DIR if (run_as.switch if traverse is None else traverse) else PRIVATE_DIR
    for path, mode in (
        (state_dir, open_dir),
        (state_dir / "logs", PRIVATE_DIR),
        (state_dir / "work", open_dir),
    ):
        path.mkdir(parents=True, exist_ok=True)
        os.chmod(path, mode)


def private_files(*paths: Path) -> None:
    """``chmod 0600`` each existing file (a store or key written by an older, laxer version)."""
    for path in paths:
        with contextlib.suppress(FileNotFoundError):
            os.chmod(path, PRIVATE_FILE)


def harden_key_file(private_key: Path) -> None:
    """The controller's private key 0600 in a 0700 directory, where the controller owns them (a
    key mounted read-only or owned by someone else is left as it is, with a warning if it is open)."""
    try:
        st = private_key.stat()
    except OSError:
        return
    for path, mode, current in (
        (private_key, PRIVATE_FILE, st),
        (private_key.parent, PRIVATE_DIR, private_key.parent.stat()),
    ):
        if stat.S_IMODE(current.st_mode) & 0o077 == 0:
            continue
        try:
            if current.st_uid != os.geteuid():
                raise PermissionError("not its owner")
            os.chmod(path, mode)
        except OSError as exc:
            log.warning("%s is readable by others and cannot be tightened: %s", path, exc)


def chown_tree(root: Path, run_as: RunAs) -> None:
    """Give a job's working directory (and what was unpacked into it) to the job's user. Links are
    never followed (bundles hold none; ``iris.bundle`` refuses them)."""
    os.lchown(root, run_as.uid, run_as.gid)
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            os.lchown(os.path.join(dirpath, name), run_as.uid, run_as.gid)
