"""The controller's bundle store: workspace bundles received from the home cluster, by sha256.

The home side uploads a job's bundle here before it launches the job (``PUT /v1/bundles/{sha256}``);
the launch names it, and the backend unpacks it where the job runs. Bundles arrive over the API
only: a controller never reads another cluster's store (docs/DESIGN.md, "Workspace bundles"). An
upload is admitted only when its bytes hash to the id it is stored under and it passes
``iris.bundle.inspect`` (relative regular files, within the limits), and it is written atomically,
so a bundle on disk is always whole and always the one its name says.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import time
from pathlib import Path

from pydantic import BaseModel

from iris.bundle import BundleError, BundleStats, check_sha256, digest, inspect, unpack


class BundleInfo(BaseModel):
    """A bundle this controller holds (never its bytes: the API does not serve them back)."""

    sha256: str
    size: int
    # Whether this request stored it (False: it was already here, nothing was written).
    created: bool = False


class BundleStore:
    """``state_dir/bundles/<sha256>.tar.gz``, plus unpacked copies for backends that want a
    directory (Ray's ``working_dir``) under ``unpacked/<sha256>/``."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.root.mkdir(parents=True, exist_ok=True)
        (self.root / "unpacked").mkdir(exist_ok=True)
        # Bundles carry users' code: nobody but the controller's own user reads them.
        os.chmod(self.root, 0o700)

    def path(self, sha256: str) -> Path:
        return self.root / f"{check_sha256(sha256)}.tar.gz"

    def has(self, sha256: str) -> bool:
        return self.path(sha256).is_file()

    def info(self, sha256: str) -> BundleInfo | None:
        """What is stored under ``sha256``, or None."""
        try:
            return BundleInfo(sha256=sha256, size=self.path(sha256).stat().st_size)
        except FileNotFoundError:
            return None

    def put(self, sha256: str, data: bytes) -> BundleInfo:
        """Store ``data`` under ``sha256`` once; BundleError if the bytes are not that bundle."""
        check_sha256(sha256)
        if digest(data) != sha256:
            raise BundleError(f"the uploaded bytes do not hash to {sha256}: refused")
        inspect(data)
        info = BundleInfo(sha256=sha256, size=len(data))
        target = self.path(sha256)
        if target.is_file():
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
        """A read-only unpacked copy, made once per bundle (atomically: a half-made copy is
        never used)."""
        final = self.root / "unpacked" / check_sha256(sha256)
        if final.is_dir():
            return final
        tmp = Path(tempfile.mkdtemp(dir=self.root / "unpacked", prefix=".tmp-"))
        try:
            self.unpack_into(sha256, tmp)
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

    def sweep_uploads(self, older_than_s: float = 3600.0) -> None:
        """Remove temporary files of uploads interrupted by a crash."""
        cutoff = time.time() - older_than_s
        for leftover in self.root.glob(".upload-*"):
            with contextlib.suppress(OSError):
                if leftover.stat().st_mtime < cutoff:
                    leftover.unlink()
