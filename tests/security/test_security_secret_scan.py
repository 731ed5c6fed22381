"""No credential crosses clusters or leaks (docs/DESIGN.md, "Where secrets live",
"6. No credential crosses clusters; no unauthenticated or disallowed handoff is admitted").

What a job could steal and what users get back: one job per cluster prints its whole environment,
and the CLI's answers about those jobs, the job list and the peers are searched for every private
key in use and every object-store credential of the stack (tests/secret_scan.py). The rest of the
scan, every workflow history, every file the session wrote and every response the security tests
collected, runs at each stack's teardown, after every test that used it (tests/conftest.py): so it
sees everything, whichever test process ran which test.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from secret_scan import Scan, report, secrets_in_use
from stack import Stack

from iris import devstack
from iris.jobs import JobState


async def env_dump_jobs(stack: Stack) -> list[str]:
    """One job per cluster that prints its whole environment: what a job could steal."""
    dump = ["sh", "-c", "env; echo ---; cat /proc/self/environ | tr '\\0' '\\n'"]
    ids = [
        await stack.iris.submit(dump, name=f"secret-scan-env-{cluster}", target_cluster=cluster)
        for cluster in stack.config.cluster_names
    ]
    for job_id in ids:
        assert (await stack.iris.wait(job_id, timeout_s=90)).state is JobState.SUCCEEDED
    return ids


async def test_no_private_key_or_object_store_secret_reaches_a_job_or_a_cli_answer(
    stack: Stack, tmp_path_factory: pytest.TempPathFactory
) -> None:
    roots: list[Path] = [tmp_path_factory.getbasetemp()]
    needles = secrets_in_use(stack.config, roots)
    assert any("PEM body" in k for k in needles) and any("$" in k for k in needles), needles.keys()
    scan = Scan(needles)

    # What a job sees of its cluster's environment, and what users get back from the CLI.
    jobs = await env_dump_jobs(stack)
    secret_names = [
        *(name for creds in devstack.all_store_credentials(stack.config).values() for name in creds),
        "IRIS_KEY_DIR",
    ]
    for job_id in jobs:
        logs = await stack.cli("job", "logs", job_id)
        assert logs.code == 0 and "IRIS_JOB_ID=" in logs.stdout, logs.stderr
        leaked = [name for name in secret_names if f"{name}=" in logs.stdout]
        assert not leaked, f"{job_id} saw the controller's credentials: {leaked}"
        for args in (
            ("job", "logs", job_id),
            ("job", "describe", job_id),
            ("job", "describe", "--json", job_id),
        ):
            res = await stack.cli(*args)
            scan.search("response", " ".join(args), (res.stdout + res.stderr).encode())
    listings: list[tuple[str, ...]] = [
        ("job", "list", "--json"),
        ("peers",),
        ("rpc", "controller", "list-peers"),
    ]
    for listing in listings:
        res = await stack.cli(*listing)
        assert res.code == 0, res.stderr
        scan.search("response", " ".join(listing), (res.stdout + res.stderr).encode())

    print("\n" + report(scan))
    assert scan.items.get("response", 0) > 0
    assert scan.hits == [], "\n".join(scan.hits[:50])
