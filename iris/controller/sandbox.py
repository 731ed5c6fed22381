"""The job sandbox of the process backend (docs/SECURITY.md, "The job sandbox").

Each job of a process backend runs under Debian's ``bubblewrap`` (``bwrap``): in its own network
namespace (only a loopback that reaches nothing of the host), its own PID namespace (when the job's
command exits, every process of the job is killed with it), its own IPC namespace, and a filesystem
view built from an allow-list: read-only system paths, the Python interpreters the controller can
run, its own working directory (read-write), a private ``/tmp`` and ``/dev/shm``, a ``/proc`` of its
own namespace, a minimal ``/dev`` (plus the GPU device nodes when present). Nothing else of the host
is visible: not the controller's state, keys or data, nor another job's files. A root controller
runs each job as a uid of the cluster's pool (``sandbox_uids``), one per running job, leased
host-wide so that no two running jobs (of any controller on the host) share one.

bubblewrap rather than util-linux ``unshare``: ``bwrap`` builds the view from binds (nothing is
visible unless bound, where ``unshare`` starts from the whole host and must hide what it knows
of), and sets up the namespaces, the private mounts and ``--die-with-parent`` in one exec. The uid
switch is util-linux ``setpriv`` inside the sandbox: ``bwrap --uid`` needs a user namespace, in
which a root controller's job would still be root outside.

The argv builder (``bwrap_argv``) is pure; what it is given comes from the host (``SandboxView``,
``interpreter_paths``), and ``Sandbox`` ties both to one cluster's config.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import pwd
import random
import re
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import NamedTuple

from iris.config import ClusterConfig, ConfigError
from iris.controller.identity import default_key_dir

log = logging.getLogger("iris.controller.sandbox")

# Read-only at the same path in every sandbox, where they exist on the host. Top-level links
# (/bin -> usr/bin on a merged-/usr system) are recreated as links.
SYSTEM_PATHS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc", "/sys")
# Private, empty, world-writable with the sticky bit, in every sandbox.
PRIVATE_TMP = ("/tmp", "/var/tmp", "/dev/shm")
# Where the uid leases live: host-wide, so controllers sharing a host never hand out one uid twice.
LEASE_DIR = Path("/run/iris-sandbox-uids")
# What `iris peers` and the start-up line call a working sandbox.
BWRAP = "bwrap"


def _under(path: str, roots: Iterable[str]) -> bool:
    return any(path == r or path.startswith(r.rstrip("/") + "/") for r in roots)


@dataclass(frozen=True)
class SandboxView:
    """What a job sees of the host besides its own working directory."""

    # Read-only binds, (host path, path in the sandbox), parents before children.
    ro_binds: tuple[tuple[str, str], ...] = ()
    # Top-level links, (target, link), e.g. ("usr/bin", "/bin").
    links: tuple[tuple[str, str], ...] = ()
    # Device nodes bound as they are (GPUs).
    devices: tuple[str, ...] = ()
    # Paths covered by an empty tmpfs after the binds (the controller's state dir, where a bound
    # system path holds it).
    masked: tuple[str, ...] = ()
    host_network: bool = False
    # Operator-shared writable directories (``sandbox_rw_paths``), (host path, path in the
    # sandbox): bound read-write into every job's sandbox, after its private /tmp.
    rw_binds: tuple[tuple[str, str], ...] = ()

    def visible(self, path: str) -> bool:
        """Whether ``path`` (absolute, normalized) lies in this view's binds or links."""
        shown = [dest for _, dest in (*self.ro_binds, *self.rw_binds)] + [link for _, link in self.links]
        return _under(path, shown) and not _under(path, self.masked)


# Runs as the job's uid, inside the sandbox, in the controller's own interpreter (isolated, no
# site): reads the job's environment (JSON) from stdin, puts /dev/null there instead, and execs the
# command with that environment. bwrap and setpriv never see the job's environment: a variable such
# as LD_PRELOAD would otherwise run the job's code in them, before the sandbox, with the
# controller's privileges.
LAUNCHER = """\
import json, os, sys
env = json.loads(sys.stdin.buffer.read())
null = os.open("/dev/null", os.O_RDONLY)
os.dup2(null, 0)
os.close(null)
try:
    os.execvpe(sys.argv[1], sys.argv[1:], env)
except OSError as exc:
    sys.stderr.write(f"cannot start {sys.argv[1]!r}: {exc.strerror}\\n")
    sys.stderr.flush()
    os._exit(127 if isinstance(exc, FileNotFoundError) else 126)
"""
# The environment bwrap, setpriv and the launcher start with.
LAUNCH_ENV = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"}


class WorkdirOverlay(NamedTuple):
    """A job's working directory as an overlay mounted for its sandbox alone: ``lower`` (the
    bundle's one shared copy) read-only under the job's writes, kept in ``upper`` (``work`` is
    overlayfs's scratch on the same filesystem). It is mounted in a mount namespace of the job's
    own, which bwrap's sandbox is then made from, and never in the controller's: every new sandbox
    copies the controller's mount table, so a mount per running job there would make each start
    cost more with every job running (docs/DESIGN.md, "Workspace bundles")."""

    lower: Path
    upper: Path
    work: Path

    def options(self) -> str:
        """overlayfs's mount options (no setuid file or device node works in it)."""
        lower, upper, work = (overlay_path(p) for p in (self.lower, self.upper, self.work))
        return f"nosuid,nodev,lowerdir={lower},upperdir={upper},workdir={work}"


def overlay_path(path: Path) -> str:
    """``path`` as an overlayfs option names it; OSError if it cannot be named so."""
    text = str(path)
    if any(c in text for c in ",:\\\n"):
        raise OSError(f"no overlay can name {text!r}: it holds a comma, colon, backslash or newline")
    return text


# Mounts the overlay ($1: options, $2: the working directory) in the mount namespace `unshare`
# made for the job, then becomes bwrap ("$@"), whose sandbox is made from that namespace.
MOUNT_THEN_EXEC = '{mount} -n -t overlay overlay -o "$1" "$2" && shift 2 && exec "$@"'
SYSTEM_PATH = "/usr/bin:/bin:/usr/sbin:/sbin"


@cache
def system_tool(name: str) -> str | None:
    """``name`` (util-linux's ``unshare`` and ``mount``, ``sh``) from the system's directories."""
    found = shutil.which(name, path=SYSTEM_PATH)
    return os.path.realpath(found) if found else None


def overlay_prefix(overlay: WorkdirOverlay, workdir: Path) -> list[str]:
    """What runs before bwrap for ``overlay``: a mount namespace of the job's own, private (nothing
    propagates back), with the overlay mounted on ``workdir`` in it; then bwrap, same process."""
    unshare, mount, sh = system_tool("unshare"), system_tool("mount"), system_tool("sh")
    if unshare is None or mount is None or sh is None:
        raise OSError("unshare, mount (util-linux) and sh are needed to mount a job's overlay")
    script = MOUNT_THEN_EXEC.format(mount=mount)
    return [
        unshare,
        "--mount",
        "--propagation",
        "private",
        "--",
        sh,
        "-c",
        script,
        "sh",
        overlay.options(),
        str(workdir),
    ]


def launcher_argv(python: str) -> list[str]:
    return [python, "-I", "-S", "-c", LAUNCHER]


def bwrap_argv(
    bwrap: str,
    view: SandboxView,
    *,
    workdir: Path,
    command: Sequence[str],
    uid: int | None,
    setpriv: str | None,
    python: str,
    overlay: WorkdirOverlay | None = None,
) -> list[str]:
    """The argv that runs ``command`` in ``workdir`` inside ``view``; as ``uid`` (through
    ``setpriv``, an absolute path inside the view) when given, else as the caller's uid. Its
    stdin must carry the job's environment as JSON (``LAUNCHER``, run by ``python``); its own
    environment should be ``LAUNCH_ENV``. ``workdir`` is the host's directory bound in, or, with
    ``overlay``, an overlay bwrap mounts there inside the sandbox.

    ``command[0]`` is looked up by the job's own PATH, as the job's uid, inside the sandbox; the
    tools the sandbox itself runs are absolute paths, so nothing a job put on its PATH or in its
    environment runs with the controller's privileges.
    """
    argv = [bwrap, "--die-with-parent", "--unshare-pid", "--unshare-ipc"]
    if not view.host_network:
        argv.append("--unshare-net")
    # Each directory the sandbox has so far, and whether it is a read-only bind of the host's.
    made: dict[str, bool] = {"/": False}

    def parents(dest: str) -> None:
        # Mount points' parents made 0755 on the sandbox's own tmpfs: bwrap would make them 0700,
        # and a job of another uid could not pass /root on the way to an interpreter bound under
        # it. Inside a read-only bind they exist already (as the host has them).
        parts = Path(dest).parts
        for i in range(2, len(parts)):
            parent = str(Path(*parts[:i]))
            if parent in made:
                continue
            container = max((m for m in made if _under(parent, [m])), key=len)
            if made[container]:
                continue
            argv.extend(["--perms", "0755", "--dir", parent])
            made[parent] = False

    for target, link in view.links:
        argv += ["--symlink", target, link]
    # A read-only bind inside a shared writable directory or a private tmp dir (an interpreter in a
    # checkout under /tmp) goes on top of it, after it.
    shared = [dest for _, dest in view.rw_binds]
    late = [(src, dest) for src, dest in view.ro_binds if _under(dest, [*shared, *PRIVATE_TMP])]
    for src, dest in view.ro_binds:
        if (src, dest) in late:
            continue
        parents(dest)
        argv += ["--ro-bind", src, dest]
        made[dest] = True
    argv += ["--dev", "/dev"]
    for dev in view.devices:
        argv += ["--dev-bind", dev, dev]
    argv += ["--proc", "/proc"]
    made.update({"/dev": False, "/proc": True})
    for tmp in PRIVATE_TMP:
        parents(tmp)
        argv += ["--perms", "1777", "--tmpfs", tmp]
        made[tmp] = False
    for path in view.masked:
        argv += ["--tmpfs", path]
        made[path] = False
    # After the private tmp dirs, so that a shared directory under /tmp is the host's.
    for src, dest in view.rw_binds:
        parents(dest)
        argv += ["--bind", src, dest]
        made[dest] = True
    for src, dest in late:
        parents(dest)
        argv += ["--ro-bind", src, dest]
        made[dest] = True
    parents(str(workdir))
    argv += ["--bind", str(workdir), str(workdir), "--chdir", str(workdir), "--"]
    if uid is not None:
        if setpriv is None:
            raise ValueError("switching to a pool uid needs setpriv")
        # The uid's own group and no other; no capability survives (none may be regained: bwrap
        # sets no_new_privs, so setuid files in the view grant nothing).
        argv += [
            setpriv,
            f"--reuid={uid}",
            f"--regid={uid}",
            "--clear-groups",
            "--inh-caps=-all",
            "--bounding-set=-all",
            "--",
        ]
    prefix = overlay_prefix(overlay, workdir) if overlay is not None else []
    return prefix + argv + launcher_argv(python) + list(command)


# ---- the host's side of the view ---------------------------------------------------------------


def _prefix_of(executable: Path) -> Path:
    """The installation an interpreter belongs to: ``PREFIX`` of ``PREFIX/bin/python3.11``."""
    real = executable.resolve()
    return real.parent.parent if real.parent.name == "bin" else real.parent


def _venv_home(venv: Path) -> Path | None:
    """The base interpreter's installation of a virtual environment (``home`` in pyvenv.cfg)."""
    try:
        lines = (venv / "pyvenv.cfg").read_text().splitlines()
    except (OSError, UnicodeDecodeError):
        return None
    for line in lines:
        key, sep, value = line.partition("=")
        if sep and key.strip() == "home" and value.strip():
            home = Path(value.strip())
            return home.resolve().parent if home.name == "bin" else home.resolve()
    return None


PYTHON_NAME = re.compile(r"python(\d+(\.\d+)?)?")


def _is_binary(path: Path) -> bool:
    """An executable file (a link followed) that is a program, not a script: a shim script (pyenv's)
    is not an interpreter, and what it runs is not in the view."""
    try:
        with open(path, "rb") as f:
            return os.access(path, os.X_OK) and f.read(4) == b"\x7fELF"
    except OSError:
        return False


def interpreter_paths(path_env: str) -> list[Path]:
    """The Python installations a job may run: the controller's own (its virtual environment and
    that one's base), and each virtual environment and ``python*`` on ``path_env`` with the
    installation it links into. Each as found and as resolved (a link's target must be visible
    at its own path for the link to work inside)."""
    found: list[Path] = []

    def add(path: Path | None) -> None:
        if path is None or not path.is_absolute() or not path.is_dir():
            return
        for p in (Path(os.path.normpath(path)), path.resolve()):
            if p not in found:
                found.append(p)

    for prefix in (sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix):
        add(Path(prefix))
    add(_prefix_of(Path(sys.executable)))
    for entry in path_env.split(os.pathsep):
        if not entry or not os.path.isabs(entry):
            continue
        bindir = Path(entry)
        if bindir.name == "bin" and (bindir.parent / "pyvenv.cfg").is_file():
            add(bindir.parent)
            add(_venv_home(bindir.parent))
        with contextlib.suppress(OSError):
            for exe in sorted(bindir.glob("python*")):
                if PYTHON_NAME.fullmatch(exe.name) and _is_binary(exe):
                    add(_prefix_of(exe))
    return found


def gpu_devices(dev: Path = Path("/dev")) -> list[str]:
    """The NVIDIA device nodes of this host (``/dev/nvidia*``, ``/dev/nvidia-caps``)."""
    try:
        return sorted(str(p) for p in dev.iterdir() if p.name.startswith("nvidia"))
    except OSError:
        return []


def shared_rw_binds(paths: Sequence[str], *, protected: Sequence[tuple[str, Path]]) -> list[tuple[str, str]]:
    """The binds of a cluster's ``sandbox_rw_paths``, (host path, path in the sandbox); ConfigError
    (one line) for one that is no existing directory, that would make a system path, ``/dev`` or
    ``/proc`` writable or share the private ``/tmp``, ``/var/tmp`` or ``/dev/shm``, or that overlaps
    a ``protected`` directory (what, path: the controller's state and key directories)."""
    binds: list[tuple[str, str]] = []
    fixed = (*SYSTEM_PATHS, "/dev", "/proc")
    for path in paths:
        dest, real = os.path.normpath(path), os.path.realpath(path)
        where = f"sandbox_rw_paths: {path}"
        if not os.path.isdir(real):
            raise ConfigError(f"{where} is not an existing directory")
        for p in (dest, real):
            for f in fixed:
                if _under(p, [f]):
                    raise ConfigError(f"{where} lies in {f}, which jobs see read-only or not at all")
                if _under(f, [p]):
                    raise ConfigError(f"{where} would make {f} writable by every job")
            for f in PRIVATE_TMP:
                if _under(f, [p]):
                    raise ConfigError(f"{where} would share {f}, private to each job, between jobs")
        for what, prot in protected:
            prot_real = os.path.realpath(prot)
            if _under(real, [prot_real]) or _under(prot_real, [real]):
                raise ConfigError(f"{where} overlaps the controller's {what} {prot}")
        if (real, dest) not in binds:
            binds.append((real, dest))
    return binds


def host_view(
    *,
    hidden: Sequence[Path],
    extra_ro: Sequence[str],
    path_env: str,
    host_network: bool,
    rw_binds: Sequence[tuple[str, str]] = (),
) -> tuple[SandboxView, list[str]]:
    """This host's view for jobs, and the paths left out of it (each with why).

    System paths are bound read-only where they exist; a hidden path (the state dir) inside one
    is covered by an empty tmpfs. The interpreters and ``extra_ro`` are bound unless they lie in a
    system path already, or contain a hidden path (then they are left out, and said so).
    ``rw_binds`` (from ``shared_rw_binds``, checked already) are bound read-write.
    """
    links: list[tuple[str, str]] = []
    binds: list[tuple[str, str]] = []
    skipped: list[str] = []
    for top in SYSTEM_PATHS:
        if os.path.islink(top):
            links.append((os.readlink(top), top))
        elif os.path.isdir(top):
            binds.append((top, top))
    system = [dest for _, dest in binds] + [link for _, link in links]
    hidden_real = [os.path.realpath(h) for h in hidden]
    masked = [h for h in hidden_real if _under(h, system)]
    candidates = [*interpreter_paths(path_env), *(Path(p) for p in extra_ro)]
    if host_network:
        resolv = Path("/etc/resolv.conf")
        if resolv.is_symlink():
            candidates.append(resolv.resolve().parent)
    extra: list[str] = []
    for cand in candidates:
        dest = os.path.normpath(cand)
        if not os.path.exists(dest) or _under(dest, system) or dest in extra:
            continue
        if any(_under(h, [dest, os.path.realpath(dest)]) for h in hidden_real):
            skipped.append(f"{dest} (holds the controller's state)")
            continue
        extra.append(dest)
    # Parents before children, so a bind inside another one lands on top of it.
    for dest in sorted(extra, key=lambda p: (p.count("/"), p)):
        if not _under(dest, [d for _, d in binds if d not in system]):
            binds.append((os.path.realpath(dest), dest))
    view = SandboxView(
        ro_binds=tuple(binds),
        links=tuple(links),
        devices=tuple(gpu_devices()),
        masked=tuple(masked),
        host_network=host_network,
        rw_binds=tuple(rw_binds),
    )
    return view, skipped


def find_command(
    view: SandboxView,
    command0: str,
    *,
    path_env: str,
    workdir: Path,
    uid: int | None,
    workdir_files: Path | None = None,
) -> str | None:
    """Why ``command0`` cannot start in the sandbox (as ``execvp`` would look it up there), or
    None. Checked on the host before the sandbox is built: the job gets the same one-line error a
    job outside the sandbox gets ("cannot start ..."). ``workdir_files``: where the working
    directory's files are on the host when bwrap builds it (a ``WorkdirOverlay``'s lower layer)."""
    top = str(workdir)

    def seen(path: str) -> bool:
        return _under(path, [top]) or view.visible(path)

    def on_host(path: str) -> str:
        if workdir_files is None or not _under(path, [top]):
            return path
        return os.path.join(workdir_files, os.path.relpath(path, top))

    if "/" in command0:
        candidates = [os.path.normpath(os.path.join(workdir, command0))]
    else:
        candidates = [
            os.path.normpath(os.path.join(workdir, d or ".", command0)) for d in path_env.split(os.pathsep)
        ]
    denied = False
    for cand in candidates:
        real = os.path.realpath(on_host(cand))
        inside = workdir_files is not None and _under(real, [str(workdir_files)])
        if not (seen(cand) and (inside or seen(real))):
            continue
        try:
            st = os.stat(real)
        except OSError:
            continue
        if not stat.S_ISREG(st.st_mode):
            denied = True
            continue
        who = uid if uid is not None else os.geteuid()
        if who == 0:
            bits = stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH
        elif st.st_uid == who:
            bits = stat.S_IXUSR
        elif st.st_gid == who:  # a pool uid's only group is the gid of the same number
            bits = stat.S_IXGRP
        else:
            bits = stat.S_IXOTH
        if st.st_mode & bits:
            return None
        denied = True
    return "Permission denied" if denied else "No such file or directory in the job's sandbox"


# ---- uids --------------------------------------------------------------------------------------


def _process_uids() -> Iterator[tuple[int, set[int]]]:
    """Each process of the host, by pid, with its real, effective, saved and fs uids: one look
    through ``/proc`` (a process gone meanwhile is left out)."""
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/status") as f:
                ids = next((line.split()[1:] for line in f if line.startswith("Uid:")), [])
        except OSError:
            continue
        yield int(name), {int(i) for i in ids}


def uid_busy(uid: int) -> bool:
    """Whether any process of the host has ``uid`` as its real, effective, saved or fs uid."""
    return any(uid in ids for _, ids in _process_uids())


def uids_running(uids: range) -> set[int]:
    """The uids of ``uids`` that some process of the host runs as, from one look through ``/proc``."""
    return {u for _, ids in _process_uids() for u in ids if u in uids}


def kill_uid(uid: int) -> int:
    """SIGKILL every process running as ``uid``; how many (a lost run's leftovers)."""
    killed = 0
    for pid, ids in _process_uids():
        if uid in ids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
                killed += 1
    return killed


@dataclass
class UidLease:
    """One uid held for one run: an exclusive ``flock`` on ``LEASE_DIR/<uid>``, held until
    ``release`` (or until the controller's process ends, when the kernel drops it). The file says
    ``held`` while a run holds the uid and ``clean`` once a run released it with none of its
    processes left: a uid released clean needs no look through ``/proc`` before its next run (one
    look costs ~0.4 s with 4,000 processes on the host), nor does one never leased since the host
    started beyond one look a minute (``UidPool.busy``). A controller that dies holding it leaves
    ``held``, so the next lease looks."""

    uid: int
    fd: int
    # The last holder released it clean (no process of its run left).
    clean: bool = False
    # No controller has leased it since the host started (the lease directory is on /run).
    fresh: bool = False

    def release(self, *, clean: bool = False) -> None:
        """Give the uid back; ``clean``: no process runs as it any more (its run's sandboxes, and
        with them their PID namespaces, are gone)."""
        if self.fd >= 0:
            if clean:
                with contextlib.suppress(OSError):
                    os.ftruncate(self.fd, 0)
                    os.pwrite(self.fd, _CLEAN, 0)
            os.close(self.fd)
            self.fd = -1


# How old a look through /proc for processes of other origin may be when a never-leased uid is
# leased (iris itself runs nothing as a uid it has not leased).
FOREIGN_LOOK_S = 60.0
_CLEAN = b"clean"
_HELD = b"held"


class UidPool:
    """The cluster's ``sandbox_uids``, leased one per running job, host-wide."""

    def __init__(self, uids: range, lease_dir: Path = LEASE_DIR) -> None:
        self.uids = uids
        self.lease_dir = lease_dir
        # When /proc was last looked through, and the uids of ``uids`` processes then ran as.
        self._foreign: tuple[float, set[int]] | None = None

    def _try(self, uid: int) -> UidLease | None:
        self.lease_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd = os.open(self.lease_dir / str(uid), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return None
        try:
            said = os.pread(fd, 16, 0)
            os.ftruncate(fd, 0)
            os.pwrite(fd, _HELD, 0)
        except OSError:
            os.close(fd)
            raise
        return UidLease(uid, fd, clean=said == _CLEAN, fresh=said == b"")

    def busy(self, lease: UidLease) -> bool:
        """Whether a process runs as the leased uid. Released clean: no. Never leased since the
        host started: only if a process not of iris ran as it at the last look through ``/proc``
        (``FOREIGN_LOOK_S``; iris runs nothing as a uid it has not leased). Left ``held`` by a
        controller that died: looked for now, a lost run's leftover."""
        if lease.clean:
            return False
        if lease.fresh:
            return lease.uid in self._foreign_uids()
        return uid_busy(lease.uid)

    def _foreign_uids(self) -> set[int]:
        now = time.monotonic()
        if self._foreign is None or now - self._foreign[0] > FOREIGN_LOOK_S:
            self._foreign = (now, uids_running(self.uids))
        return self._foreign[1]

    def take(self) -> UidLease | None:
        """A uid no running job holds (its flock only; ``lease`` also checks that no process runs
        as it), or None when every uid of the pool is held. Cheap enough for the scheduler: a
        start waits for a uid instead of failing."""
        return self._first(checked=False)

    def lease(self, *, skip: int | None = None) -> UidLease | None:
        """A uid no running job holds and no process runs as (``busy``), other than ``skip``, or
        None when the pool is spent."""
        return self._first(checked=True, skip=skip)

    def _first(self, *, checked: bool, skip: int | None = None) -> UidLease | None:
        """The first uid of ``_candidates`` whose flock is free (and, ``checked``, that is not
        ``busy``). Candidates are tried in random order: controllers sharing a pool rarely
        contend."""
        for uid in self._candidates():
            held = self._try(uid) if uid != skip else None
            if held is None:
                continue
            if checked and self.busy(held):  # a lost run's leftover, or the operator's
                held.release()
                continue
            return held
        return None

    def _candidates(self) -> Iterator[int]:
        """The pool's uids in random order: a few random picks first (a large pool that is mostly
        free is not shuffled whole for every start), then all of them."""
        for _ in range(min(len(self.uids), 16)):
            yield self.uids[random.randrange(len(self.uids))]
        candidates = list(self.uids)
        random.shuffle(candidates)
        yield from candidates

    def reclaim(self, uid: int) -> int:
        """After a restart: SIGKILL what still runs as a lost run's ``uid``, unless another
        controller has leased it since (then it is that one's job). How many were killed."""
        if uid not in self.uids:
            return 0
        held = self._try(uid)
        if held is None:
            return 0
        try:
            return kill_uid(uid)
        finally:
            held.release()


# ---- signals -----------------------------------------------------------------------------------


def _children(pid: int) -> list[int]:
    out: list[int] = []
    with contextlib.suppress(OSError):
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children") as f:
                out.extend(int(c) for c in f.read().split())
    return out


def signal_sandbox(bwrap_pid: int, sig: signal.Signals) -> None:
    """Signal every process of the job ``bwrap_pid`` runs: SIGKILL ends its PID namespace (its
    init dies, the kernel kills the rest); any other signal goes to each process of the namespace
    but its init (whose death would end them all at once, with no grace), ``setsid`` children
    included. Before the sandbox's init exists, the bwrap process's group is signalled: also
    while ``bwrap_pid`` is still the shell that mounts a job's overlay (``overlay_prefix``), whose
    child (``mount``) is in the controller's own PID namespace, not a sandbox's."""
    inits = _children(bwrap_pid)
    ns: str | None = None
    if inits:
        try:
            ns = os.readlink(f"/proc/{inits[0]}/ns/pid")
        except OSError:
            ns = None
    if ns is None or ns == os.readlink("/proc/self/ns/pid"):
        # No sandbox yet: never the namespace walk below, which would reach every process here.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(bwrap_pid, sig)
        return
    init = inits[0]
    if sig == signal.SIGKILL:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(init, signal.SIGKILL)
        return
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == init:
            continue
        try:
            if os.readlink(f"/proc/{name}/ns/pid") != ns:
                continue
            os.kill(int(name), sig)
        except (OSError, ProcessLookupError):
            continue


# ---- the cluster's sandbox ---------------------------------------------------------------------


@cache
def probe(
    bwrap: str, view: SandboxView, uid: int | None, setpriv: str | None, python: str, *, overlay: bool = False
) -> str | None:
    """Run ``true`` in such a sandbox, once per process; None if it worked, else why not (one
    line: bwrap's own message, e.g. that it may not create namespaces here). ``overlay``: in a
    working directory that is an overlay of the job's own (``WorkdirOverlay``)."""
    with tempfile.TemporaryDirectory(prefix="iris-sandbox-probe-") as tmp:
        workdir = Path(tmp) / "workdir"
        workdir.mkdir()
        layers = None
        if overlay:
            layers = WorkdirOverlay(Path(tmp) / "lower", Path(tmp) / "upper", Path(tmp) / "work")
            for path in layers:
                path.mkdir()
            os.chmod(layers.lower, 0o755)
        writable = layers.upper if layers is not None else workdir
        if uid is not None:
            os.chown(writable, uid, uid)
            os.chmod(tmp, 0o755)  # the uid passes through to its working directory
        try:
            argv = bwrap_argv(
                bwrap,
                view,
                workdir=workdir,
                command=["true"],
                uid=uid,
                setpriv=setpriv,
                python=python,
                overlay=layers,
            )
        except OSError as exc:
            return str(exc)
        try:
            res = subprocess.run(
                argv, input=json.dumps(LAUNCH_ENV), env=LAUNCH_ENV, capture_output=True, text=True, timeout=30
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            return f"bwrap cannot run: {exc}"
    if res.returncode == 0:
        return None
    lines = (res.stderr or res.stdout).strip().splitlines()
    return lines[-1] if lines else f"bwrap exited with {res.returncode}"


def overlapping_accounts(uids: range) -> list[str]:
    """Accounts of this host whose uid lies in ``uids``."""
    return sorted(f"{e.pw_name} ({e.pw_uid})" for e in pwd.getpwall() if e.pw_uid in uids)


@dataclass
class Sandbox:
    """The sandbox of one cluster's process backends on this host, decided once at start."""

    cluster: ClusterConfig
    state_dir: Path
    # The bwrap executable; None when jobs run unsandboxed (``reason`` says why).
    bwrap: str | None = None
    setpriv: str | None = None
    # The interpreter that runs the launcher: the controller's own, resolved.
    python: str = field(default_factory=lambda: os.path.realpath(sys.executable))
    view: SandboxView = field(default_factory=SandboxView)
    pool: UidPool | None = None
    reason: str = ""
    skipped: list[str] = field(default_factory=list)
    # Whether a job's workspace overlay is mounted in a mount namespace of the job's own (util-linux
    # unshare and mount; probed at start). Else the controller mounts it in its own namespace.
    overlays: bool = False

    @property
    def enabled(self) -> bool:
        return self.bwrap is not None

    @property
    def status(self) -> str:
        """What the capacity report and ``iris peers`` show: ``bwrap``, or ``none: <reason>``."""
        if not self.enabled:
            return f"none: {self.reason}"[:400]
        if self.pool is None:
            return f"{BWRAP} (no uid pool: the controller is not root)"
        return BWRAP

    def startup_line(self) -> str | None:
        """The one start-up line of a controller whose jobs lose some isolation, or None."""
        if not self.enabled:
            return (
                f"cluster {self.cluster.name}: no job sandbox ({self.reason}): jobs share the host's "
                "network (Temporal, the emulators, the controllers and metrics on loopback are "
                "reachable), its PID space (a job's setsid children can outlive it) and /tmp, and run "
                "as one shared user (run_as); see docs/SECURITY.md, 'The job sandbox'"
            )
        lost = []
        if self.pool is None:
            lost.append(f"the controller is not root: every job runs as its uid {os.geteuid()} (no uid pool)")
        if self.view.host_network:
            lost.append("sandbox_host_network = true: jobs reach the host's network and loopback services")
        if self.skipped:
            lost.append("not bound: " + ", ".join(self.skipped))
        if self.view.rw_binds:
            shared = ", ".join(dest for _, dest in self.view.rw_binds)
            lost.append(f"every job reads and writes the shared sandbox_rw_paths {shared}")
        if not lost:
            return None
        return f"cluster {self.cluster.name}: job sandbox (bwrap) with less isolation: " + "; ".join(lost)

    def path_env(self) -> str:
        return os.environ.get("PATH") or "/usr/local/bin:/usr/bin:/bin"

    def argv(
        self, command: Sequence[str], *, workdir: Path, uid: int | None, overlay: WorkdirOverlay | None = None
    ) -> list[str]:
        assert self.bwrap is not None
        return bwrap_argv(
            self.bwrap,
            self.view,
            workdir=workdir,
            command=command,
            uid=uid,
            setpriv=self.setpriv,
            python=self.python,
            overlay=overlay,
        )

    @classmethod
    def for_cluster(cls, cluster: ClusterConfig, state_dir: Path, key_dir: Path | None = None) -> Sandbox:
        """Decide, once, how this host sandboxes the cluster's jobs: ConfigError when the cluster
        requires a sandbox the host cannot give, its uid pool holds an existing account, or a
        ``sandbox_rw_paths`` entry is refused (``shared_rw_binds``: checked whether or not the
        host sandboxes). ``key_dir``: the controller's key directory (default as the controller's:
        ``$IRIS_KEY_DIR``, else the state directory's parent)."""
        sandbox = cls(cluster, Path(state_dir))
        protected = [
            ("state directory", Path(state_dir)),
            ("key directory", key_dir or default_key_dir(Path(state_dir).resolve().parent)),
            ("uid lease directory", LEASE_DIR),
        ]
        auth = cluster.auth
        for key_file in (auth.private_key_file, auth.public_key_file) if auth is not None else ():
            if key_file and os.path.isabs(os.path.expanduser(key_file)):
                protected.append(("key directory", Path(os.path.expanduser(key_file)).parent))
        rw_binds = shared_rw_binds(cluster.sandbox_rw_paths, protected=protected)
        if cluster.sandbox == "off":
            sandbox.reason = "sandbox = off in the cluster's config"
            return sandbox
        root = os.geteuid() == 0
        bwrap = shutil.which("bwrap")
        setpriv = shutil.which("setpriv", path="/usr/bin:/bin:/usr/sbin:/sbin")
        if bwrap is None:
            sandbox.reason = "bwrap not found on PATH (Debian: apt-get install bubblewrap)"
        elif root and setpriv is None:
            sandbox.reason = "setpriv (util-linux) not found: a root controller cannot switch a job's uid"
        else:
            view, skipped = host_view(
                hidden=[sandbox.state_dir],
                extra_ro=cluster.sandbox_ro_paths,
                path_env=sandbox.path_env(),
                host_network=cluster.sandbox_host_network,
                rw_binds=rw_binds,
            )
            real_setpriv = os.path.realpath(setpriv) if setpriv else None
            if root and real_setpriv is not None and not view.visible(real_setpriv):
                sandbox.reason = f"{real_setpriv} is not in a system path the sandbox binds"
            elif not view.visible(sandbox.python):
                sandbox.reason = f"the controller's interpreter {sandbox.python} is not in the sandbox's view"
            else:
                uids = cluster.sandbox_uid_range
                failure = probe(bwrap, view, uids[0] if root else None, real_setpriv, sandbox.python)
                if failure is not None:
                    sandbox.reason = f"bwrap cannot build a sandbox here: {failure}"
                else:
                    sandbox.bwrap, sandbox.setpriv, sandbox.view = bwrap, real_setpriv, view
                    sandbox.skipped = skipped
                    uid = uids[0] if root else None
                    sandbox.overlays = (
                        root and probe(bwrap, view, uid, real_setpriv, sandbox.python, overlay=True) is None
                    )
                    if root:
                        taken = overlapping_accounts(uids)
                        if taken:
                            raise ConfigError(
                                f"cluster {cluster.name}: sandbox_uids {cluster.sandbox_uids} holds "
                                f"existing accounts: {', '.join(taken[:5])}"
                            )
                        sandbox.pool = UidPool(uids)
        if cluster.sandbox == "required" and not sandbox.enabled:
            raise ConfigError(f"cluster {cluster.name}: sandbox = required, but {sandbox.reason}")
        return sandbox
