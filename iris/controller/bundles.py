"""The controller's bundle store: workspace bundles received from the home cluster, by sha256.

The home side uploads a job's bundle here before it launches the job (``PUT /v1/bundles/{sha256}``);
the launch names it, and the backend unpacks it where the job runs. Bundles arrive over the API
only: a controller never reads another cluster's store (docs/DESIGN.md, "Workspace bundles"). An
upload is admitted only when its bytes hash to the id it is stored under and it passes
``iris.bundle.inspect`` (relative regular files, within the limits), and it is written atomically,
so a bundle on disk is always whole and always the one its name says.

A bundle is unpacked once, not once per job (docs/DESIGN.md, "Workspace bundles"). Where the
controller has a mount namespace of its own (``private_mounts``: a root controller), a job's working
directory is an overlay of that one copy with a layer of the job's own on top: the job reads the
shared files and writes, creates and deletes in its layer only. Elsewhere each job gets a private
copy. ``sweep`` deletes a bundle, and its copy, once no job references it.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import logging
import os
import shutil
import tempfile
import threading
import time
import uuid
from collections.abc import Iterable
from pathlib import Path

from pydantic import BaseModel

from iris.bundle import BundleError, BundleStats, check_sha256, digest, inspect, unpack
from iris.controller.sandbox import WorkdirOverlay, overlay_path

log = logging.getLogger("iris.controller.bundles")

# mount(2), umount2(2) and unshare(2) flags (linux/mount.h, linux/sched.h).
_MS_NOSUID, _MS_NODEV, _MS_REC, _MS_SLAVE = 0x2, 0x4, 0x4000, 0x80000
_MNT_DETACH = 0x2
_CLONE_NEWNS = 0x20000
# Whether this process has a mount namespace of its own whose mounts reach no other (set once, by
# ``private_mounts``).
_private_mounts = False


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def private_mounts() -> bool:
    """Give this process a mount namespace of its own, before it starts any thread (the
    controller's first step). Mounts made in it (the jobs' overlays) never propagate to the host's
    and vanish with the last process in it: a controller killed with SIGKILL leaves none behind.
    Mounts of the host made later still propagate in (slave). Root only; False where refused."""
    global _private_mounts
    if _private_mounts:
        return True
    if os.geteuid() != 0:
        return False
    libc = _libc()
    if libc.unshare(_CLONE_NEWNS) != 0:
        return False
    # Until this succeeds, mounts would still propagate to the host: no overlay is made then.
    if libc.mount(b"none", b"/", None, _MS_REC | _MS_SLAVE, None) != 0:
        return False
    _private_mounts = True
    return True


def mount_overlay(lower: Path, layer: Path, target: Path) -> None:
    """Mount ``lower`` (read-only to the overlay) on ``target``, its writes kept in ``layer/upper``
    (``layer/work`` is the kernel's scratch). No setuid file or device node works in it."""
    upper, work = layer / "upper", layer / "work"
    opts = f"lowerdir={overlay_path(lower)},upperdir={overlay_path(upper)},workdir={overlay_path(work)}"
    if _libc().mount(b"overlay", os.fsencode(target), b"overlay", _MS_NOSUID | _MS_NODEV, opts.encode()) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"cannot mount the workspace overlay on {target}: {os.strerror(err)}")


def unmount(target: Path) -> bool:
    """Detach the mount on ``target``; False if nothing was mounted there."""
    if _libc().umount2(os.fsencode(target), _MNT_DETACH) != 0:
        err = ctypes.get_errno()
        if err in (errno.EINVAL, errno.ENOENT):  # not a mount point, or gone
            return False
        raise OSError(err, f"cannot unmount {target}: {os.strerror(err)}")
    return True


def mounts_under(root: Path) -> list[Path]:
    """The mount points at or under ``root`` in this process's namespace (``/proc/self/mountinfo``)."""
    prefix = os.path.realpath(root)
    found = []
    with contextlib.suppress(OSError), open("/proc/self/mountinfo", encoding="utf-8") as f:
        for line in f:
            fields = line.split(" ")
            if len(fields) > 4:
                # Octal escapes (\040 for a space) as the kernel writes them.
                point = fields[4].encode().decode("unicode_escape")
                if point == prefix or point.startswith(prefix + os.sep):
                    found.append(Path(point))
    return found


def _open_to_jobs(root: Path) -> None:
    """Make the shared copy readable and writable through an overlay by any job's uid: the kernel
    checks a job's access to a file it has not yet copied into its layer against the shared copy's
    own modes. The copy itself stays out of reach (``bundles/`` is the controller's, mode 0700), and
    an overlay never writes to it."""
    for dirpath, _dirnames, filenames in os.walk(root):
        os.chmod(dirpath, 0o777)
        for name in filenames:
            path = os.path.join(dirpath, name)
            mode = os.lstat(path).st_mode & 0o777
            os.chmod(path, mode | 0o666 | (0o111 if mode & 0o100 else 0))


def layer_of(workdir: Path) -> Path:
    """Where a run's overlay keeps its writes: beside its working directory, named after it (so
    retention, which finds a run's directories by name, removes both)."""
    return workdir.with_name(workdir.name + ".layer")


class BundleInfo(BaseModel):
    """A bundle this controller holds (never its bytes: the API does not serve them back)."""

    sha256: str
    size: int
    # Whether this request stored it (False: it was already here, nothing was written).
    created: bool = False


# An unpacked copy being removed by the sweep (renamed first, deleted after).
GONE_PREFIX = ".gone-"


class BundleStore:
    """``state_dir/bundles/<sha256>.tar.gz``, plus unpacked copies for backends that want a
    directory (Ray's ``working_dir``) under ``unpacked/<sha256>/``."""

    def __init__(self, root: Path, *, overlays: bool | None = None) -> None:
        self.root = root
        self.root.mkdir(parents=True, exist_ok=True)
        (self.root / "unpacked").mkdir(exist_ok=True)
        # Bundles carry users' code: nobody but the controller's own user reads them.
        os.chmod(self.root, 0o700)
        # Held by ``claim`` and by ``sweep`` around each deletion: a launch either finds the bundle
        # and marks it in use before the sweep looks at it, or finds it gone (and is answered 404).
        self._claims = threading.Lock()
        # Jobs' working directories are overlays of one copy (None: wherever mounts are private
        # to this controller and the kernel mounts one).
        self.overlays = self._probe() if overlays is None else overlays

    def _probe(self) -> bool:
        if not _private_mounts:
            return False
        probe = Path(tempfile.mkdtemp(dir=self.root, prefix=".probe-"))
        try:
            for name in ("lower", "layer/upper", "layer/work", "mnt"):
                (probe / name).mkdir(parents=True)
            mount_overlay(probe / "lower", probe / "layer", probe / "mnt")
            unmount(probe / "mnt")
            return True
        except OSError as exc:
            log.warning("workspaces are copied per job: %s", exc)
            return False
        finally:
            shutil.rmtree(probe, ignore_errors=True)

    def path(self, sha256: str) -> Path:
        return self.root / f"{check_sha256(sha256)}.tar.gz"

    def has(self, sha256: str) -> bool:
        return self.path(sha256).is_file()

    def claim(self, sha256: str) -> bool:
        """For a launch that names the bundle: whether it is stored, marking it in use now (as
        ``info`` does), so that a sweep running at the same time keeps it for the job about to
        reference it. A launch is not preceded by a check since ``launch-before-staging-v1``."""
        with self._claims:
            return self.info(sha256) is not None

    def info(self, sha256: str) -> BundleInfo | None:
        """What is stored under ``sha256``, or None. Asking marks it in use now: ``sweep`` keeps a
        bundle asked for within its grace, so the launch that follows a check still finds it."""
        path = self.path(sha256)
        try:
            size = path.stat().st_size
            os.utime(path)
        except FileNotFoundError:
            return None
        return BundleInfo(sha256=sha256, size=size)

    def put(self, sha256: str, data: bytes) -> BundleInfo:
        """Store ``data`` under ``sha256`` once; BundleError if the bytes are not that bundle."""
        check_sha256(sha256)
        if digest(data) != sha256:
            raise BundleError(f"the uploaded bytes do not hash to {sha256}: refused")
        inspect(data)
        info = BundleInfo(sha256=sha256, size=len(data))
        target = self.path(sha256)
        if target.is_file():
            with contextlib.suppress(FileNotFoundError):
                os.utime(target)
            return info
        fd, tmp = tempfile.mkstemp(dir=self.root, prefix=".upload-")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            # Content-addressed: if another upload of the same id won the race, it wrote the same bytes.
            os.replace(tmp, target)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        return info.model_copy(update={"created": True})

    def read(self, sha256: str) -> bytes:
        data = self.path(sha256).read_bytes()
        if digest(data) != sha256:  # the disk is not trusted more than the wire
            raise BundleError(f"bundle {sha256[:12]} on disk is damaged")
        return data

    def unpack_into(self, sha256: str, dest: Path) -> BundleStats:
        """Unpack the stored bundle into ``dest`` (a job's working directory)."""
        return unpack(self.read(sha256), dest)

    def unpacked(self, sha256: str) -> Path:
        """The bundle's one unpacked copy, made once (atomically: a half-made copy is never used).
        Nothing writes to it: Ray copies it, an overlay keeps a job's writes in the job's layer."""
        final = self.root / "unpacked" / check_sha256(sha256)
        if final.is_dir():
            return final
        tmp = Path(tempfile.mkdtemp(dir=self.root / "unpacked", prefix=".tmp-"))
        try:
            self.unpack_into(sha256, tmp)
            _open_to_jobs(tmp)
            try:
                tmp.rename(final)
            except OSError:
                if not final.is_dir():
                    raise
                shutil.rmtree(tmp, ignore_errors=True)  # made by a concurrent caller: same content
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return final

    def workspace(self, sha256: str, workdir: Path, *, mount: bool = True) -> Path:
        """Give ``workdir`` (an empty directory) the bundle's files; the directory that takes the
        job's writes, whose owner and mode are the working directory's. With overlays, that is the
        layer ``<workdir>.layer/upper`` (``release`` unmounts it); else ``workdir``, a copy.
        ``mount`` False: the layer is made but not mounted, for the job's sandbox to mount
        (``overlay_of``)."""
        if not self.overlays:
            self.unpack_into(sha256, workdir)
            return workdir
        lower = self.unpacked(sha256)
        layer = layer_of(workdir)
        layer.mkdir(mode=0o700)
        upper = layer / "upper"
        upper.mkdir(mode=0o700)
        (layer / "work").mkdir(mode=0o700)
        if mount:
            mount_overlay(lower, layer, workdir)
        return upper

    def overlay_of(self, sha256: str, workdir: Path) -> WorkdirOverlay:
        """The layers ``workspace(..., mount=False)`` made for ``workdir``."""
        layer = layer_of(workdir)
        return WorkdirOverlay(self.unpacked(sha256), layer / "upper", layer / "work")

    def release(self, workdir: Path) -> None:
        """The run is over: its working directory is unmounted (if it was an overlay); its layer
        stays for retention, like a copy would."""
        if self.overlays:
            unmount(workdir)

    def sweep(self, referenced: Iterable[str], older_than_s: float) -> list[str]:
        """Delete every bundle no job references and none asked for (``info``, ``put``) in the last
        ``older_than_s``, with its unpacked copy; the ids deleted. A copy still mounted under by a
        job (referenced, then) is never touched."""
        keep = set(referenced)
        cutoff = time.time() - older_than_s
        gone = []
        for path in self.root.glob("*.tar.gz"):
            sha = path.name.removesuffix(".tar.gz")
            if sha in keep:
                continue
            unpacked = self.root / "unpacked" / sha
            trash = self.root / "unpacked" / f"{GONE_PREFIX}{sha}-{uuid.uuid4().hex[:8]}"
            try:
                with self._claims:  # no launch claims it between the look and the removal
                    if path.stat().st_mtime >= cutoff:
                        continue
                    with contextlib.suppress(FileNotFoundError):
                        unpacked.rename(trash)
                    path.unlink()
            except FileNotFoundError:
                continue
            shutil.rmtree(trash, ignore_errors=True)
            gone.append(sha)
        # A copy whose bundle is gone (a crash between the two removals) goes too, and what a
        # crash left of a removal.
        for copy in (self.root / "unpacked").iterdir():
            if copy.name.startswith(GONE_PREFIX):
                shutil.rmtree(copy, ignore_errors=True)
                continue
            if copy.name.startswith(".") or copy.name in keep:
                continue
            if not (self.root / f"{copy.name}.tar.gz").exists():
                shutil.rmtree(copy, ignore_errors=True)
        return gone

    def sweep_uploads(self, older_than_s: float = 3600.0) -> None:
        """Remove temporary files of uploads interrupted by a crash."""
        cutoff = time.time() - older_than_s
        for leftover in self.root.glob(".upload-*"):
            with contextlib.suppress(OSError):
                if leftover.stat().st_mtime < cutoff:
                    leftover.unlink()
