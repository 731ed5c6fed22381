"""The controller API against a real controller process (no auth configured)."""

from __future__ import annotations

import asyncio
import json
import uuid
from pathlib import Path

import httpx
import pytest
from controller_harness import (
    Controller,
    cluster,
    federation,
    free_port,
    gpu_backend,
    job_pids,
    poll,
    process_alive,
    py,
    read_all_logs,
    request,
    start_controller,
    wait_terminal,
    write_config,
)

from iris.controller.client import ControllerClient
from iris.controller.errors import AlreadyExists, InvalidArgument, NotFound, Unavailable
from iris.controller.models import ControllerJobState as S
from iris.policy.models import Band


async def test_health_and_backends(open_controller: Controller) -> None:
    async with open_controller.client() as c:
        assert (await c.health()).cluster == "peer"
        report = await c.backends()
    assert report.cluster == "peer"
    by_id = {b.backend_id: b for b in report.backends}
    gpu, cpu = by_id["gpu"], by_id["cpu"]
    assert gpu.advertised_attributes["device-variant"] == ["h100"]
    assert gpu.availability is not None and gpu.availability.version == 1
    # Device chips and CPU slots (the ``cpu`` token, one slot per replica), each with its total.
    assert gpu.availability.total_amounts == {"h100": 16, "cpu": 4}
    assert gpu.availability.observation_epoch_ms > 0
    # A backend without devices reports its CPU slots only.
    assert cpu.availability is not None
    assert set(cpu.availability.amounts) == {"cpu"} and cpu.availability.total_amounts == {"cpu": 2}


async def test_observation_changes_only_when_capacity_does(open_controller: Controller) -> None:
    """Reservations are charged per observation: an idle backend must keep its observation."""

    async def gpu_observation(c: ControllerClient) -> int:
        report = next(b for b in (await c.backends()).backends if b.backend_id == "gpu")
        assert report.availability is not None
        return report.availability.observation_epoch_ms

    async with open_controller.client() as c:
        first = await gpu_observation(c)
        assert await gpu_observation(c) == first
        st = await c.launch(request(py("import time; time.sleep(60)"), job_id="obs/a", gpus=2))
        assert st.state is S.RUNNING
        after_start = await gpu_observation(c)
        assert after_start > first
        assert await gpu_observation(c) == after_start
        await c.terminate("obs/a")
        assert await gpu_observation(c) > after_start


async def test_cpu_slots_are_reported_free_promised_and_held_by_band(tmp_path: Path) -> None:
    """CPU slots are a token like chips (issue 15): free minus what PENDING CPU jobs are promised,
    held by band while CPU jobs run, back to the total when they end."""
    peer = cluster("peer", backends=[{"id": "cpu", "attributes": {"device-type": ["cpu"]}, "cpu_slots": 4}])
    cfg = write_config(tmp_path / "c.toml", federation(cluster("home"), peer))
    ctl = start_controller(cfg, "peer", tmp_path / "state", port=peer["port"], kill_grace=1.0)

    async def block(c: ControllerClient) -> tuple[dict[str, int], dict[int, dict[str, int]]]:
        a = (await c.backends()).backends[0].availability
        assert a is not None and a.total_amounts == {"cpu": 4}
        return a.amounts, {int(h.band): h.amounts for h in a.held_by_band}

    sleep = py("import time; time.sleep(60)")
    try:
        async with ctl.client() as c:
            assert await block(c) == ({"cpu": 4}, {})
            batch = await c.launch(
                request(sleep, job_id="cpu/batch", backend_id="cpu", replicas=2, band=Band.BATCH)
            )
            assert batch.state is S.RUNNING
            assert await block(c) == ({"cpu": 2}, {3: {"cpu": 2}})
            # Three replicas do not fit in the two free slots: PENDING, and promised what is free.
            # Batch too: a higher band would preempt the running batch job (docs/DESIGN.md,
            # "Preemption"; tests/preemption covers that).
            waiting = await c.launch(
                request(sleep, job_id="cpu/waiting", backend_id="cpu", replicas=3, band=Band.BATCH)
            )
            assert waiting.state is S.PENDING
            assert await block(c) == ({"cpu": 0}, {3: {"cpu": 2}})
            await c.terminate("cpu/batch")
            await poll(
                lambda: block(c), lambda b: b == ({"cpu": 1}, {3: {"cpu": 3}}), what="the waiting job runs"
            )
            await c.terminate("cpu/waiting")
            await poll(lambda: block(c), lambda b: b == ({"cpu": 4}, {}), what="every slot free again")
    finally:
        ctl.stop()


async def test_success_logs_and_env(open_controller: Controller) -> None:
    code = (
        "import os; print('hello'); "
        "print(os.environ['IRIS_JOB_ID'], os.environ['IRIS_CLUSTER'], "
        "os.environ['IRIS_DEVICE_SLOTS'], os.environ['CUDA_VISIBLE_DEVICES'], os.environ['MY_VAR'])"
    )
    req = request(py(code), job_id="alice/train-llama", gpus=2, env={"MY_VAR": "x1"})
    async with open_controller.client() as c:
        st = await c.launch(req)
        assert st.job_id == "alice/train-llama" and st.attempts == 1
        st = await wait_terminal(c, req.job_id)
        assert st.state is S.SUCCEEDED and st.exit_code == 0
        assert st.started_ms is not None and st.finished_ms is not None and st.finished_ms >= st.started_ms
        assert len(st.tasks) == 1 and len(st.tasks[0].slots) == 2
        text = await read_all_logs(c, req.job_id)
        slots = ",".join(str(s) for s in st.tasks[0].slots)
        assert text.splitlines() == ["hello", f"alice/train-llama peer {slots} {slots} x1"]
        # Reading past the end of a finished job's log is an empty eof chunk.
        end = await c.logs(req.job_id, offset=len(text.encode()))
        assert end.data == "" and end.eof
        # The job is listed, and both sub-resources route for a slashed id.
        assert req.job_id in [j.job_id for j in await c.list_jobs()]
        assert (await c.terminate(req.job_id)).state is S.SUCCEEDED  # terminal: a no-op


async def test_failure_exit_code_and_stderr(open_controller: Controller) -> None:
    req = request(py("import sys; sys.stderr.write('boom\\n'); sys.exit(3)"))
    async with open_controller.client() as c:
        await c.launch(req)
        st = await wait_terminal(c, req.job_id)
        assert st.state is S.FAILED and st.exit_code == 3
        assert "boom" in await read_all_logs(c, req.job_id)


async def test_command_not_found(open_controller: Controller) -> None:
    req = request(["/nonexistent/program-xyz"])
    async with open_controller.client() as c:
        await c.launch(req)
        st = await wait_terminal(c, req.job_id)
    assert st.state is S.FAILED and st.exit_code == 127
    assert st.error is not None and "cannot start" in st.error


async def test_replicas_all_succeed_and_one_fails(open_controller: Controller) -> None:
    ok = request(py("import os; print('r', os.environ['IRIS_REPLICA_INDEX'])"), gpus=1, replicas=3)
    # Replica 1 fails; the others would run for a minute, so the gang must be stopped.
    bad = request(
        py(
            "import os, sys, time; i = int(os.environ['IRIS_REPLICA_INDEX']); "
            "sys.exit(5) if i == 1 else time.sleep(60)"
        ),
        replicas=2,
    )
    async with open_controller.client() as c:
        await c.launch(ok)
        await c.launch(bad)
        st = await wait_terminal(c, ok.job_id)
        assert st.state is S.SUCCEEDED and [t.exit_code for t in st.tasks] == [0, 0, 0]
        slots = [s for t in st.tasks for s in t.slots]
        assert len(slots) == len(set(slots)) == 3
        assert sorted((await read_all_logs(c, ok.job_id)).splitlines()) == ["r 0", "r 1", "r 2"]
        st = await wait_terminal(c, bad.job_id)
        assert st.state is S.FAILED and st.exit_code == 5
        assert st.tasks[1].exit_code == 5


async def test_terminate_running_and_pending(open_controller: Controller) -> None:
    # Ignores SIGTERM: the controller must escalate to SIGKILL after the grace (1 s here).
    stubborn = py(
        "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
        "print('up', flush=True); time.sleep(120)"
    )
    req = request(stubborn)
    async with open_controller.client() as c:
        await c.launch(req)
        await poll(lambda: c.logs(req.job_id), lambda ch: "up" in ch.data, what="job up")
        st = await c.terminate(req.job_id)
        assert st.state is S.KILLED
        assert (await c.terminate(req.job_id)).state is S.KILLED  # idempotent no-op


async def test_timeout(open_controller: Controller) -> None:
    req = request(py("import time; time.sleep(60)"), timeout_s=0.5)
    async with open_controller.client() as c:
        await c.launch(req)
        st = await wait_terminal(c, req.job_id)
    assert st.state is S.FAILED and st.error == "timed out"


async def test_idempotent_relaunch_and_replacement(
    open_controller: Controller, open_shared_dir: Path
) -> None:
    # Each run appends to the marker in the directory the jobs share with the test; the two runs
    # may have two pool uids: the test makes the file, writable by both.
    marker = open_shared_dir / f"runs-{uuid.uuid4().hex}"
    marker.touch()
    marker.chmod(0o666)
    cmd = py(f"open({str(marker)!r}, 'a').write('x'); import time; time.sleep(1.0)")
    req = request(cmd, job_id="bob/idem", nonce="first")
    async with open_controller.client() as c:
        first = await c.launch(req)
        again = await c.launch(req)  # a replayed handoff: same job, never a second run
        assert again.created_ms == first.created_ms and again.attempts == 1
        with pytest.raises(AlreadyExists):
            await c.launch(req.model_copy(update={"requester": "someone-else"}))
        with pytest.raises(AlreadyExists):  # new nonce while the run is live
            await c.launch(req.model_copy(update={"nonce": "second"}))
        st = await wait_terminal(c, req.job_id)
        assert st.state is S.SUCCEEDED
        assert (await c.launch(req)).attempts == 1  # replay after the end: still no second run
        assert marker.read_text() == "x"
        # A new incarnation replaces the finished run.
        second = await c.launch(req.model_copy(update={"nonce": "second"}))
        assert second.attempts == 2 and second.nonce == "second"
        st = await wait_terminal(c, req.job_id)
        assert st.state is S.SUCCEEDED and st.attempts == 2
        assert marker.read_text() == "xx"
        with pytest.raises(AlreadyExists):
            await c.launch(req.model_copy(update={"requester": "someone-else", "nonce": "third"}))


async def test_invalid_launches(open_controller: Controller) -> None:
    async with open_controller.client() as c:
        with pytest.raises(InvalidArgument, match="unknown backend"):
            await c.launch(request(["true"], backend_id="nope"))
        with pytest.raises(InvalidArgument, match="has no"):
            await c.launch(request(["true"], backend_id="cpu", gpus=1))
        with pytest.raises(InvalidArgument, match="16 h100"):
            await c.launch(request(["true"], gpus=9, replicas=2))
        with pytest.raises(InvalidArgument, match="at most 2 CPU"):
            await c.launch(request(["true"], backend_id="cpu", replicas=3))
        with pytest.raises(NotFound):
            await c.status("no/such/job")
        with pytest.raises(NotFound):
            await c.logs("no/such/job")
        with pytest.raises(NotFound):
            await c.terminate("no/such/job")
    # Schema violations are INVALID_ARGUMENT (400) with the stable error body, not FastAPI's 422.
    good = request(["true"]).model_dump(mode="json")
    bad_bodies = [
        {**good, "command": []},
        {**good, "job_id": "../etc"},
        {**good, "job_id": "a//b"},
        {**good, "job_id": "x/logs"},
        {**good, "device": {"count": -1}},
        {**good, "unexpected": 1},
        {k: v for k, v in good.items() if k != "nonce"},
    ]
    async with httpx.AsyncClient(base_url=open_controller.url) as http:
        for body in bad_bodies:
            resp = await http.post("/v1/jobs", json=body)
            assert resp.status_code == 400, body
            assert resp.json()["code"] == "INVALID_ARGUMENT"
        resp = await http.post("/v1/jobs", content=b"{not json", headers={"content-type": "application/json"})
        assert resp.status_code == 400 and resp.json()["code"] == "INVALID_ARGUMENT"
        resp = await http.get("/v1/nowhere")
        assert resp.status_code == 404 and resp.json()["code"] == "NOT_FOUND"
        resp = await http.get("/v1/jobs/x/logs", params={"offset": -1})
        assert resp.status_code == 400
        # No schema unless the cluster sets api_docs (test_controller_hardening.py).
        assert (await http.get("/openapi.json")).status_code == 404


async def test_unavailable_when_nothing_listens() -> None:
    async with ControllerClient(f"http://127.0.0.1:{free_port()}", timeout=2.0) as c:
        with pytest.raises(Unavailable) as err:
            await c.health()
    assert err.value.retryable


async def test_slot_accounting_queue_and_bands(tmp_path: Path) -> None:
    """Jobs wait when the backend is full, start in (band, arrival) order, and the report is exact.
    The running jobs are production: nothing waiting may preempt them (docs/DESIGN.md, "Preemption")."""
    peer = cluster("peer", backends=[gpu_backend(slots=8)])
    cfg = write_config(tmp_path / "c.toml", federation(cluster("home"), peer))
    ctl = start_controller(cfg, "peer", tmp_path / "state", port=peer["port"])
    sleeper = py("import time; time.sleep(120)")
    try:
        async with ctl.client() as c:

            async def avail() -> tuple[dict[str, int], dict[int, dict[str, int]]]:
                a = (await c.backends()).backends[0].availability
                assert a is not None
                amounts = dict(a.amounts)
                assert amounts.pop("cpu") == 4  # the CPU slots: GPU jobs take none
                return amounts, {int(h.band): h.amounts for h in a.held_by_band}

            a = await c.launch(request(sleeper, job_id="q/a", gpus=6, band=Band.PRODUCTION))
            assert a.state is S.RUNNING
            assert await avail() == ({"h100": 2}, {1: {"h100": 6}})
            b = await c.launch(request(sleeper, job_id="q/b", gpus=2, band=Band.PRODUCTION))
            assert b.state is S.RUNNING
            assert await avail() == ({"h100": 0}, {1: {"h100": 8}})
            # Full: these wait on the controller. "late-prod" overtakes "batch" (band first).
            w1 = await c.launch(request(sleeper, job_id="q/batch", gpus=4, band=Band.BATCH))
            w2 = await c.launch(request(sleeper, job_id="q/late-prod", gpus=4, band=Band.PRODUCTION))
            assert w1.state is S.PENDING and w2.state is S.PENDING
            assert (await c.terminate("q/a")).state is S.KILLED
            st = await poll(
                lambda: c.status("q/late-prod"), lambda s: s.state is S.RUNNING, what="late-prod runs"
            )
            assert (
                sorted(s for t in st.tasks for s in t.slots)
                == sorted(set(range(8)) - set((await c.status("q/b")).tasks[0].slots))[:4]
            )
            assert (await c.status("q/batch")).state is S.PENDING
            # 2 chips are idle, but the waiting batch job (4) is promised them: nothing is free.
            assert await avail() == ({"h100": 0}, {1: {"h100": 6}})
            # A pending job can be terminated: it never runs, and its promise is released.
            assert (await c.terminate("q/batch")).state is S.KILLED
            assert await avail() == ({"h100": 2}, {1: {"h100": 6}})
            for job in ("q/b", "q/late-prod"):
                await c.terminate(job)
            assert await avail() == ({"h100": 8}, {})
            states = {j.job_id: j.state for j in await c.list_jobs()}
            assert states == {"q/a": S.KILLED, "q/b": S.KILLED, "q/batch": S.KILLED, "q/late-prod": S.KILLED}
    finally:
        ctl.stop()


async def test_cpu_slots_limit_cpu_jobs(tmp_path: Path) -> None:
    peer = cluster("peer", backends=[gpu_backend(slots=1, cpu_slots=1)])
    cfg = write_config(tmp_path / "c.toml", federation(cluster("home"), peer))
    ctl = start_controller(cfg, "peer", tmp_path / "state", port=peer["port"])
    try:
        async with ctl.client() as c:
            first = await c.launch(request(py("import time; time.sleep(120)"), job_id="cpu/1"))
            second = await c.launch(request(py("print('second')"), job_id="cpu/2"))
            gpu = await c.launch(request(py("print('gpu')"), job_id="cpu/gpu", gpus=1))
            assert first.state is S.RUNNING and second.state is S.PENDING
            # Device jobs do not use CPU slots.
            assert (await wait_terminal(c, gpu.job_id)).state is S.SUCCEEDED
            assert (await c.status("cpu/2")).state is S.PENDING
            await c.terminate("cpu/1")
            assert (await wait_terminal(c, "cpu/2")).state is S.SUCCEEDED
    finally:
        ctl.stop()


async def test_graceful_stop_leaves_no_process(tmp_path: Path) -> None:
    peer = cluster("peer", backends=[gpu_backend()])
    cfg = write_config(tmp_path / "c.toml", federation(cluster("home"), peer))
    ctl = start_controller(cfg, "peer", tmp_path / "state", port=peer["port"])
    async with ctl.client() as c:
        await c.launch(request(py("import time; print('up', flush=True); time.sleep(120)"), job_id="g/1"))
        await poll(lambda: c.logs("g/1"), lambda ch: "up" in ch.data, what="g/1 up")
    # Its processes as the host sees them (in the sandbox, the job knows only its namespace's pids).
    pids = job_pids("g/1")
    assert pids
    assert ctl.stop() in (0, -15)  # uvicorn re-raises SIGTERM after a clean shutdown
    assert not any(process_alive(pid) for pid in pids)
    assert "g/1" in json.dumps([line for line in ctl.log_text().splitlines() if "finished" in line])


async def test_no_process_outlives_its_job(tmp_path: Path) -> None:
    """Without the sandbox (sandbox = "off": what a host that cannot sandbox relies on), the
    job leaves a child in its group and a daemon in a new session; both must be gone. The pids
    the job prints are the host's only outside a PID namespace; in the sandbox the namespace ends
    them (tests/controller/test_controller_sandbox.py::test_a_setsid_child_ends_with_its_job)."""
    peer = cluster("peer", backends=[gpu_backend()], sandbox="off")
    cfg = write_config(tmp_path / "c.toml", federation(cluster("home"), peer))
    ctl = start_controller(cfg, "peer", tmp_path / "state", port=peer["port"])
    code = (
        "import subprocess, sys; "
        "a = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)']); "
        "b = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)'], "
        "start_new_session=True); "
        "print(a.pid, b.pid, flush=True)"
    )
    req = request(py(code))
    try:
        async with ctl.client() as c:
            await c.launch(req)
            assert (await wait_terminal(c, req.job_id)).state is S.SUCCEEDED
            pids = [int(p) for p in (await read_all_logs(c, req.job_id)).split()]
        assert len(pids) == 2
        for pid in pids:
            await poll(
                lambda pid=pid: asyncio.to_thread(process_alive, pid),
                lambda alive: not alive,
                what=f"{pid} gone",
            )
    finally:
        ctl.stop()


async def test_terminate_by_nonce_fences_only_that_attempt(open_controller: Controller) -> None:
    """Fencing a stale attempt never stops a later one: terminate with the old attempt's nonce is a
    no-op once another attempt's run is current, and stops the run when it is that attempt's."""
    first = request(py("print('one')"), nonce="n-1")
    async with open_controller.client() as c:
        await c.launch(first)
        assert (await wait_terminal(c, first.job_id)).state is S.SUCCEEDED
        second = first.model_copy(update={"nonce": "n-2", "command": py("import time; time.sleep(60)")})
        await c.launch(second)
        await poll(lambda: c.status(first.job_id), lambda st: st.state is S.RUNNING, what="attempt 2 runs")
        st = await c.terminate(first.job_id, nonce="n-1")  # the stale attempt: already over
        assert st.nonce == "n-2" and st.state is S.RUNNING and st.attempts == 2
        st = await c.terminate(first.job_id, nonce="n-2")
        assert st.nonce == "n-2" and st.state is S.KILLED
