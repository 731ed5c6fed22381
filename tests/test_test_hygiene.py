"""The suite's own hygiene (issue 25): no sleep stands in for synchronisation and no test asserts a
wall-clock upper bound. Both make a test that passes on a quiet machine fail on a loaded one (two
test processes on two shared cores): a test waits on the condition it means, and a performance
figure belongs in benchmarks/ (docs/BENCHMARKS.md), not in an assertion.

Service-free: every ``tests/**/*.py`` is parsed with ``ast`` (a job's command string that sleeps is
data, not a call) and two rules are checked.

(a) A call of ``asyncio.sleep`` or ``time.sleep`` (however imported) is allowed only

- inside a polling helper of ``POLLING_HELPERS``: a function that re-checks its condition every
  round and fails with a message at its deadline, so a slow machine only makes it poll longer; or
- with ``# not a wait: <reason>`` on one of the call's lines: a sleep that waits for no state (an
  injected fault or delay, a race harness's random jitter, a retry's backoff or a sampler's period,
  one turn of the event loop, real time that must pass because it is the input).

A check that something did not happen is read after a positive marker ordered after it (a later
job listed, a later poll answered), never after a sleep.

``env.sleep`` on Temporal's time-skipping server is simulated time, not a call of either.

(b) A comparison ``<`` or ``<=`` (``>``/``>=`` mirrored) whose smaller side is a measured duration
is refused, whatever the other side. A measured duration is

- a subtraction one of whose operands reads a clock: a call of ``time.time/monotonic/perf_counter``
  (or their ``_ns``), or of ``<...loop>.time()``, or a name the module assigns such a reading
  (``started = time.monotonic()``; not ``deadline = time.monotonic() + 5``, a poll's deadline);
- a name the module assigns such a subtraction (``took = time.perf_counter() - started``);
- any name, attribute or ``["key"]`` called ``elapsed``, ``took`` or ``duration`` (or ending in
  ``_elapsed``, ``_took``, ``_duration``), wherever its value comes from.

A lower bound (``waited >= grace``: the job had to wait the grace) stays allowed: load only makes
it truer.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent

# Polling helpers: (path under the repository, function name) -> the condition checked each round.
POLLING_HELPERS: dict[tuple[str, str], str] = {
    ("tests/stack.py", "wait_until"): "its predicate",
    ("tests/controller/controller_harness.py", "poll"): "its until(value)",
    ("tests/controller/controller_harness.py", "wait_ready"): "the controller's /v1/health",
    ("tests/placement/placement_harness.py", "eventually"): "its until(value)",
    ("tests/preemption/feedcheck.py", "until"): "its condition",
    ("tests/workflows/job_doubles.py", "wait_for"): "the status query's predicate",
    ("tests/workflows/job_doubles.py", "listed"): "a visibility query finding the workflow",
    ("tests/e2e/test_metrics.py", "eventually"): "its check",
    ("tests/e2e/test_exactly_once.py", "until"): "the job's status predicate",
    ("tests/e2e/test_exactly_once.py", "eventually"): "its check",
    ("tests/workflows/test_job_history.py", "until"): "its predicate",
    ("tests/store/test_store_races.py", "_until"): "its check",
    ("tests/benchmarks/test_interrupted.py", "wait_for"): "its check",
    ("tests/ray/test_ray_logs.py", "wait_for"): "the file's existence",
    ("tests/e2e/test_reason_codes.py", "listed"): "a visibility query finding the job",
    ("tests/e2e/test_reason_codes.py", "shows"): "the job's reason code",
    ("tests/served.py", "served"): "the server's started flag",
    ("tests/faultproxy.py", "start"): "the proxy's started flag",
    ("tests/hostile/hostile_peer.py", "start"): "the peer's started flag",
}

MARK = re.compile(r"#\s*not a wait:\s*\S")
SLEEP_MODULES = {"asyncio", "time"}
CLOCKS = {"time", "monotonic", "perf_counter", "monotonic_ns", "perf_counter_ns"}
DURATION_WORDS = ("elapsed", "took", "duration")


@dataclass(frozen=True)
class Finding:
    path: str
    line: int
    what: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.what}"


def _marked_lines(source: str) -> set[int]:
    """Lines carrying a ``# not a wait: <reason>`` comment (real comments only, via tokenize)."""
    lines: set[int] = set()
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT and MARK.search(tok.string):
            lines.add(tok.start[0])
    return lines


def _sleep_names(tree: ast.Module) -> tuple[set[str], set[str]]:
    """Names bound to the asyncio/time modules, and names bound to their ``sleep`` functions."""
    modules: set[str] = set()
    sleeps: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in SLEEP_MODULES:
                    modules.add(alias.asname or alias.name)
        elif isinstance(node, ast.ImportFrom) and node.module in SLEEP_MODULES and node.level == 0:
            for alias in node.names:
                if alias.name == "sleep":
                    sleeps.add(alias.asname or alias.name)
    return modules, sleeps


def _is_sleep(call: ast.Call, modules: set[str], sleeps: set[str]) -> bool:
    func = call.func
    if isinstance(func, ast.Attribute) and func.attr == "sleep":
        return isinstance(func.value, ast.Name) and func.value.id in modules
    return isinstance(func, ast.Name) and func.id in sleeps


def _is_clock(node: ast.AST, modules: set[str]) -> bool:
    """``time.monotonic()`` and its kin, or ``loop.time()`` / ``asyncio.get_running_loop().time()``."""
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
        return False
    owner, attr = node.func.value, node.func.attr
    if isinstance(owner, ast.Name) and owner.id in modules and owner.id != "asyncio":
        return attr in CLOCKS
    if attr != "time":
        return False
    if isinstance(owner, ast.Name):
        return owner.id.endswith("loop")
    return (
        isinstance(owner, ast.Call)
        and isinstance(owner.func, ast.Attribute)
        and owner.func.attr in {"get_running_loop", "get_event_loop"}
    )


def _reads_clock(node: ast.AST, modules: set[str], readings: set[str]) -> bool:
    """``node`` reads a clock: a clock call in it, or a name assigned one (``started``)."""
    return any(
        _is_clock(n, modules) or (isinstance(n, ast.Name) and n.id in readings) for n in ast.walk(node)
    )


def _is_measurement(node: ast.AST, modules: set[str], readings: set[str]) -> bool:
    return (
        isinstance(node, ast.BinOp)
        and isinstance(node.op, ast.Sub)
        and (_reads_clock(node.left, modules, readings) or _reads_clock(node.right, modules, readings))
    )


def _offset(node: ast.expr) -> bool:
    """``<clock> + x`` or ``<clock> - x`` at the top: a deadline or a point in time, not a reading."""
    return isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add | ast.Sub)


def _duration_word(name: str) -> bool:
    return name in DURATION_WORDS or any(name.endswith("_" + w) for w in DURATION_WORDS)


def _assigned(tree: ast.Module, value: Callable[[ast.expr], bool]) -> set[str]:
    """Names assigned (anywhere in the module) an expression ``value`` holds for."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign | ast.AnnAssign) and node.value is not None and value(node.value):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {t.id for t in targets if isinstance(t, ast.Name)}
    return names


def _is_duration(node: ast.AST, modules: set[str], readings: set[str], measured: set[str]) -> bool:
    if _is_measurement(node, modules, readings):
        return True
    if isinstance(node, ast.Name):
        return node.id in measured or _duration_word(node.id)
    if isinstance(node, ast.Attribute):
        return _duration_word(node.attr)
    if isinstance(node, ast.Subscript):
        key = node.slice
        return isinstance(key, ast.Constant) and isinstance(key.value, str) and _duration_word(key.value)
    return False


class _Checker(ast.NodeVisitor):
    def __init__(self, path: str, source: str) -> None:
        self.path = path
        self.tree = ast.parse(source)
        self.marked = _marked_lines(source)
        self.modules, self.sleeps = _sleep_names(self.tree)
        # A reading is a plain clock value (``started = time.monotonic()``), not a deadline computed
        # from one (``deadline = time.monotonic() + 5``: ``time.monotonic() < deadline`` is a poll's).
        self.readings = _assigned(
            self.tree, lambda v: _reads_clock(v, self.modules, set()) and not _offset(v)
        )
        self.measured = _assigned(self.tree, lambda v: _is_measurement(v, self.modules, self.readings))
        self.functions: list[str] = []
        self.findings: list[Finding] = []

    def run(self) -> list[Finding]:
        self.visit(self.tree)
        return self.findings

    def _function(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        self.functions.append(node.name)
        self.generic_visit(node)
        self.functions.pop()

    visit_FunctionDef = _function
    visit_AsyncFunctionDef = _function

    def visit_Call(self, node: ast.Call) -> None:
        if _is_sleep(node, self.modules, self.sleeps):
            helper = bool(self.functions) and (self.path, self.functions[-1]) in POLLING_HELPERS
            lines = range(node.lineno, (node.end_lineno or node.lineno) + 1)
            if not helper and not self.marked.intersection(lines):
                where = f" in {self.functions[-1]}()" if self.functions else ""
                self.findings.append(
                    Finding(self.path, node.lineno, f"{ast.unparse(node)}{where}: a sleep as a wait")
                )
        self.generic_visit(node)

    def visit_Compare(self, node: ast.Compare) -> None:
        sides = [node.left, *node.comparators]
        for op, left, right in zip(node.ops, sides, sides[1:], strict=False):
            if isinstance(op, ast.Lt | ast.LtE):
                smaller = left
            elif isinstance(op, ast.Gt | ast.GtE):
                smaller = right
            else:
                continue
            if _is_duration(smaller, self.modules, self.readings, self.measured):
                self.findings.append(
                    Finding(self.path, node.lineno, f"{ast.unparse(node)}: a wall-clock upper bound")
                )
        self.generic_visit(node)


def check_source(path: str, source: str) -> list[Finding]:
    """The findings of both rules in one file (``path`` relative to the repository)."""
    return _Checker(path, source).run()


def check_suite() -> list[Finding]:
    findings: list[Finding] = []
    for file in sorted(TESTS.rglob("*.py")):
        findings += check_source(file.relative_to(ROOT).as_posix(), file.read_text())
    return findings


def test_no_sleep_waits_and_no_wall_clock_upper_bounds_in_the_suite() -> None:
    findings = check_suite()
    assert not findings, (
        "wait on the condition itself (tests/stack.py wait_until), or mark a sleep that waits for no "
        "state with '# not a wait: <reason>'; keep timings for benchmarks/:\n"
        + "\n".join(str(f) for f in findings)
    )


def test_each_polling_helper_exists_and_sleeps() -> None:
    """The allow-list names real helpers that poll: a renamed or rewritten one leaves no stale entry."""
    for path, name in POLLING_HELPERS:
        tree = ast.parse((ROOT / path).read_text())
        modules, sleeps = _sleep_names(tree)
        found = [
            n
            for n in ast.walk(tree)
            if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef) and n.name == name
        ]
        assert found, f"{path} defines no {name}()"
        calls = [c for f in found for c in ast.walk(f) if isinstance(c, ast.Call)]
        assert any(_is_sleep(c, modules, sleeps) for c in calls), f"{path}: {name}() sleeps no more"


# ---- the rules themselves, on small sources ---------------------------------------------------------


def _found(source: str, path: str = "tests/x/test_example.py") -> list[str]:
    return [f.what for f in check_source(path, source)]


def test_a_sleep_then_an_assert_is_found() -> None:
    source = (
        "import asyncio\n"
        "async def test_x(c):\n"
        "    await c.start()\n"
        "    await asyncio.sleep(1)\n"
        "    assert c.done\n"
    )
    assert _found(source) == ["asyncio.sleep(1) in test_x(): a sleep as a wait"]


def test_every_spelling_of_sleep_is_found() -> None:
    source = (
        "import time as clock\n"
        "from asyncio import sleep\n"
        "from time import sleep as nap\n"
        "def f():\n"
        "    clock.sleep(0.1)\n"
        "    nap(1)\n"
        "async def g():\n"
        "    await sleep(2)\n"
    )
    assert len(_found(source)) == 3


def test_a_marked_sleep_a_polling_helper_and_a_sleep_in_a_string_pass() -> None:
    source = (
        "import asyncio, time\n"
        "async def test_x(fault):\n"
        "    await asyncio.sleep(fault.delay_s)  # not a wait: the injected delay\n"
        "    cmd = ['python', '-c', 'import time; time.sleep(60)']\n"
        "async def wait_until(p):\n"
        "    while not await p():\n"
        "        await asyncio.sleep(0.1)\n"
        "async def test_y(env):\n"
        "    await env.sleep(3600)\n"
    )
    assert _found(source, "tests/stack.py") == []
    # The same helper elsewhere is not on the allow-list; a marker needs a reason.
    assert _found(source) == ["asyncio.sleep(0.1) in wait_until(): a sleep as a wait"]
    assert _found("import time\ntime.sleep(1)  # not a wait:\n") == ["time.sleep(1): a sleep as a wait"]
    # The marker in a string on the line is no comment.
    assert _found("import time\ntime.sleep(1); s = '# not a wait: x'\n") != []


def test_measured_durations_compared_from_above_are_found() -> None:
    source = (
        "import asyncio, time\n"
        "def test_x(result, run):\n"
        "    started = time.monotonic()\n"
        "    assert time.monotonic() - started < 5\n"
        "    took = time.perf_counter() - started\n"
        "    assert took <= 0.01\n"
        "    assert 30 > time.time() - started\n"
        "    assert result['took'] < 0.01\n"
        "    assert run.elapsed_duration < 2 * run.budget\n"
        "    loop = asyncio.get_running_loop()\n"
        "    assert loop.time() - started < 3\n"
        "    submitted = time.time()\n"
        "    waited = run.started_ms / 1000 - submitted\n"
        "    assert waited <= 2 * run.tick_s + 5.0\n"
    )
    assert len(_found(source)) == 7


def test_lower_bounds_and_other_comparisons_pass() -> None:
    source = (
        "import time\n"
        "def test_x(faults, options, rss):\n"
        "    started = time.monotonic()\n"
        "    waited = time.monotonic() - started\n"
        "    assert waited >= 2.0 and 1.9 <= waited\n"
        "    assert faults.partition_s < options.peer_lost_after_s\n"
        "    assert rss.growth_mib < 64\n"
        "    deadline = time.monotonic() + 5\n"
        "    assert time.monotonic() < deadline\n"
    )
    assert _found(source) == []
