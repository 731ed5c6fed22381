"""Session fixtures: the real stack, started once per test process (see tests/stack.py).

``stack`` is the stack whose GPU peers run their jobs as processes (``config/clusters.toml``); every
test module uses it. ``ray_stack`` is the same federation with those peers' backends on the test
process's one real Ray head (``ray_head``, tests/rayhead.py, ``config/clusters-ray.toml``); it starts
only when a test asks for it. A module whose scheduling tests must pass whichever backend a peer
uses (issue 6) overrides ``stack`` with ``stack_per_backend``: each of its tests then runs as
``test_x[process]`` and ``test_x[ray]``. Both stacks share one key directory: the worker's
activities find it through ``$IRIS_KEY_DIR``, one value per test process.

The suite runs in parallel (pytest-xdist, ``-n`` in pyproject.toml): each test process has its own
stacks, on free ports and in its own data directories. ``pytest_collection_modifyitems`` sends a
module's tests to one process (module fixtures start once), and every test that uses Ray to the same
one (one Ray head). Each stack checks at its teardown what it produced: no process took another
cluster's secret (tests/isolation.py) and no secret is in its histories or the session's files
(tests/security/secret_scan.py).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import budget
import pytest
from _pytest.nodeid import NodeId
from isolation import isolation_violations
from rayhead import HEAD_CPUS, local_head, session_resources
from secret_scan import report, scan_session_files, scan_stack
from stack import CONFIGS, Backend, Stack, StackRunner

from iris import devstack
from iris.config import load_config

pytest_plugins = ["graceful"]


def pytest_configure(config: pytest.Config) -> None:
    # Randomized tests run everything they state in `uv run pytest`, a quarter of it in the fast
    # loop (tests/budget.py), which then stays under a minute on two cores.
    if config.getoption("markexpr") == "not e2e":
        budget.FAST = True


# The `e2e` marker: the tests that need real services. `uv run pytest -m "not e2e"` is the fast,
# service-free subset (unit, property and workflow tests: tests/workflows runs JobWorkflow on
# Temporal's own test servers), `-m e2e` the rest; plain `uv run pytest` runs both. A test is e2e if
# - it uses (directly or through another fixture, e.g. `keys`, `restricted`, `duplicate`) a fixture
#   that starts real services: E2E_FIXTURES;
# - it is a store test on PostgreSQL (`stores[postgresql]`): it needs that server;
# - it lives in a directory of E2E_DIRS, whose tests start services in their own body or module
#   fixtures (`iris dev`, controller processes, the chaos stack) rather than through those fixtures.
E2E_FIXTURES = frozenset(
    {
        "stack",  # the whole federation: Temporal, emulators, controllers, a worker
        "process_stack",
        "ray_stack",  # the same, its GPU peers on a real Ray head
        "stack_per_backend",
        "open_controller",  # a controller process
        "ray_head",  # a local Ray head
        "ray_proxies",
        "postgres_admin",  # a PostgreSQL server
    }
)
E2E_DIRS = frozenset({"e2e", "controller", "chaos"})
TESTS_DIR = Path(__file__).resolve().parent


def needs_services(item: pytest.Item) -> bool:
    if E2E_FIXTURES.intersection(getattr(item, "fixturenames", ())):
        return True
    callspec = getattr(item, "callspec", None)
    if callspec is not None and callspec.params.get("stores") == "postgresql":
        return True
    path = item.path.resolve()
    if not path.is_relative_to(TESTS_DIR):
        return False
    relative = path.relative_to(TESTS_DIR)
    return len(relative.parts) > 1 and relative.parts[0] in E2E_DIRS


# Fixtures that reach the test process's Ray head.
RAY_FIXTURES = frozenset({"ray_head", "ray_stack", "ray_proxies"})
# The xdist group of every test that uses Ray: one test process runs them all, on one head.
RAY_GROUP = "ray"


def uses_ray(item: pytest.Item) -> bool:
    if RAY_FIXTURES.intersection(getattr(item, "fixturenames", ())):
        return True
    callspec = getattr(item, "callspec", None)
    return callspec is not None and callspec.params.get("stack_per_backend") == "ray"


def xdist_group(item: pytest.Item) -> str:
    """The test process a test runs in, by name (``--dist loadgroup``): every Ray user in one, a
    test's own ``xdist_group`` mark if it has one, else its module's (its module fixtures start
    once, its tests keep their order)."""
    if uses_ray(item):
        return RAY_GROUP
    own = item.get_closest_marker("xdist_group")
    if own is not None:
        return str(own.args[0] if own.args else own.kwargs.get("name", "default"))
    return item.nodeid.split("::", 1)[0]


# What each test took in a recent full run, where it took a second or more (scripts/test_durations.py
# writes it from a run's JUnit XML); other tests cost SHORT_S, or, without the file, an estimate: one
# that needs services waits on them.
DURATIONS = TESTS_DIR / "durations.json"
E2E_COST_S, FAST_COST_S, SHORT_S = 8.0, 0.3, 0.5


def recorded_durations() -> dict[str, float]:
    try:
        found = json.loads(DURATIONS.read_text())
    except (OSError, ValueError):
        return {}
    return {str(k): float(v) for k, v in found.items()} if isinstance(found, dict) else {}


def cost_of(item: pytest.Item, recorded: dict[str, float]) -> float:
    if recorded:
        return recorded.get(item.nodeid, SHORT_S)
    return E2E_COST_S if item.get_closest_marker("e2e") is not None else FAST_COST_S


def longest_first(items: list[pytest.Item], groups: dict[int, str]) -> list[pytest.Item]:
    """``items`` with whole groups (``groups``: by ``id(item)``) ordered by their cost, the costliest
    first (each group's tests keep their order): the test processes take groups in this order
    (``--no-loadscope-reorder``), so the long ones start early and none is left alone at the end."""
    recorded = recorded_durations()
    cost: dict[str, float] = {}
    for item in items:
        each = cost_of(item, recorded)
        cost[groups[id(item)]] = cost.get(groups[id(item)], 0.0) + each
    rank = {g: i for i, g in enumerate(sorted(cost, key=lambda g: -cost[g]))}
    return sorted(items, key=lambda item: rank[groups[id(item)]])


def in_group(item: pytest.Item, group: str) -> None:
    """Give a test process's test the id ``<id>@<group>``, by which ``--dist loadgroup`` groups.

    pytest-xdist 3.8 writes that suffix to ``item._nodeid``, which pytest 9.2 no longer reads (its
    ids are structured: pytest-xdist issue 1386); the grouping then silently does nothing. Until
    xdist sets it, this sets the structured id as its pending fix does. tests/test_parallel.py
    checks that a module's tests run in one process."""
    if os.environ.get("PYTEST_XDIST_WORKER") is None or "@" in item.nodeid:
        return
    if isinstance(getattr(item, "_id", None), NodeId):
        item._id = NodeId.parse(f"{item.nodeid}@{group}")


# A wrapper, so that it runs before every other plugin's hook: pytest-xdist's reads the xdist_group
# marks in each test process.
@pytest.hookimpl(wrapper=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> Iterator[None]:
    groups: dict[int, str] = {}
    for item in items:
        if needs_services(item):
            item.add_marker(pytest.mark.e2e)
        groups[id(item)] = xdist_group(item)
        item.add_marker(pytest.mark.xdist_group(groups[id(item)]))
        # Service-free but minutes long (months of simulated history): the full suite runs them.
        if budget.FAST and item.get_closest_marker("long") is not None:
            item.add_marker(pytest.mark.skip(reason="long: runs in the full suite (uv run pytest)"))
    items[:] = longest_first(items, groups)
    for item in items:
        in_group(item, groups[id(item)])
    return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    """After the last Ray user of this test process (they run together: the ``ray`` group), its Ray
    head stops, and with it the Ray stack (pytest finishes a fixture's dependents first), with that
    stack's teardown checks: they would otherwise idle beside the rest of the suite."""
    result = yield
    if nextitem is not None and uses_ray(item) and not uses_ray(nextitem):
        for fixturedef in item.session._fixturemanager.getfixturedefs("ray_head", item) or ():
            if fixturedef.cached_result is not None:
                fixturedef.finish(item._request)  # type: ignore[attr-defined]
    return result


# A skip that says only that something is missing (PostgreSQL, chromium, Prometheus, root) would
# hide coverage. Under CI (``CI=true``, set by .ci/run) it fails instead, saying why in one line; the
# only skips CI accepts are the opt-in ones (their reason starts with "opt-in").
def ci_forbids_skips() -> bool:
    return os.environ.get("CI", "").lower() in ("1", "true", "yes")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> pytest.TestReport:
    report: pytest.TestReport = yield
    if report.skipped and ci_forbids_skips() and not hasattr(report, "wasxfail"):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        reason = reason.removeprefix("Skipped: ")
        if not reason.startswith("opt-in"):
            report.outcome = "failed"
            report.longrepr = f"skipped under CI=true, which runs every test: {reason}"
    return report


@pytest.fixture(scope="session")
def stack_keys(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("keys")


@pytest.fixture(autouse=True)
def no_payload_ring_left_behind() -> Iterator[None]:
    """The suite's stacks keep their histories in plain text: no payload key ring. A ring in the
    test process's user key directory (``$IRIS_USER_KEY_DIR``: set by the first stack, inherited
    by every subprocess) makes every later client of this process encrypt what its stacks' workers
    cannot read. A test that leaves one there (an `iris dev` run without a user key directory of
    its own) fails, and the ring is removed so the tests after it are not blamed."""
    yield
    from iris.payloadcodec import KEYRING_NAME
    from iris.userauth import USER_KEY_DIR_ENV

    shared = os.environ.get(USER_KEY_DIR_ENV)
    ring = Path(shared) / KEYRING_NAME if shared else None
    if ring is not None and ring.exists():
        ring.unlink()
        pytest.fail(f"this test left a payload key ring in the suite's user key directory: {ring}")


def teardown_log(factory: pytest.TempPathFactory, what: str, started: float) -> None:
    """How long a part of the session's teardown took, appended to ``teardown.log`` beside the test
    processes' temporary directories (pytest-of-USER/pytest-N/): the teardown runs after the last
    test, charged to it, and its output is captured (issue 25 looks at where that time goes)."""
    took = time.monotonic() - started
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    with (factory.getbasetemp().parent / "teardown.log").open("a") as log:
        log.write(f"{worker} {what} {took:.1f}s\n")


@pytest.fixture(scope="session", autouse=True)
def session_files(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """After every test and stack of this test process: no private key in use and no store
    credential of the federation's clusters is in any file the session wrote (stack logs,
    controller state, relayed job logs, every test's temporary directory; tests/secret_scan.py).
    The stacks depend on it, so it runs after their teardown."""
    yield
    started = time.monotonic()
    scan = scan_session_files(load_config(CONFIGS["process"]), [tmp_path_factory.getbasetemp()])
    teardown_log(tmp_path_factory, f"session files scan ({scan.items.get('file', 0)} files)", started)
    print("\n" + report(scan))
    assert scan.hits == [], "\n".join(scan.hits[:50])


# A stack start that fails is retried on fresh ports this often: with several test processes, a port
# found free can be taken by another before the service binds it.
STACK_START_TRIES = 3


async def running_stack(
    factory: pytest.TempPathFactory,
    backend: Backend,
    key_dir: Path,
    ray_head: devstack.RayHeadSpec | None = None,
) -> AsyncIterator[Stack]:
    for attempt in range(1, STACK_START_TRIES + 1):
        runner = StackRunner(factory.mktemp(f"stack-{backend}"), backend, key_dir=key_dir, ray_head=ray_head)
        try:
            stack = await runner.start()
            break
        except (devstack.ServiceError, OSError, RuntimeError) as exc:
            await runner.stop()
            if attempt == STACK_START_TRIES:
                raise
            print(f"\nstack start {attempt} failed, retrying on fresh ports: {exc}")
    try:
        yield stack
        # After every test that used it: no process took another cluster's secret (acceptance 3 of
        # issue 16, tests/e2e/test_credential_isolation.py checks it mid-suite too), and no secret
        # is in its histories or in what its tests received.
        started = time.monotonic()
        assert isolation_violations(stack) == []
        teardown_log(factory, f"{backend} stack isolation check", started)
        started = time.monotonic()
        scan = await scan_stack(stack, [factory.getbasetemp()])
        teardown_log(factory, f"{backend} stack scan ({scan.items.get('history', 0)} histories)", started)
        print(f"\n{backend} stack: " + report(scan))
        assert scan.items.get("history", 0) > 0
        assert scan.hits == [], "\n".join(scan.hits[:50])
    finally:
        started = time.monotonic()
        await runner.stop()
        teardown_log(factory, f"{backend} stack stop", started)


@pytest.fixture(scope="session")
def ray_head(tmp_path_factory: pytest.TempPathFactory) -> Iterator[devstack.RayHeadSpec]:
    """The test process's one real Ray head, for every Ray user (tests/rayhead.py)."""
    with local_head(session_resources(), HEAD_CPUS, tmp_path_factory.mktemp("ray")) as spec:
        yield spec
        started = time.monotonic()
    teardown_log(tmp_path_factory, "ray head stop", started)


@pytest.fixture(scope="session")
async def process_stack(
    tmp_path_factory: pytest.TempPathFactory, stack_keys: Path, session_files: None
) -> AsyncIterator[Stack]:
    async for s in running_stack(tmp_path_factory, "process", stack_keys):
        yield s


@pytest.fixture(scope="session")
async def ray_stack(
    tmp_path_factory: pytest.TempPathFactory,
    stack_keys: Path,
    session_files: None,
    ray_head: devstack.RayHeadSpec,
) -> AsyncIterator[Stack]:
    async for s in running_stack(tmp_path_factory, "ray", stack_keys, ray_head):
        yield s


@pytest.fixture(scope="session")
def stack(process_stack: Stack) -> Stack:
    return process_stack


@pytest.fixture(scope="module", params=["process", "ray"])
def stack_per_backend(request: pytest.FixtureRequest) -> Stack:
    """Each backend's session stack in turn. Module-scoped, so a module's tests run in order on one
    backend, then on the other; sync, because getfixturevalue cannot run while the event loop does
    (async fixtures run inside it)."""
    backend_stack: Stack = request.getfixturevalue(f"{request.param}_stack")
    return backend_stack
