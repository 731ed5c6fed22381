"""The suite's parallel run (tests/conftest.py): under ``-n 2 --dist loadgroup`` every test of a module
runs in one test process, so its module fixtures start once and its tests keep their order. With
pytest 9.2 and pytest-xdist 3.8 the xdist_group marks alone silently group nothing (pytest-xdist
issue 1386); this fails if the grouping stops working again."""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
from collections import defaultdict

from stack import PROJECT_ROOT

MODULES = ("tests/policy/test_policy_routing.py", "tests/policy/test_policy_reasons.py")


async def test_each_modules_tests_run_in_one_test_process() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    run = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-m", "pytest", "-v", "-n", "2", "-p", "no:cacheprovider", *MODULES],
        cwd=PROJECT_ROOT, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:]
    workers: dict[str, set[str]] = defaultdict(set)
    for line in run.stdout.splitlines():
        found = re.match(r"\[(gw\d+)\] \[\s*\d+%\] PASSED (\S+?)::", line)
        if found:
            workers[found.group(2)].add(found.group(1))
    assert set(workers) == set(MODULES), run.stdout[-3000:]
    assert all(len(w) == 1 for w in workers.values()), dict(workers)
