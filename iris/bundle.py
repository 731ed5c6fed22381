"""Workspace bundles: the submitter's code travels with the job (docs/DESIGN.md, "Workspace bundles").

``pack`` turns a directory into a deterministic, content-addressed ``.tar.gz``: the same files give
the same bytes and so the same sha256, which is the bundle's id everywhere (the home store's key,
the controller's ``PUT /v1/bundles/{sha256}``, the job's ``BundleRef``). ``inspect`` and ``unpack``
are the receiving side: a bundle is hostile input until it has been checked, so they admit only
regular files and directories with relative names inside the limits below.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import os
import re
import stat
import tarfile
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

import pathspec
from pydantic import BaseModel, Field

from iris.objectstore import ObjectStore

MIB = 1 << 20
# The workspace's files, summed (what a user can act on: "largest entries").
MAX_WORKSPACE_BYTES = 25 * MIB
MAX_FILES = 10_000
# The archive itself: the files plus tar headers (512 bytes a file, at worst 5 MiB for 10k files)
# plus gzip framing. A receiver refuses a larger body before reading it.
MAX_ARCHIVE_BYTES = MAX_WORKSPACE_BYTES + MAX_FILES * 1024 + MIB
# The tar stream inside, uncompressed: the files, each padded to 512 bytes, a header each and a pax
# header for a long name. Nothing decompresses past it (a bundle is hostile until checked).


def max_tar_bytes() -> int:
    return MAX_WORKSPACE_BYTES + MAX_FILES * 3 * 1024 + MIB


# Directories never shipped, wherever they are: environments, VCS data, caches, iris dev state.
ALWAYS_SKIPPED = frozenset({".venv", ".git", "__pycache__", ".data"})
IGNORE_FILES = (".gitignore", ".irisignore")
# Fixed metadata, so the archive depends on names, contents and the executable bit only. The
# mtime is not 0: zip (Ray packs a working_dir as one) cannot store times before 1980.
_MTIME = 1_000_000_000
# Fastest zlib level: packing is on the submit path, and level 1 costs about 2% in size here
# (docs/BENCHMARKS.md, "Workspace bundles").
_COMPRESSLEVEL = 1
HOME_PREFIX = "iris-bundles"
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


class BundleError(ValueError):
    """The workspace cannot be bundled, or an archive is not an acceptable bundle; one line."""


class BundleRef(BaseModel):
    """What a job carries of its bundle: the id and a few sizes, never the bytes."""

    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    size: int = Field(ge=1, le=MAX_ARCHIVE_BYTES)  # the archive's bytes
    files: int = Field(ge=1, le=MAX_FILES)
    workspace_bytes: int = Field(ge=0, le=MAX_WORKSPACE_BYTES)

    @property
    def short(self) -> str:
        return f"sha256:{self.sha256[:12]}"

    def describe(self) -> str:
        files = f"{self.files} file" + ("" if self.files == 1 else "s")
        return f"{self.short} ({files}, {human_size(self.workspace_bytes)})"


@dataclass(frozen=True)
class Bundle:
    ref: BundleRef
    data: bytes


@dataclass(frozen=True)
class _Entry:
    name: str  # posix path relative to the workspace root
    path: Path
    size: int
    executable: bool


def human_size(n: int) -> str:
    if n < 1024:
        return f"{n} B"
    if n < MIB:
        return f"{n / 1024:.1f} KiB"
    return f"{n / MIB:.1f} MiB"


def digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def check_sha256(value: str) -> str:
    if not _SHA256.fullmatch(value):
        raise BundleError("a bundle id is 64 lowercase hex digits (its sha256)")
    return value


# ---- the sending side ----------------------------------------------------------------------------


class _Ignores:
    """.gitignore semantics, per directory: a file's rules apply below it, deeper and later rules
    win (``.irisignore`` after ``.gitignore`` in one directory, so it can re-include with ``!``)."""

    def __init__(self) -> None:
        self._specs: list[tuple[str, pathspec.GitIgnoreSpec]] = []

    def child(self, directory: Path, rel: str) -> _Ignores:
        out = _Ignores()
        out._specs = list(self._specs)
        for name in IGNORE_FILES:
            try:
                lines = (directory / name).read_text(errors="replace").splitlines()
            except OSError:
                continue
            out._specs.append((rel, pathspec.GitIgnoreSpec.from_lines(lines)))
        return out

    def ignored(self, rel: str, is_dir: bool) -> bool:
        verdict = False
        for base, spec in self._specs:
            sub = rel[len(base) + 1 :] if base else rel
            result = _dir_verdict(spec, sub) if is_dir else spec.check_file(sub).include
            if result is not None:
                verdict = result
        return verdict


def _dir_verdict(spec: pathspec.GitIgnoreSpec, sub: str) -> bool | None:
    """Whether ``spec`` ignores the directory ``sub`` (None: it does not say). pathspec matches
    files; for a directory, git lets the last matching pattern win, where a pattern ending in ``/``
    names directories (``!*/``) and any other names the path itself (``logs/**`` names what is in
    logs, not logs)."""
    verdict = None
    for pattern in spec.patterns:
        if pattern.include is None:
            continue
        text = str(pattern.pattern).rstrip()
        if pattern.match_file(sub + "/" if text.endswith("/") else sub) is not None:
            verdict = pattern.include
    return verdict


def _scan(root: Path) -> Iterator[_Entry]:
    """The workspace's shippable files, in a stable order."""
    real_root = root.resolve()

    def walk(directory: Path, rel: str, ignores: _Ignores) -> Iterator[_Entry]:
        ignores = ignores.child(directory, rel)
        try:
            children = sorted(os.scandir(directory), key=lambda e: e.name)
        except OSError as exc:
            raise BundleError(f"cannot read {directory}: {exc.strerror}") from None
        for child in children:
            name = f"{rel}/{child.name}" if rel else child.name
            try:
                is_dir = child.is_dir(follow_symlinks=False)
            except OSError:
                continue
            if is_dir:
                if child.name in ALWAYS_SKIPPED or ignores.ignored(name, True):
                    continue
                yield from walk(Path(child.path), name, ignores)
                continue
            if ignores.ignored(name, False):
                continue
            path = Path(child.path)
            if child.is_symlink():
                # A link is shipped as the file it names, if that file is inside the workspace;
                # a link out of it (or to a directory) is not the workspace's to ship.
                try:
                    target = path.resolve(strict=True)
                except (OSError, RuntimeError):
                    continue
                if not target.is_relative_to(real_root) or not target.is_file():
                    continue
                path = target
            try:
                st = path.stat()
            except OSError:
                continue
            if not stat.S_ISREG(st.st_mode):
                continue  # sockets, FIFOs, devices
            yield _Entry(name, path, st.st_size, bool(st.st_mode & 0o111))

    yield from walk(root, "", _Ignores())


def printable(name: str) -> str:
    """A name as one line: control characters escaped (a file may be called ``a\nb``)."""
    return _CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", name)


def _too_large(root: Path, entries: list[_Entry], total: int) -> BundleError:
    largest = sorted(entries, key=lambda e: (-e.size, e.name))[:5]
    names = ", ".join(f"{printable(e.name)} ({human_size(e.size)})" for e in largest)
    return BundleError(
        f"workspace {root} is {human_size(total)}, over the {human_size(MAX_WORKSPACE_BYTES)} limit; "
        f"largest: {names} (list what the job does not need in .irisignore, or use --workdir)"
    )


def pack(root: str | os.PathLike[str]) -> Bundle | None:
    """Bundle the directory ``root``; None when nothing in it is shipped (an empty workspace costs
    nothing). BundleError, with one line naming what to change, when it cannot be bundled."""
    base = Path(root)
    if not base.is_dir():
        raise BundleError(f"workspace {base} is not a directory")
    entries: list[_Entry] = []
    total = 0
    for entry in _scan(base):
        entries.append(entry)
        total += entry.size
        if len(entries) > MAX_FILES:
            raise BundleError(
                f"workspace {base} has more than {MAX_FILES} files to ship; list what the job does "
                "not need in .irisignore, or use --workdir"
            )
    if total > MAX_WORKSPACE_BYTES:
        raise _too_large(base, entries, total)
    if not entries:
        return None
    buf = io.BytesIO()
    with (
        gzip.GzipFile(fileobj=buf, mode="wb", mtime=0, compresslevel=_COMPRESSLEVEL) as gz,
        tarfile.open(fileobj=gz, mode="w", format=tarfile.PAX_FORMAT) as tar,
    ):
        shipped_bytes = 0
        for entry in entries:
            try:
                data = entry.path.read_bytes()
            except FileNotFoundError:
                # Gone since it was listed (a live file such as a SQLite journal beside a running
                # `iris dev`): not part of the snapshot, as if it had never been there.
                continue
            except OSError as exc:
                raise BundleError(f"cannot read {entry.path}: {exc.strerror}") from None
            shipped_bytes += len(data)
            if shipped_bytes > MAX_WORKSPACE_BYTES:  # a file grew while we packed
                raise _too_large(base, entries, shipped_bytes)
            info = tarfile.TarInfo(entry.name)
            info.size = len(data)
            info.mode = 0o755 if entry.executable else 0o644
            info.mtime = _MTIME
            info.uid = info.gid = 0
            info.uname = info.gname = ""
            tar.addfile(info, io.BytesIO(data))
        tar_bytes = gz.tell() + 2 * tarfile.BLOCKSIZE + tarfile.RECORDSIZE  # the end blocks to come
    if tar_bytes > max_tar_bytes():
        raise BundleError(f"workspace {base} has too many files with long names to ship; use --workdir")
    data = buf.getvalue()
    ref = BundleRef(sha256=digest(data), size=len(data), files=len(entries), workspace_bytes=shipped_bytes)
    return Bundle(ref=ref, data=data)


def contains(bundle: Bundle, name: str) -> bool:
    """Whether the bundle ships the file ``name`` (a path relative to the workspace)."""
    wanted = PurePosixPath(name).as_posix().removeprefix("./")
    with tarfile.open(fileobj=io.BytesIO(bundle.data), mode="r:gz") as tar:
        return any(m.name == wanted for m in tar.getmembers())


# ---- the home cluster's store --------------------------------------------------------------------


def home_key(sha256: str) -> str:
    return f"{HOME_PREFIX}/{check_sha256(sha256)}.tar.gz"


def store_at_home(store: ObjectStore, bundle: Bundle) -> bool:
    """Keep the bundle in the home store under its id, once; True if this call wrote it."""
    key = home_key(bundle.ref.sha256)
    if store.exists(key):
        return False
    return store.put(key, bundle.data, if_absent=True)


def fetch_from_home(store: ObjectStore, ref: BundleRef) -> bytes:
    """The bundle's bytes from the home store, checked against its id (BundleError if they differ:
    whoever can write the bucket must not be able to change what a job runs)."""
    data = store.get(home_key(ref.sha256))
    if digest(data) != ref.sha256:
        raise BundleError(f"bundle {ref.short} in the home store does not match its sha256")
    return data


# ---- the receiving side --------------------------------------------------------------------------


@dataclass(frozen=True)
class BundleStats:
    files: int
    workspace_bytes: int


def _safe_name(name: str) -> bool:
    p = PurePosixPath(name)
    return bool(name) and not p.is_absolute() and ".." not in p.parts and "\\" not in name


def _members(tar: tarfile.TarFile) -> Iterator[tarfile.TarInfo]:
    """Every member, checked before the next is read: names, kinds, limits, and a tree that can be
    made (no name twice, no file where a directory must go)."""
    files = total = 0
    kinds: dict[str, bool] = {}  # name -> is a directory
    for entries, member in enumerate(tar, start=1):
        name = member.name.rstrip("/")
        shown = printable(name[:80])
        if not _safe_name(name):
            raise BundleError(f"bundle entry {shown!r} is not a relative path inside it")
        if not (member.isreg() or member.isdir()):
            raise BundleError(f"bundle entry {shown!r} is not a regular file or directory")
        if member.isreg():
            files += 1
            total += member.size
        if entries > MAX_FILES:
            raise BundleError(f"bundle has more than {MAX_FILES} files and directories")
        if total > MAX_WORKSPACE_BYTES:
            raise BundleError(f"bundle unpacks to more than {human_size(MAX_WORKSPACE_BYTES)}")
        parts = PurePosixPath(name).parts
        for i in range(1, len(parts)):
            if kinds.setdefault("/".join(parts[:i]), True) is False:
                raise BundleError(f"bundle entry {shown!r} is inside a file")
        if name in kinds and (kinds[name] is False or member.isreg()):
            raise BundleError(f"bundle entry {shown!r} appears twice")
        kinds[name] = member.isdir()
        yield member


def _tar_stream(data: bytes) -> bytes:
    """The tar inside a gzip'd bundle, decompressed up to MAX_TAR_BYTES and no further; the gzip
    trailer is checked (a cut, damaged or extended archive is refused)."""
    if len(data) > MAX_ARCHIVE_BYTES:
        raise BundleError(f"bundle is larger than {human_size(MAX_ARCHIVE_BYTES)}")
    inflate = zlib.decompressobj(wbits=16 + zlib.MAX_WBITS)  # gzip framing, CRC and length checked
    limit = max_tar_bytes()
    try:
        raw = inflate.decompress(data, limit + 1)
    except zlib.error as exc:
        raise BundleError(f"not a gzip-compressed tar archive ({exc})") from None
    if len(raw) > limit:
        raise BundleError(f"bundle decompresses to more than {human_size(limit)}")
    if not inflate.eof:
        raise BundleError("bundle archive is truncated")
    if inflate.unused_data:
        raise BundleError("bundle archive has data after its end")
    return raw


def _open_archive(raw: bytes) -> tarfile.TarFile:
    try:
        return tarfile.open(fileobj=io.BytesIO(raw), mode="r:")
    except tarfile.TarError as exc:
        raise BundleError(f"not a tar archive ({type(exc).__name__})") from None


def inspect(data: bytes) -> BundleStats:
    """Check an archive received from elsewhere; BundleError if it is not an acceptable bundle."""
    return _check(_tar_stream(data))


def _check(raw: bytes) -> BundleStats:
    files = total = 0
    with _open_archive(raw) as tar:
        try:
            for member in _members(tar):
                if member.isreg():
                    if member.offset_data + member.size > len(raw):
                        raise BundleError(f"bundle entry {printable(member.name[:80])!r} is truncated")
                    files += 1
                    total += member.size
        except (tarfile.TarError, EOFError, OSError) as exc:
            raise BundleError(f"bundle archive is corrupt ({type(exc).__name__})") from None
    if files == 0:
        raise BundleError("bundle holds no files")
    return BundleStats(files=files, workspace_bytes=total)


def unpack(data: bytes, dest: Path) -> BundleStats:
    """Unpack a bundle into ``dest`` (created if missing), after the same checks as ``inspect``."""
    raw = _tar_stream(data)  # decompressed once: checked, then extracted from memory
    stats = _check(raw)
    dest.mkdir(parents=True, exist_ok=True)
    with _open_archive(raw) as tar:
        try:
            # The "data" filter refuses links, devices and names outside dest, and drops setuid
            # and group/other write bits, on top of our own checks.
            tar.extractall(dest, members=list(_members(tar)), filter="data")
        except (tarfile.TarError, EOFError, OSError) as exc:
            raise BundleError(printable(f"cannot unpack bundle: {exc}")) from None
    return stats
