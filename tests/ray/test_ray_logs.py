"""A Ray job's log is copied by byte range, never re-read whole (issue 17, "Logs incrementally").

The pure tests check ``JobOutput``, ``job_output`` applied piece by piece: whatever the pieces, the
copy is the same as from the whole log. The Ray test runs a real controller executor (in this
process, so its Ray backend's read counters can be read) on the session's Ray head, with a job that
writes its log in steps, and reads the log as a reader would after each step.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import requests
from controller_harness import cluster, federation, poll, py, request
from hypothesis import given, settings
from hypothesis import strategies as st
from ray.job_submission import JobSubmissionClient
from ray_harness import ray_backend

from iris import devstack
from iris.config import FederationConfig
from iris.controller.executors.core import Executor
from iris.controller.executors.ray_jobs import (
    LOG_CHUNK,
    JobOutput,
    RayBackend,
    job_output,
    submission_id,
)
from iris.controller.models import ControllerJobState as S
from iris.controller.state import StateStore

SID = "alice~_logs"
COMMAND = "python -c 'print(1)\nprint(2)'"  # a command spanning lines: Ray's banner does too
RECORD = b"2026-11-30 16:41:35,104\tINFO job_manager.py:581 -- Runtime env is setting up.\n"
WARNING = b"2026-11-30 16:41:35,104\tWARNING job_manager.py:618 -- Failed to start supervisor actor\n"
BANNER = f"Running entrypoint for job {SID}: {COMMAND}\n".encode()


def whole(raw: bytes) -> bytes:
    """The job's output from the whole log, as the Jobs API's text reads it (universal newlines)."""
    return job_output(raw.replace(b"\r\n", b"\n").replace(b"\r", b"\n"), SID, COMMAND)


def fed(raw: bytes, cuts: list[int]) -> list[bytes]:
    """What JobOutput gives out for ``raw`` fed in pieces cut at ``cuts``, the last one final."""
    out = JobOutput(SID, COMMAND)
    bounds = [0, *sorted(set(cuts)), len(raw)]
    pieces = [out.feed(raw[a:b]) for a, b in itertools.pairwise(bounds)]
    return [*pieces, out.feed(b"", final=True)]


def check(raw: bytes, cuts: list[int]) -> None:
    pieces = fed(raw, cuts)
    assert b"".join(pieces) == whole(raw), (raw, cuts, pieces)
    # While the log grows, only whole lines are given out.
    assert all(p.endswith(b"\n") for p in pieces[:-1] if p), pieces


def every_cut(raw: bytes) -> None:
    for i in range(len(raw) + 1):
        check(raw, [i])
    for i, j in itertools.combinations(range(0, len(raw) + 1, 3), 2):
        check(raw, [i, j])


def test_rays_lines_are_left_out_however_the_log_is_split() -> None:
    every_cut(RECORD + RECORD + b"first\n" + BANNER + b"second\n")
    every_cut(RECORD + BANNER + b"first\n")
    # Ray's banner ends a partial line of the job's; the job's bytes join up again.
    every_cut(RECORD + b"par" + BANNER + b"tial\n")
    # A line of the job's that looks like the start of the banner, and a partial one at the end.
    every_cut(RECORD + b"Running entrypoint for job x\n" + BANNER + b"Running entry")
    # What says why Ray could not start the job stays.
    every_cut(RECORD + WARNING)


def test_newlines_and_characters_split_between_reads() -> None:
    # \r\n and a lone \r are line ends, as in the Jobs API's text; one split between two reads
    # stays one line end.
    every_cut(RECORD + BANNER + b"a\r\nprogress 1\rprogress 2\r\r\nend\r")
    # A character split between two reads is never given out in halves.
    raw = RECORD + BANNER + "é€𝄞\n".encode() * 2
    for i in range(len(raw) + 1):
        pieces = fed(raw, [i])
        for p in pieces:
            p.decode()
        assert b"".join(pieces) == whole(raw)


@settings(max_examples=300, deadline=None)
@given(
    lines=st.lists(
        st.sampled_from(
            [
                RECORD,
                WARNING,
                BANNER,
                b"job\n",
                b"job\r\n",
                b"job\r",
                b"\r",
                b"\n",
                b"Run",
                b"x",
                "é\n".encode(),
            ]
        ),
        max_size=12,
    ),
    cuts=st.lists(st.integers(min_value=0, max_value=400), max_size=6),
)
def test_any_log_split_anyhow_gives_the_whole_logs_output(lines: list[bytes], cuts: list[int]) -> None:
    raw = b"".join(lines)
    check(raw, [c for c in cuts if c <= len(raw)])


# ---- on a real Ray head ------------------------------------------------------------------------

# The job's output, written in steps: after each, the job waits for the test to let it go on.
STEPS = [
    b"alpha\n" + "\u00e9".encode() * 500 + b"\n",
    b"beta\r\nprogress 1\rprogress 2\r" + b"x" * 3000 + b"\ncrlf across two reads\r",
    b"\n" + b"gamma\n" * 100,
    b"last line, no newline",
]
# What the controller's copy holds after each step (a partial line, or a lone \r that may be
# the first half of \r\n, waits for its end).
COPIES = [
    "alpha\n" + "\u00e9" * 500 + "\n",
    "beta\nprogress 1\nprogress 2\n" + "x" * 3000 + "\n",
    "crlf across two reads\n" + "gamma\n" * 100,
    "last line, no newline",
]
JOB = """
import os, sys, time
steps, gate = {steps!r}, {gate!r}
for i, data in enumerate(steps):
    sys.stdout.buffer.write(data)
    sys.stdout.buffer.flush()
    open(os.path.join(gate, f"written-{{i}}"), "w").close()
    while i < len(steps) - 1 and not os.path.exists(os.path.join(gate, f"go-{{i}}")):
        time.sleep(0.05)
"""


@contextlib.asynccontextmanager
async def executor_on(ray_head: devstack.RayHeadSpec, state_dir: Path) -> AsyncIterator[Executor]:
    """A controller's executor with one Ray backend on the session head (the real one, in-process,
    so its backend's counters can be read). Leaving it stops the controller, not its Ray jobs."""
    config = FederationConfig.model_validate(
        federation(cluster("home"), cluster("peer", backends=[ray_backend(ray_head, "jobs", id="ray-logs")]))
    )
    store = StateStore(state_dir)
    ex = Executor(config.cluster("peer"), state_dir, store, kill_grace_s=1.0)
    ex.recover()
    try:
        yield ex
    finally:
        await ex.shutdown()
        store.close()


@pytest.fixture
async def executor(ray_head: devstack.RayHeadSpec, tmp_path: Path) -> AsyncIterator[Executor]:
    async with executor_on(ray_head, tmp_path / "state") as ex:
        yield ex


def ray_backend_of(ex: Executor) -> RayBackend:
    backend = ex.backends["ray-logs"]
    assert isinstance(backend, RayBackend)
    return backend


async def wait_for(path: Path, timeout: float = 60.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not await asyncio.to_thread(path.exists):
        assert loop.time() < deadline, f"{path} not there after {timeout}s"
        await asyncio.sleep(0.05)


async def read_copy(ex: Executor, job_id: str) -> str:
    """What a reader gets: the whole log from offset 0 (refreshing it first, as every read does)."""
    chunk = await ex.read_log(job_id, 0, limit=1 << 30)
    return chunk.data


async def test_a_running_jobs_log_grows_by_what_is_new_only(
    ray_head: devstack.RayHeadSpec, executor: Executor, tmp_path: Path
) -> None:
    gate = tmp_path / "gate"
    gate.mkdir()
    req = request(py(JOB.format(steps=STEPS, gate=str(gate))), job_id="alice/growing", backend_id="ray-logs")
    job, _ = executor.launch(req)
    backend = ray_backend_of(executor)

    fetched: list[int] = []
    copy = ""
    # A reader of a job just started: until the controller has seen the job run, nothing to read.
    await wait_for(gate / "written-0")
    await poll(lambda: read_copy(executor, job.job_id), lambda text: text == COPIES[0], timeout=30)
    await asyncio.sleep(0.6)  # not a wait: real time must pass LOG_REFRESH_S before the next read
    for i in range(len(STEPS) - 1):
        await wait_for(gate / f"written-{i}")
        await asyncio.sleep(0.6)  # not a wait: past the refresh interval (LOG_REFRESH_S), this read refreshes
        before = (backend.log_requests, backend.log_bytes_fetched)
        text = await read_copy(executor, job.job_id)
        requests_made = backend.log_requests - before[0]
        fetched.append(backend.log_bytes_fetched - before[1])
        copy += COPIES[i]
        assert text == copy, f"step {i}"
        assert requests_made == 1, f"step {i}: one ranged read per refresh"
        # A read soon after fetches nothing (the refresh interval), and the copy stays the same.
        assert await read_copy(executor, job.job_id) == copy
        assert backend.log_requests - before[0] == 1
        (gate / f"go-{i}").touch()

    final = await executor.wait_terminal(job.job_id, 60)
    assert final.state is S.SUCCEEDED, final.error
    assert await read_copy(executor, job.job_id) == copy + COPIES[-1]

    # Every refresh after the first fetched exactly what the job wrote since the one before: no
    # byte of Ray's log is fetched twice, and none of it whole (not even at the end).
    sid = submission_id(job.job_id, job.attempts)
    info = await asyncio.to_thread(JobSubmissionClient(ray_head.address).get_job_info, sid)
    log_url = f"{info.driver_agent_http_address}/logs/job-driver-{sid}.log"
    agent_log = (await asyncio.to_thread(requests.get, log_url, timeout=10)).content  # whole, once
    assert agent_log.endswith(b"".join(STEPS))
    print(f"fetched per refresh: {fetched}; in all {backend.log_bytes_fetched} (the log: {len(agent_log)})")
    assert fetched[1:] == [len(s) for s in STEPS[1:-1]], fetched
    assert backend.log_bytes_fetched == len(agent_log)
    assert backend.log_whole_reads == 0
    assert all(f <= LOG_CHUNK for f in fetched)


async def test_a_reattached_jobs_log_is_read_once_from_the_start_and_copied_once(
    ray_head: devstack.RayHeadSpec, tmp_path: Path
) -> None:
    """A restarted controller does not know how far its predecessor read: it reads Ray's log once
    from the start, writes only what its copy lacks, and from then on reads only what is new."""
    gate = tmp_path / "gate"
    gate.mkdir()
    steps = [b"one\n" * 10, b"two\n" * 10, b"three\n"]
    req = request(
        py(JOB.format(steps=steps, gate=str(gate))), job_id="alice/reattached", backend_id="ray-logs"
    )
    async with executor_on(ray_head, tmp_path / "state") as ex:
        job, _ = ex.launch(req)
        await wait_for(gate / "written-0")
        await poll(lambda: read_copy(ex, job.job_id), lambda text: text == "one\n" * 10, timeout=30)
    # The controller is gone; the job goes on in Ray and writes more.
    (gate / "go-0").touch()
    await wait_for(gate / "written-1")
    async with executor_on(ray_head, tmp_path / "state") as ex:
        backend = ray_backend_of(ex)
        expected = "one\n" * 10 + "two\n" * 10
        await poll(lambda: read_copy(ex, job.job_id), lambda text: text == expected, timeout=30)
        resync = backend.log_bytes_fetched
        (gate / "go-1").touch()
        final = await ex.wait_terminal(job.job_id, 60)
        assert final.state is S.SUCCEEDED, final.error
        assert await read_copy(ex, job.job_id) == expected + "three\n"
        # After the one read from the start, only the new bytes.
        assert backend.log_bytes_fetched == resync + len(steps[2])
        assert backend.log_whole_reads == 0
