"""Workspace bundles: what shipping the submitter's workspace costs a job, by workspace size.

    uv run python -m benchmarks.bundles [--runs 7] [--sizes 1,10,25]

Builds synthetic workspaces (default 1, 10 and 25 MiB of shipped files, the largest just under
``iris.bundle.MAX_WORKSPACE_BYTES``): about half Python-like source text over ~50 files in a few
directories, half random bytes (a "checkpoint"), plus files that must not ship (a ``.venv/``, a
gitignored ``*.ckpt``, ``outputs/``). Every run rewrites one small source file with fresh random
content, so every run is a new bundle (a new sha256) that has to travel. Then, on its own real
stack (``benchmarks/harness.py``: in-memory Temporal dev server, moto, fake-gcs-server, three
controller processes, ``iris worker`` as its own process):

1. components, in this process, ``--runs`` times per size: ``pack``; ``store_at_home`` into the
   home cluster's store (the GCS emulator); the home fetch the worker's ``stage_bundle`` does
   (``fetch_from_home``: download + sha256); stage = ``PUT /v1/bundles/{sha256}`` to the peer
   ``cw-us-east-02a`` (signed; the controller hashes, inspects and fsyncs it); hash + inspect
   (the controller's check, timed here); unpack = ``iris.bundle.unpack`` of the same bytes into a
   temp dir (the code the controller runs before the job starts, timed on this machine);
2. end to end, ``--runs`` rounds, each submitting (in a rotating order) a job pinned to
   ``cw-us-east-02a`` (``h100 x 1``) through the SDK with an EMPTY workspace (no bundle: the
   baseline), with each size's workspace, and with an unchanged 10 MiB workspace (already at home
   and on the peer): submit→RUNNING is the controller's ``started_ms`` minus the wall clock just
   before ``submit`` was called; submit→process is the time the job's own command printed first.

Waits by polling ``describe``; everything is bounded by ``--timeout``. Runs on a frozen copy of
``--source`` (default HEAD), like ``e2e``/``scale`` (``benchmarks/source.py``). Not a test. See
docs/BENCHMARKS.md, "Workspace bundles (issue 13)".
"""

# The snapshot switch below runs before any project module is imported; the other imports follow it.

from __future__ import annotations

import sys

from benchmarks.source import run_from_snapshot

if __name__ == "__main__":
    run_from_snapshot("benchmarks.bundles", sys.argv[1:])

import argparse
import asyncio
import os
import random
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.harness import (
    BenchError,
    BenchStack,
    Deadline,
    LoadSampler,
    fmt,
    machine,
    pcts,
    percentile,
    run_main,
    table,
    uptime_line,
    write_json,
)
from benchmarks.smoke import parse_args
from benchmarks.source import add_source_argument, source_label
from iris.bundle import (
    MAX_WORKSPACE_BYTES,
    MIB,
    Bundle,
    digest,
    fetch_from_home,
    inspect,
    pack,
    store_at_home,
    unpack,
)
from iris.client import AsyncIrisClient
from iris.config import FederationConfig
from iris.controller.client import ControllerClient
from iris.jobs import JobState, JobStatus
from iris.objectstore import ObjectStore, open_store

TASK_QUEUE = "iris-bench-bundles"
PEER = "cw-us-east-02a"
USER = "bench-bundles@bench.local"
EMPTY = "empty"
UNCHANGED = "unchanged"
# The largest workspace stays this far under the limit (the limit itself is allowed, but "just
# under" leaves room for the run's own small files to differ).
UNDER_LIMIT = 64 * 1024
TARGET_ADDED_S = 1.0  # issue 13: a 10 MiB workspace adds at most 1 s to submit→RUNNING at p50
TARGET_SIZE_MIB = 10.0
MARK = "IRIS_BENCH_T"
# The job prints when its process starts, then lasts 0.3 s. A shell and coreutils, not Python: a
# controller running as root starts jobs as its ``run_as`` user (default ``nobody``; docs/SECURITY.md),
# who may not be able to reach the benchmark's own interpreter (e.g. one under /root).
JOB_COMMAND = ["/bin/sh", "-c", f"echo {MARK} $(date +%s.%N); sleep 0.3"]

# ---- synthetic workspaces ----------------------------------------------------------------------

_WORDS = (
    "batch",
    "size",
    "step",
    "loss",
    "grad",
    "model",
    "layer",
    "weight",
    "bias",
    "input",
    "output",
    "hidden",
    "state",
    "cache",
    "token",
    "embed",
    "attn",
    "head",
    "mask",
    "scale",
    "norm",
    "eps",
    "lr",
    "decay",
    "warmup",
    "epoch",
    "shard",
    "rank",
    "world",
    "device",
    "dtype",
    "config",
    "path",
    "name",
    "value",
    "index",
    "count",
    "total",
    "mean",
    "std",
    "min",
    "max",
    "shape",
    "dim",
    "axis",
    "buffer",
    "queue",
    "worker",
    "result",
    "metric",
    "logger",
    "checkpoint",
    "optimizer",
    "scheduler",
    "params",
    "data",
    "loader",
    "sample",
    "label",
    "target",
    "pred",
    "score",
    "seq",
    "len",
    "pos",
    "key",
    "query",
    "block",
    "stage",
    "split",
    "train",
    "eval",
    "test",
    "valid",
    "record",
    "file",
    "dir",
    "url",
    "bucket",
)
_TYPES = ("int", "float", "str", "bool", "Tensor", "list[int]", "dict[str, float]", "Path", "Config")


class _PyText:
    """Python-like source (functions, classes, imports, comments over a small vocabulary): gzip
    level 3 compresses it about 3.2x, like real Python (the project's own: 3.3x)."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng

    def ident(self, n: int = 2) -> str:
        return "_".join(self.rng.choice(_WORDS) for _ in range(self.rng.randint(1, n)))

    def camel(self) -> str:
        return "".join(self.rng.choice(_WORDS).capitalize() for _ in range(self.rng.randint(1, 3)))

    def words(self, lo: int, hi: int) -> str:
        return " ".join(self.rng.choice(_WORDS) for _ in range(self.rng.randint(lo, hi)))

    def expr(self) -> str:
        r = self.rng
        a, b = self.ident(), self.ident()
        return r.choice(
            [
                f"{a} * {b}",
                f"self.{a}({b}, {self.ident()}={r.randint(0, 512)})",
                f"torch.{r.choice(_WORDS)}({a}, dim={r.randint(-2, 3)})",
                f"{a}.{self.ident()}[{r.randint(0, 64)}]",
                f"[{a} for {b} in {self.ident()} if {b} is not None]",
                f'f"{{{a}}}/{r.choice(_WORDS)}-{{{b}:04d}}"',
                f"{r.uniform(0, 10):.4g}",
                f"{a} + {b}",
            ]
        )

    def statement(self, indent: int) -> list[str]:
        p = "    " * indent
        k = self.rng.randrange(10)
        if k < 4:
            return [f"{p}{self.ident()} = {self.expr()}"]
        if k == 4:
            return [f"{p}# {self.words(3, 10)}"]
        if k == 5:
            return [
                f"{p}if {self.ident()} > {self.rng.randint(0, 100)}:",
                f"{p}    {self.ident()} = {self.expr()}",
            ]
        if k == 6:
            return [
                f"{p}for {self.ident(1)} in range({self.ident()}):",
                f"{p}    {self.ident()} += {self.expr()}",
            ]
        if k == 7:
            return [f'{p}logger.info("{self.words(4, 4)} %s", {self.ident()})']
        if k == 8:
            return [f"{p}assert {self.ident()}.shape[{self.rng.randint(0, 3)}] == {self.ident()}"]
        return [f"{p}return {self.expr()}"]

    def function(self, indent: int) -> list[str]:
        p = "    " * indent
        args = ", ".join(f"{self.ident()}: {self.rng.choice(_TYPES)}" for _ in range(self.rng.randint(0, 4)))
        if indent:
            args = "self" + (", " + args if args else "")
        out = [
            f"{p}def {self.ident(3)}({args}) -> {self.rng.choice(_TYPES)}:",
            f'{p}    """{self.words(4, 14).capitalize()}."""',
        ]
        for _ in range(self.rng.randint(3, 15)):
            out += self.statement(indent + 1)
        return [*out, ""]

    def module(self, nbytes: int) -> bytes:
        lines = [f'"""{self.words(12, 12).capitalize()}."""', "", "from __future__ import annotations", ""]
        for _ in range(self.rng.randint(3, 8)):
            lines.append(f"from {self.rng.choice(_WORDS)}.{self.rng.choice(_WORDS)} import {self.ident()}")
        lines.append("")
        size = sum(len(line) + 1 for line in lines)
        while size < nbytes:
            if self.rng.random() < 0.3:
                block = [
                    f"class {self.camel()}({self.rng.choice(['nn.Module', 'BaseModel', 'object'])}):",
                    "",
                ]
                for _ in range(self.rng.randint(1, 5)):
                    block += self.function(1)
            else:
                block = self.function(0)
            block.append("")
            lines += block
            size += sum(len(line) + 1 for line in block)
        return ("\n".join(lines) + "\n").encode()[:nbytes]


_PACKAGES = ("model", "data", "train", "utils")
_GITIGNORE = b"*.ckpt\noutputs/\n*.log\n"
_README = b"# synthetic workspace\n\nMade by benchmarks/bundles.py: not a real project.\n"
NONCE_BYTES = 256


@dataclass
class Workspace:
    """A synthetic workspace whose shipped files sum to ``shipped`` bytes exactly."""

    label: str
    root: Path
    shipped: int
    text_bytes: int
    binary_bytes: int
    text_files: int
    ignored_bytes: int
    rng: random.Random = field(repr=False)

    @property
    def nonce_path(self) -> Path:
        return self.root / "src" / "run_config.py"

    def refresh(self) -> None:
        """Fresh content in one small source file (same size): the next pack is a new bundle."""
        body = f"# run configuration\nRUN_ID = '{self.rng.getrandbits(128):032x}'\n"
        self.nonce_path.write_bytes((body + "#" * (NONCE_BYTES - len(body) - 1) + "\n").encode())


def target_bytes(mib: float) -> int:
    want = int(mib * MIB)
    if want > MAX_WORKSPACE_BYTES:
        raise BenchError(f"--sizes: {mib} MiB is over the {MAX_WORKSPACE_BYTES // MIB} MiB limit")
    return min(want, MAX_WORKSPACE_BYTES - UNDER_LIMIT)


def _split(rng: random.Random, total: int, parts: int) -> list[int]:
    """``parts`` sizes summing to ``total``, uneven like a real tree (a few large modules)."""
    weights = [rng.lognormvariate(0, 0.8) for _ in range(parts)]
    s = sum(weights)
    sizes = [max(64, int(total * w / s)) for w in weights]
    sizes[-1] += total - sum(sizes)
    if sizes[-1] < 64:
        raise BenchError(f"workspace too small to split into {parts} files")
    return sizes


def build_workspace(root: Path, label: str, shipped: int, seed: int, *, files: int = 50) -> Workspace:
    """Half Python-like text over ``files`` files (in src/<pkg>/, scripts/, tests/), half a random
    "checkpoint", and ignored files that would not fit under the limit if they were counted."""
    rng = random.Random(seed)
    root.mkdir(parents=True)
    fixed = len(_GITIGNORE) + len(_README) + NONCE_BYTES
    text_total = shipped // 2 - fixed
    binary = shipped - fixed - text_total
    names = [f"src/{pkg}/{_module_name(rng)}.py" for pkg in _PACKAGES for _ in range(10)]
    names += [f"scripts/{_module_name(rng)}.py" for _ in range(5)] + [
        f"tests/test_{_module_name(rng)}.py" for _ in range(5)
    ]
    names = sorted(set(names))[:files]
    gen = _PyText(rng)
    for name, size in zip(names, _split(rng, text_total, len(names)), strict=True):
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(gen.module(size))
    (root / ".gitignore").write_bytes(_GITIGNORE)
    (root / "README.md").write_bytes(_README)
    (root / "weights").mkdir()
    (root / "weights" / "init.bin").write_bytes(os.urandom(binary))
    # Never shipped: a virtualenv (always skipped), gitignored checkpoints, outputs and logs.
    ignored = {
        ".venv/lib/python3.11/site-packages/bigdep/__init__.py": gen.module(MIB),
        ".venv/lib/python3.11/site-packages/bigdep/_native.so": os.urandom(4 * MIB),
        "checkpoints/step_000100.ckpt": os.urandom(8 * MIB),
        "outputs/eval.json": b"{}\n" * 1000,
        "train.log": b"step 1 loss 2.31\n" * 1000,
        "src/__pycache__/run_config.cpython-311.pyc": os.urandom(4096),
    }
    for name, data in ignored.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    ws = Workspace(
        label=label,
        root=root,
        shipped=shipped,
        text_bytes=text_total,
        binary_bytes=binary,
        text_files=len(names),
        ignored_bytes=sum(len(d) for d in ignored.values()),
        rng=rng,
    )
    ws.refresh()
    return ws


def _module_name(rng: random.Random) -> str:
    return "_".join(rng.choice(_WORDS) for _ in range(rng.randint(1, 2))) + f"_{rng.randrange(1000):03d}"


def checked_pack(ws: Workspace) -> Bundle:
    """``pack``, and a check that exactly the intended files were shipped (none of the ignored)."""
    bundle = pack(ws.root)
    if bundle is None:
        raise BenchError(f"workspace {ws.label} packed to nothing")
    expected_files = ws.text_files + 4  # .gitignore, README.md, weights/init.bin, src/run_config.py
    if bundle.ref.workspace_bytes != ws.shipped or bundle.ref.files != expected_files:
        raise BenchError(
            f"workspace {ws.label}: packed {bundle.ref.files} files / {bundle.ref.workspace_bytes} bytes, "
            f"expected {expected_files} / {ws.shipped} (ignore rules not applied?)"
        )
    return bundle


# ---- components --------------------------------------------------------------------------------


@dataclass
class ComponentRun:
    label: str
    run: int
    sha256: str
    workspace_bytes: int
    archive_bytes: int
    files: int
    pack_s: float
    store_s: float
    fetch_s: float
    stage_s: float
    check_s: float
    unpack_s: float


async def component_run(
    ws: Workspace, run: int, stack: BenchStack, store: ObjectStore, scratch: Path
) -> ComponentRun:
    ws.refresh()
    t = time.perf_counter()
    bundle = checked_pack(ws)
    pack_s = time.perf_counter() - t

    t = time.perf_counter()
    wrote = store_at_home(store, bundle)
    store_s = time.perf_counter() - t
    if not wrote:
        raise BenchError(f"bundle {bundle.ref.short} was already at home: content not fresh")

    t = time.perf_counter()
    data = fetch_from_home(store, bundle.ref)
    fetch_s = time.perf_counter() - t

    async with ControllerClient.for_cluster(stack.config, PEER) as ctl:
        t = time.perf_counter()
        info = await ctl.put_bundle(bundle.ref.sha256, data)
        stage_s = time.perf_counter() - t
    if not info.created:
        raise BenchError(f"bundle {bundle.ref.short} was already on {PEER}: content not fresh")

    t = time.perf_counter()
    if digest(data) != bundle.ref.sha256:
        raise BenchError("the home store returned other bytes")
    inspect(data)
    check_s = time.perf_counter() - t

    dest = Path(tempfile.mkdtemp(dir=scratch, prefix="unpack-"))
    try:
        t = time.perf_counter()
        unpack(data, dest)
        unpack_s = time.perf_counter() - t
    finally:
        shutil.rmtree(dest, ignore_errors=True)
    return ComponentRun(
        label=ws.label,
        run=run,
        sha256=bundle.ref.sha256,
        workspace_bytes=bundle.ref.workspace_bytes,
        archive_bytes=bundle.ref.size,
        files=bundle.ref.files,
        pack_s=pack_s,
        store_s=store_s,
        fetch_s=fetch_s,
        stage_s=stage_s,
        check_s=check_s,
        unpack_s=unpack_s,
    )


# ---- end to end --------------------------------------------------------------------------------


@dataclass
class E2ERun:
    case: str
    run: int
    job_id: str
    t0_ms: float  # wall clock just before submit() was called
    submit_returned_ms: float
    spec_submit_ms: int  # set by build_spec, after pack
    archive_bytes: int | None
    state: str
    events: list[tuple[int, str, str]]
    started_ms: int | None  # the controller's own RUNNING time
    finished_ms: int | None
    process_ms: float | None  # the job's command printed the wall clock as its first act

    def milestone(self, name: str) -> float | None:
        """Milliseconds from t0 to a point of the job's story (None if it has no such point)."""
        at: float | None = None
        if name == "spec":
            at = self.spec_submit_ms
        elif name == "returned":
            at = self.submit_returned_ms
        elif name == "first event":
            at = self.events[0][0] if self.events else None
        elif name == "placed":
            at = next((a for a, s, m in self.events if s == JobState.PENDING_HANDOFF.value), None)
        elif name == "staging":
            at = next((a for a, s, _ in self.events if s == JobState.BUILDING.value), None)
        elif name == "staged":
            at = next(
                (
                    a
                    for a, s, m in self.events
                    if s == JobState.BUILDING.value and m.startswith("workspace bundle")
                ),
                None,
            )
        elif name == "running":
            at = self.started_ms
        elif name == "process":
            at = self.process_ms
        return None if at is None else at - self.t0_ms


def _process_time(log: str) -> float | None:
    for line in log.splitlines():
        if line.startswith(MARK):
            try:
                return float(line.split()[1]) * 1000
            except (IndexError, ValueError):
                return None
    return None


async def e2e_run(
    iris: AsyncIrisClient,
    stack: BenchStack,
    case: str,
    run: int,
    workdir: Path,
    deadline: Deadline,
    timeout_s: float,
) -> E2ERun:
    name = f"{case.replace(' ', '')}-{run:02d}"
    # Whole milliseconds, like the job's submit_ms and the controller's times.
    t0_ms = float(time.time_ns() // 1_000_000)
    job_id = await iris.submit(
        list(JOB_COMMAND),
        workdir=workdir,
        name=name,
        user=USER,
        device_type="h100",
        gpu_count=1,
        target_cluster=PEER,
    )
    returned_ms = time.time() * 1000
    end = time.monotonic() + deadline.bound(timeout_s)
    while True:
        status = await iris.describe(job_id)
        if status.terminal:
            break
        if time.monotonic() > end:
            raise BenchError(
                f"job {job_id} not finished after {timeout_s:.0f}s: {status.state} {status.reason}"
            )
        await asyncio.sleep(0.25)
    if status.state is not JobState.SUCCEEDED:
        raise BenchError(f"job {job_id} ended {status.state.value}: {status.reason} {status.error or ''}")
    return await _e2e_record(stack, case, run, status, t0_ms, returned_ms)


async def _e2e_record(
    stack: BenchStack, case: str, run: int, status: JobStatus, t0_ms: float, returned_ms: float
) -> E2ERun:
    assert status.cluster is not None
    async with ControllerClient.for_cluster(stack.config, status.cluster) as ctl:
        remote = await ctl.status(status.job_id)
        log = await ctl.logs(status.job_id)
    bundle = status.spec.bundle if status.spec is not None else None
    return E2ERun(
        case=case,
        run=run,
        job_id=status.job_id,
        t0_ms=t0_ms,
        submit_returned_ms=returned_ms,
        spec_submit_ms=status.submit_ms,
        archive_bytes=bundle.size if bundle is not None else None,
        state=status.state.value,
        events=[(e.at_ms, e.state.value, e.message) for e in status.events],
        started_ms=remote.started_ms,
        finished_ms=remote.finished_ms,
        process_ms=_process_time(log.data),
    )


# ---- report ------------------------------------------------------------------------------------


def _label(mib: float) -> str:
    return f"{mib:g} MiB"


def _stat(values: list[float], q: float) -> float:
    return percentile(values, q) if values else float("nan")


def report_components(runs: list[ComponentRun], labels: list[str]) -> tuple[str, dict[str, Any]]:
    rows: list[list[object]] = []
    out: dict[str, Any] = {}
    cols = ("pack_s", "store_s", "fetch_s", "stage_s", "check_s", "unpack_s")
    for label in labels:
        rs = [r for r in runs if r.label == label]
        if not rs:
            continue
        ws_mib = rs[0].workspace_bytes / MIB
        arch_mib = percentile([r.archive_bytes for r in rs], 50) / MIB
        stats = {c: pcts([getattr(r, c) * 1000 for r in rs]) for c in cols}
        path = sum(stats[c]["p50"] for c in ("pack_s", "store_s", "fetch_s", "stage_s", "unpack_s"))
        out[label] = {
            "workspace_bytes": rs[0].workspace_bytes,
            "files": rs[0].files,
            "archive_bytes_p50": arch_mib * MIB,
            "ratio": arch_mib / ws_mib,
            "ms": stats,
            "critical_path_p50_ms": path,
        }
        rows.append(
            [
                label,
                f"{ws_mib:.2f}",
                rs[0].files,
                f"{arch_mib:.2f}",
                f"{arch_mib / ws_mib:.2f}",
                *(f"{fmt(stats[c]['p50'])} / {fmt(stats[c]['max'])}" for c in cols),
                path,
            ]
        )
    headers = [
        "workspace",
        "MiB",
        "files",
        "archive MiB",
        "ratio",
        "pack",
        "store home",
        "home fetch",
        "stage (PUT)",
        "hash+inspect",
        "unpack",
        "sum",
    ]
    return table(headers, rows), out


MILESTONES = ("spec", "first event", "placed", "staging", "staged", "running", "process")


def report_e2e(runs: list[E2ERun], cases: list[str]) -> tuple[str, str, dict[str, Any]]:
    rows: list[list[object]] = []
    out: dict[str, Any] = {}
    base = [r.milestone("running") for r in runs if r.case == EMPTY]
    base_run = _stat([v for v in base if v is not None], 50)
    base_proc = _stat(
        [v for v in (r.milestone("process") for r in runs if r.case == EMPTY) if v is not None], 50
    )
    steps: list[list[object]] = []
    for case in cases:
        rs = [r for r in runs if r.case == case]
        if not rs:
            continue
        running = [v for v in (r.milestone("running") for r in rs) if v is not None]
        proc = [v for v in (r.milestone("process") for r in rs) if v is not None]
        p_run = pcts(running)
        p_proc = pcts(proc)
        arch = [r.archive_bytes for r in rs if r.archive_bytes is not None]
        out[case] = {
            "submit_to_running_ms": p_run,
            "submit_to_process_ms": p_proc,
            "added_p50_ms": p_run["p50"] - base_run,
            "added_process_p50_ms": p_proc["p50"] - base_proc,
            "archive_bytes_p50": percentile(arch, 50) if arch else None,
            "milestones_p50_ms": {},
        }
        rows.append(
            [
                case,
                len(rs),
                f"{percentile(arch, 50) / MIB:.2f}" if arch else "-",
                p_run["p50"],
                p_run["p95"],
                "-" if case == EMPTY else f"{p_run['p50'] - base_run:+.0f}",
                p_proc["p50"],
                p_proc["p95"],
                "-" if case == EMPTY else f"{p_proc['p50'] - base_proc:+.0f}",
            ]
        )
        cells: list[object] = [case]
        for m in MILESTONES:
            vals = [v for v in (r.milestone(m) for r in rs) if v is not None]
            p50 = _stat(vals, 50)
            out[case]["milestones_p50_ms"][m] = p50 if p50 == p50 else None  # NaN: no such point
            cells.append(p50)
        steps.append(cells)
    main = table(
        [
            "workspace",
            "n",
            "archive MiB",
            "→RUNNING p50",
            "p95",
            "added p50",
            "→process p50",
            "p95",
            "added p50",
        ],
        rows,
    )
    milestones = table(
        ["workspace", "pack (spec)", "wf start", "placed", "BUILDING", "staged", "RUNNING", "process"],
        steps,
    )
    return main, milestones, out


# ---- the run -----------------------------------------------------------------------------------


def _noop(_: FederationConfig) -> None:
    return None


async def run(args: argparse.Namespace) -> int:
    deadline = Deadline(args.timeout)
    info = machine()
    sizes = [float(s) for s in args.sizes]
    labels = [_label(s) for s in sizes]
    unchanged_mib = TARGET_SIZE_MIB if TARGET_SIZE_MIB in sizes else sizes[len(sizes) // 2]
    root = Path(tempfile.mkdtemp(prefix="iris-bench-bundles-"))
    stack = BenchStack(root / "stack")
    stack.root.mkdir()
    print(f"stack in {root} ({info['uptime_before']})", flush=True)
    out: dict[str, Any] = {"machine": info, "args": vars(args), "source": source_label()}
    try:
        t = time.perf_counter()
        workspaces = {
            label: build_workspace(root / "ws" / f"w{i}", label, target_bytes(mib), seed=100 + i)
            for i, (label, mib) in enumerate(zip(labels, sizes, strict=True))
        }
        unchanged = build_workspace(root / "ws" / "unchanged", UNCHANGED, target_bytes(unchanged_mib), seed=7)
        empty = root / "ws" / "empty"
        empty.mkdir()
        print(f"workspaces built in {time.perf_counter() - t:.1f}s", flush=True)
        scratch = root / "scratch"
        scratch.mkdir()

        # Submissions are signed by their user (docs/DESIGN.md, "User → home").
        await stack.start(_noop, task_queue=TASK_QUEUE, users={USER: ["user"]})
        await stack.start_worker()
        home = stack.config.home_cluster.object_store
        if home is None:
            raise BenchError("the home cluster has no object store")
        store = open_store(home)
        iris = AsyncIrisClient(stack.client, stack.config)

        # Warm-up, not counted: first store and controller connections, first bundle on the peer,
        # the worker's first job of each kind. It also puts the unchanged workspace at home and on
        # the peer.
        await component_run(workspaces[labels[0]], -1, stack, store, scratch)
        await e2e_run(iris, stack, EMPTY, 99, empty, deadline, args.job_timeout)
        await e2e_run(iris, stack, UNCHANGED, 99, unchanged.root, deadline, args.job_timeout)

        print(f"[{time.strftime('%X')}] components: {args.runs} runs x {', '.join(labels)}", flush=True)
        comps: list[ComponentRun] = []
        with LoadSampler() as comp_load:
            for i in range(args.runs):
                for k in range(len(labels)):
                    label = labels[(i + k) % len(labels)]
                    deadline.bound(60)
                    comps.append(await component_run(workspaces[label], i, stack, store, scratch))
        print(f"  load {comp_load.summary()}", flush=True)

        cases = [EMPTY, *labels, UNCHANGED]
        print(f"[{time.strftime('%X')}] end to end: {args.runs} rounds x {', '.join(cases)}", flush=True)
        jobs: list[E2ERun] = []
        with LoadSampler() as e2e_load:
            for i in range(args.runs):
                for k in range(len(cases)):
                    case = cases[(i + k) % len(cases)]
                    if case == EMPTY:
                        workdir = empty
                    elif case == UNCHANGED:
                        workdir = unchanged.root
                    else:
                        workspaces[case].refresh()
                        workdir = workspaces[case].root
                    jobs.append(await e2e_run(iris, stack, case, i, workdir, deadline, args.job_timeout))
                    await asyncio.sleep(0.2)
        print(f"  load {e2e_load.summary()}", flush=True)
        info["uptime_after"] = uptime_line()

        comp_table, comp_out = report_components(comps, labels)
        e2e_table, steps_table, e2e_out = report_e2e(jobs, [EMPTY, *labels, UNCHANGED])
        print()
        print(
            f"machine: {info['nproc']} CPUs ({info['cpu']}), {info['mem_gib']} GiB; Python {info['python']}"
        )
        print(f"code: {source_label()}")
        print(f"before: {info['uptime_before']}")
        print(f"after:  {info['uptime_after']}")
        print(
            f"workspaces: about half Python-like text over {unchanged.text_files} files, half random bytes; "
            f"{fmt(unchanged.ignored_bytes / MIB)} MiB of ignored files each (.venv/, *.ckpt, outputs/, "
            f"*.log, __pycache__/) not shipped; limit {MAX_WORKSPACE_BYTES // MIB} MiB"
        )
        print(
            f"\nComponents (ms, p50 / max of {args.runs} runs, each a new bundle; load {comp_load.summary()})"
        )
        print(comp_table)
        print(
            "\n".join(
                [
                    "pack: iris.bundle.pack in this process; store home: store_at_home into fake-gcs-server;",
                    "home fetch: fetch_from_home (download + sha256), what stage_bundle reads;",
                    f"stage (PUT): put_bundle to {PEER}'s controller (signed; it hashes, inspects, fsyncs);",
                    "hash+inspect: the controller's check of the bytes, timed here;",
                    "unpack: iris.bundle.unpack into a temp dir, the code the controller runs before the",
                    "job starts, timed in this process on this machine; sum: pack+store+fetch+stage+unpack.",
                ]
            )
        )
        print(
            f"\nEnd to end (ms from just before submit(); job pinned to {PEER}, h100 x 1; "
            f"{args.runs} rounds, cases interleaved; load {e2e_load.summary()})"
        )
        print(e2e_table)
        print(
            "\n".join(
                [
                    "→RUNNING: the controller's started_ms (set as it starts the job, BEFORE the unpack);",
                    "→process: the job's command printing the wall clock (after the unpack);",
                    "added: p50 minus the empty workspace's p50;",
                    f"{UNCHANGED}: the same {_label(unchanged_mib)} workspace each time (already at home "
                    "and on the peer).",
                ]
            )
        )
        print("\nWhere the time goes (p50 ms from just before submit() to each point)")
        print(steps_table)
        print(
            "\n".join(
                [
                    "pack (spec): build_spec's submit_ms, right after pack; wf start: the workflow's",
                    "first event (storing at home and starting the workflow come before it); placed:",
                    "PENDING_HANDOFF; BUILDING / staged: stage_bundle's start and end. Event times are",
                    "workflow-task times.",
                ]
            )
        )
        target_label = _label(TARGET_SIZE_MIB)
        verdict: dict[str, Any] = {"target_s": TARGET_ADDED_S}
        if target_label in e2e_out:
            added = e2e_out[target_label]["added_p50_ms"] / 1000
            added_proc = e2e_out[target_label]["added_process_p50_ms"] / 1000
            met = added <= TARGET_ADDED_S
            verdict.update(added_s=added, added_process_s=added_proc, met=met)
            print(
                f"\ntarget: {target_label} adds ≤ {TARGET_ADDED_S:g} s to submit→RUNNING at p50: "
                f"{'met' if met else 'NOT met'} (+{added:.2f} s; to the job's process +{added_proc:.2f} s)"
            )
        else:
            print(f"\ntarget: {target_label} not among --sizes; not judged")
        out.update(
            components=comp_out,
            end_to_end=e2e_out,
            target=verdict,
            load={"components": comp_load.summary(), "end_to_end": e2e_load.summary()},
            raw={"components": [asdict(c) for c in comps], "end_to_end": [asdict(j) for j in jobs]},
            workspaces={
                w.label: {k: v for k, v in asdict(w).items() if k not in ("rng", "root")}
                for w in [*workspaces.values(), unchanged]
            },
        )
        write_json(args.out, out)
        return 0
    finally:
        await stack.stop()
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)


def _sizes(value: str) -> list[float]:
    try:
        sizes = [float(s) for s in value.replace(",", " ").split()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a list of MiB: {value!r}") from None
    if not sizes or any(s <= 0 for s in sizes):
        raise argparse.ArgumentTypeError("sizes must be positive MiB values")
    return sizes


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=7, help="runs per size (each a new bundle)")
    p.add_argument(
        "--sizes",
        type=_sizes,
        default=[1.0, 10.0, 25.0],
        help="workspace sizes in MiB, comma-separated (25 = just under the limit); default 1,10,25",
    )
    p.add_argument("--timeout", type=float, default=600, help="bound on the whole run, seconds")
    p.add_argument("--job-timeout", type=float, default=60, help="bound on one job, seconds")
    p.add_argument("--out", type=Path, help="write the results as JSON here")
    p.add_argument("--keep", action="store_true", help="keep the temp directory (stack and workspaces)")
    add_source_argument(p)
    args = parse_args(p, {"runs": 1, "sizes": "1", "timeout": 300})
    run_main(lambda: run(args))


if __name__ == "__main__":
    main()
