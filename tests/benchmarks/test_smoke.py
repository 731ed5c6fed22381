"""Every benchmark still runs: each module's ``main`` at its smoke size (``--smoke``,
benchmarks/smoke.py) in a subprocess, on the work tree (``--source worktree``, so the suite tests
the code being changed, not a frozen copy of HEAD), asserting on the output's shape and counts
(jobs that ended as they should, rows that must be there), never on a timing.

The library modules are covered by the benchmarks that use them: ``harness`` (the stack: every
stack benchmark), ``source`` (the snapshot switch: every ``--source``), ``ceiling`` (its worker
process: ``e2e``), ``smoke`` (every ``--smoke``); ``compare`` reads ``e2e --out`` files and is run
here on the one the ``e2e`` smoke writes.

The stack benchmarks start their own services (Temporal dev server, emulators, controllers,
``iris worker``), hence the ``e2e`` mark. Each run gets an empty ``$XDG_CONFIG_HOME`` and no
``IRIS_*`` variable of this process: a benchmark must make its own user keys (in its temp
directory) and never read or write the real ``~/.config/iris``.
"""

from __future__ import annotations

import ast
import asyncio
import os
import re
import signal
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from benchmarks import policy_bench, wake

PROJECT_ROOT = Path(__file__).resolve().parents[2]
# A smoke run takes seconds to a minute on two quiet cores; this bounds a busy CI machine's.
RUN_TIMEOUT_S = 420


@dataclass(frozen=True)
class Run:
    stdout: str
    stderr: str


def _dict_after(label: str, text: str) -> dict[str, int]:
    """The ``{...}`` literal printed right after ``label``."""
    m = re.search(re.escape(label) + r"\s*(\{[^}]*\})", text)
    assert m, f"no {label!r} in the output"
    value = ast.literal_eval(m.group(1))
    assert isinstance(value, dict)
    return value


def check_e2e(run: Run, tmp: Path) -> None:
    out = run.stdout
    assert "code: work tree at HEAD" in out
    assert _dict_after("light", out.split("job states:", 1)[1]) == {"SUCCEEDED": 2}
    assert _dict_after("pipeline", out.split("job states:", 1)[1]) == {"SUCCEEDED": 5}
    assert _dict_after("cancel (home/peer)", out) == {"KILLED/KILLED": 2}
    assert re.search(r"ratio pipeline/ceiling = \d+\.\d\d", out)
    for row in ("light: submit→handed off (local CPU)", "burst: submit→closed (all)", "cancel (burst) →"):
        assert row in out
    # The JSON the e2e run wrote, side by side with itself: compare reads every key it prints.
    compared = subprocess.run(
        [sys.executable, "-m", "benchmarks.compare", str(tmp / "e2e.json"), str(tmp / "e2e.json")],
        cwd=PROJECT_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert compared.returncode == 0, compared.stderr
    rows = compared.stdout.splitlines()[1:]
    assert len(rows) > 10 and any(r.startswith("ratio pipeline/ceiling") for r in rows), compared.stdout
    # Every row found its key in the e2e JSON ("-" is a missing key).
    assert [r for r in rows if r.rstrip().endswith(" -")] == [], compared.stdout


def check_scale(run: Run, tmp: Path) -> None:
    out = run.stdout
    assert "10 of 10 h100x8 jobs submitted" in out
    assert _dict_after("job states:", out) == {"QUEUED_HANDOFF": 10}
    for section in ("Worker memory", "Placement ticks by queue length", "Per queued job"):
        assert section in out


def check_bundles(run: Run, tmp: Path) -> None:
    out = run.stdout
    e2e = out.split("End to end", 1)[1]
    for case in ("empty", "1 MiB", "unchanged"):
        # One round per case; every job SUCCEEDED (another end stops the run with an error).
        assert re.search(rf"^{re.escape(case)}\s+1\s", e2e, re.MULTILINE), e2e
    assert re.search(r"^1 MiB\s+1\.00\s+\d+", out.split("Components", 1)[1], re.MULTILINE)


def check_controller_requests(run: Run, tmp: Path) -> None:
    out = run.stdout
    assert "0 jobs p50/p99 ms, cpu ms/req" in out and "50 jobs p50/p99 ms, cpu ms/req" in out
    for route in ("health", "backends", "job", "changes", "jobs_page"):
        assert re.search(rf"^{route}\s+\S", out, re.MULTILINE)
    assert _dict_after("ended", out) == {"SUCCEEDED": 10}
    assert "10 jobs (5 bystander processes) launched" in out


def check_policy_bench(run: Run, tmp: Path) -> None:
    # One case, 300 jobs x 5 clusters x 4 backends; the planner matched the reference (a mismatch
    # exits non-zero).
    assert re.search(r"^\s+300\s+5\s+20\s+\d+\s+\d+\s+[\d.]+", run.stdout, re.MULTILINE), run.stdout
    # The tick's own work with 0 and 40 jobs held running: every step timed, every held job in use.
    held = run.stdout.split("The tick's own work with N jobs held running", 1)[1]
    for step in (*policy_bench.HELD_STEPS, r"tick \(ms\)"):
        assert re.search(rf"^{step}\s+[\d.]+\s+[\d.]+$", held, re.MULTILINE), held
    assert re.search(r"^in use\s+0\s+40$", held, re.MULTILINE), held


def check_wake(run: Run, tmp: Path) -> None:
    # Two lengths of a running job's history, each replayed clean (a failure exits non-zero): the
    # recorded one, cut at its first re-signal of RUNNING (its length is the recording's: it moves
    # with each re-recording, 44 events with the 2027-02 baseline), and nine signals more, six
    # events each.
    recorded = len(wake.running_history(1)["events"])
    rows = re.findall(r"^\s+(\d+)\s+(\d+)\s+[\d.]+\s+[\d.]+\s+[\d.]+$", run.stdout, re.MULTILINE)
    assert [(int(a), int(b)) for a, b in rows] == [(1, recorded), (10, recorded + 9 * 6)], run.stdout
    assert "fit: a wake replays in" in run.stdout


def check_tracing_headers(run: Run, tmp: Path) -> None:
    out = run.stdout
    for app in ("traced", "untraced"):
        for kind in ("plain", "hostile"):
            assert re.search(rf"^\s+{app}\s+{kind}\s+[\d.]+$", out, re.MULTILINE)
    assert "tracing adds" in out
    # Iris's propagator never parses the hostile headers, so the SDK has nothing to warn about.
    assert "logged 0 warnings" in out


def check_running(run: Run, tmp: Path) -> None:
    out = run.stdout
    assert "running at once (controllers' records): max 4" in out
    assert "drain: 4 of 4 closed" in out
    assert _dict_after("peer states", out) == {"SUCCEEDED": 4}
    assert _dict_after("home states (sample)", out) == {"SUCCEEDED": 4}
    assert "PAPER PROJECTION" in out
    # Every held job ran from one workspace: each peer's disk is reported with its copies, and after
    # retention no peer keeps a bundle or a copy.
    assert re.search(r"disk in the hold: .*workspace copies: \d+\.\d\d", out), out
    left = _dict_after("(bundles, copies)", out)
    assert left and all(v == (0, 0) for v in left.values()), left


def check_placement(run: Run, tmp: Path) -> None:
    out = run.stdout
    assert re.search(r"all 6 RUNNING [\d.]+s after the first submit", out), out
    assert _dict_after("peer states", out) == {"SUCCEEDED": 6}
    assert "workflows still open 0" in out
    assert "placement ticks in the ramp:" in out and "history per job up to RUNNING" in out
    # --ceiling: the engine's own rate for the job's steps up to its launch, on the same server.
    assert re.search(r"ceiling for the steps up to the launch \('a[als]*a'\): 6 no-op", out), out
    assert re.search(r"placements/ceiling = \d+\.\d\d", out), out


def check_trace(run: Run, tmp: Path) -> None:
    out = run.stdout
    m = re.search(r"trace: seed 1, (\d+) jobs", out)
    assert m and int(m.group(1)) > 0
    n = int(m.group(1))
    assert re.search(rf"^all\s+{n}\s", out, re.MULTILINE), out
    for band in ("production", "interactive", "batch"):
        assert re.search(rf"^{band}\s+\d+\s+\d+", out, re.MULTILINE)
    assert sum(_dict_after("home states at the end:", out).values()) == n
    assert "errors, e.g." not in run.stderr


def check_trace_fair_share(run: Run, tmp: Path) -> None:
    """The fair-share scenario: batch only, two users, each one's row, and b's share line."""
    out = run.stdout
    m = re.search(r"trace: seed 1, (\d+) jobs \(production 0, interactive 0, batch (\d+)\)", out)
    assert m and int(m.group(1)) == int(m.group(2)) > 0, out
    assert sum(_dict_after("home states at the end:", out).values()) == int(m.group(1))
    table = out.split("per user (measured):", 1)[1]
    jobs = {u: int(n) for u, n in re.findall(r"^([ab])\s+(\d+)\s+\d+\s", table, re.MULTILINE)}
    assert set(jobs) == {"a", "b"} and jobs["a"] + jobs["b"] == int(m.group(1)), table
    assert re.search(r"fair share \(batch\): b, with the fewest jobs, held (\d+%|-)", table), table
    assert "target of issue 29: the lightest user holds" in table
    assert "errors, e.g." not in run.stderr


def check_workers(run: Run, tmp: Path) -> None:
    out = run.stdout
    for phase, workers in (("p1-1w", 1), ("p2-2w", 2)):
        assert re.search(rf"^{phase}\s+{workers}\s+[\d.]+\s+[\d.]+", out, re.MULTILINE), out
    assert re.search(r"p2-2w: 2 workers [\d.]+ jobs/s against [\d.]+ with one", out)


def postgres_reachable() -> None:
    """Skip (naming the URL) without a PostgreSQL server, as the store tests do."""
    from sqlalchemy import create_engine

    from benchmarks.workers import DEFAULT_POSTGRES

    url = os.environ.get("IRIS_TEST_POSTGRES_URL") or DEFAULT_POSTGRES
    engine = create_engine(url, connect_args={"connect_timeout": 3})
    try:
        with engine.connect() as conn:
            conn.exec_driver_sql("SELECT 1")
    except Exception as exc:
        pytest.skip(f"PostgreSQL not reachable at {url}: {type(exc).__name__}".splitlines()[0])
    finally:
        engine.dispose()


def slurm_available() -> None:
    """Skip (saying why) where a local Slurm cannot run (iris/slurmdev.py)."""
    from iris import slurmdev

    why = slurmdev.unavailable()
    if why is not None:
        pytest.skip(why)


@dataclass(frozen=True)
class Smoke:
    module: str
    check: Callable[[Run, Path], None]
    extra: tuple[str, ...] = ()
    # Starts services (and measures a frozen copy of --source unless told the work tree).
    stack: bool = True
    needs: Callable[[], None] | None = None
    # The test id, when one module is smoked more than one way.
    name: str = ""

    @property
    def id(self) -> str:
        return self.name or self.module


SMOKES = [
    Smoke("e2e", check_e2e, ("--out", "{tmp}/e2e.json")),
    Smoke("scale", check_scale),
    Smoke("bundles", check_bundles),
    Smoke("controller_requests", check_controller_requests),
    Smoke("running", check_running),
    Smoke("placement", check_placement, ("--ceiling",)),
    Smoke("trace", check_trace),
    # The same trace with the GPU peers on a single-node Slurm (issue 30).
    Smoke("trace", check_trace, ("--backend", "slurm"), needs=slurm_available, name="trace-slurm"),
    # The fair-share scenario (issue 29): two users, each submission signed by its own.
    Smoke("trace", check_trace_fair_share, ("--fair-share",), name="trace-fair-share"),
    Smoke("workers", check_workers, needs=postgres_reachable),
    # Service-free, in-process: the fast subset runs them too.
    Smoke("policy_bench", check_policy_bench, stack=False),
    Smoke("tracing_headers", check_tracing_headers, stack=False),
    Smoke("wake", check_wake, stack=False),
]


def run_benchmark(module: str, args: list[str], tmp: Path) -> Run:
    """``python -m benchmarks.<module> args`` in its own session: on a timeout the whole group (its
    services included) gets SIGTERM, which the stack benchmarks turn into a clean stop."""
    config_home = tmp / "config"
    config_home.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("IRIS_") or k == "IRIS_TEST_POSTGRES_URL"}
    env["XDG_CONFIG_HOME"] = str(config_home)
    proc = subprocess.Popen(
        [sys.executable, "-m", f"benchmarks.{module}", *args],
        cwd=PROJECT_ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        stdout, stderr = proc.communicate(timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            stdout, stderr = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            stdout, stderr = proc.communicate()
        pytest.fail(
            f"benchmarks.{module} --smoke ran over {RUN_TIMEOUT_S}s\n{stdout[-3000:]}\n{stderr[-3000:]}"
        )
    assert proc.returncode == 0, (
        f"benchmarks.{module} exited {proc.returncode}\n{stdout[-3000:]}\n{stderr[-5000:]}"
    )
    # Nothing under the (empty) config home: the run made its user keys in its own temp directory.
    assert list(config_home.iterdir()) == []
    return Run(stdout, stderr)


def marks(smoke: Smoke) -> list[pytest.MarkDecorator]:
    # Each benchmark its own xdist group (tests/conftest.py groups a module's tests otherwise): the
    # runs share nothing, so the test processes can split them.
    return [pytest.mark.xdist_group(f"smoke-{smoke.id}"), *([pytest.mark.e2e] if smoke.stack else [])]


@pytest.mark.timeout(RUN_TIMEOUT_S + 120)
@pytest.mark.parametrize("smoke", [pytest.param(s, id=s.id, marks=marks(s)) for s in SMOKES])
async def test_benchmark_runs_at_its_smoke_size(smoke: Smoke, tmp_path: Path) -> None:
    # Async, the waits in a thread: a stack this test process runs (its worker and fault proxies
    # live in the session's event loop) goes on meanwhile instead of stalling for the whole run.
    if smoke.needs is not None:
        smoke.needs()
    args = ["--smoke", *(a.format(tmp=tmp_path) for a in smoke.extra)]
    if smoke.stack:
        args += ["--source", "worktree"]
    run = await asyncio.to_thread(run_benchmark, smoke.module, args, tmp_path)
    await asyncio.to_thread(smoke.check, run, tmp_path)


def test_every_benchmark_module_is_smoked_or_a_library() -> None:
    """A new benchmark module gets a smoke run here (or is named a library in this module's doc)."""
    modules = {p.stem for p in (PROJECT_ROOT / "benchmarks").glob("*.py")} - {"__init__"}
    libraries = {"harness", "source", "ceiling", "smoke", "compare"}
    assert modules - libraries == {s.module for s in SMOKES}
