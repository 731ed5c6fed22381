"""The user's code travels with the job (docs/DESIGN.md, "Workspace bundles"; issue 13): the seed's
examples, as printed.

A workspace here is a directory holding ``my_training_script.py``, which imports a sibling module,
reads a data file and prints what it was shipped; ignored files sit beside it. Every job runs on the
real stack (``tests/stack.py``): the CLI as a subprocess in that directory, the SDK as the seed
writes it, the controllers as real processes, and, for one test, a peer on a real Ray head.
"""

from __future__ import annotations

import asyncio
import io
import json
import os
import sys
import tarfile
import uuid
from pathlib import Path

import pytest
from stack import Stack, wait_until
from temporalio.exceptions import ApplicationError
from temporalio.testing import ActivityEnvironment

from activities.peers import LaunchInput, PeerActivities
from iris import bundle as bundles
from iris import contract, devstack
from iris.client import InvalidJob, build_spec
from iris.contract import JOB_WORKFLOW
from iris.controller.client import ControllerClient
from iris.controller.errors import InvalidArgument, NotFound, Unauthenticated
from iris.controller.models import LaunchRequest
from iris.jobs import JobState, JobStatus, start_search_attributes
from iris.objectstore import open_store
from iris.policy.models import Band
from iris.userauth import Action

SCRIPT = """\
import os

shipped = sorted(
    os.path.relpath(os.path.join(d, f), ".").replace(os.sep, "/")
    for d, _, names in os.walk(".")
    for f in names
)
import helper  # a sibling module of the workspace

print(helper.greeting())
with open("data/config.txt") as f:
    print("config:", f.read().strip())
print("files:", ",".join(shipped))
print("cluster:", os.environ["IRIS_CLUSTER"])
"""
SHIPPED = ".gitignore,.irisignore,data/config.txt,helper.py,keep.ckpt,my_training_script.py"
# A size check besides the content check: the history holds a few status signals from the job's
# cluster's watcher (each a whole job status, docs/DESIGN.md "The change feed"), never the bundle.
MAX_HISTORY_BYTES = 128 * 1024
PINNED = {"device_type": "h100", "gpu_count": 8, "target_cluster": "cw-us-east-02a"}


def make_workspace(root: Path, marker: str | None = None) -> tuple[Path, str]:
    """A workspace with code, data and things that must not travel; returns it and its marker."""
    marker = marker or uuid.uuid4().hex
    files = {
        "my_training_script.py": SCRIPT,
        "helper.py": f"def greeting():\n    return 'hello from helper {marker}'\n",
        "data/config.txt": f"lr=3e-4 {marker}\n",
        ".gitignore": "*.ckpt\nsecret.txt\nbig/\n",
        ".irisignore": "notes.md\n!keep.ckpt\n",
        "keep.ckpt": "re-included by .irisignore\n",
        "model.ckpt": "ignored by .gitignore\n",
        "secret.txt": "ignored by .gitignore\n",
        "notes.md": "ignored by .irisignore\n",
        "big/blob.bin": "x" * 1000,
        ".venv/bin/python": "never shipped\n",
        ".git/HEAD": "ref: refs/heads/main\n",
        "__pycache__/helper.cpython-311.pyc": "never shipped\n",
        ".data/dev/state": "never shipped\n",
    }
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root, marker


def expected_output(marker: str, cluster: str) -> str:
    return f"hello from helper {marker}\nconfig: lr=3e-4 {marker}\nfiles: {SHIPPED}\ncluster: {cluster}\n"


async def history_json(stack: Stack, job_id: str) -> str:
    history = await stack.client.get_workflow_handle(job_id).fetch_history()
    return history.to_json()


async def visible_states(stack: Stack, job_id: str) -> list[str]:
    """Every value the job gave its IrisState search attribute (what the Web UI filters on)."""
    history = await stack.client.get_workflow_handle(job_id).fetch_history()
    states = []
    for event in history.events:
        if event.HasField("upsert_workflow_search_attributes_event_attributes"):
            fields = event.upsert_workflow_search_attributes_event_attributes.search_attributes.indexed_fields
            if "IrisState" in fields:
                states.append(json.loads(fields["IrisState"].data))
    return states


async def wait_state(stack: Stack, job_id: str, state: JobState, timeout: float = 90) -> JobStatus:
    async def reached() -> bool:
        return (await stack.iris.describe(job_id)).state is state

    await wait_until(reached, timeout=timeout, what=f"{job_id} in {state.value}")
    return await stack.iris.describe(job_id)


def bundles_at_home(stack: Stack) -> set[str]:
    store = stack.config.home_cluster.object_store
    assert store is not None
    return set(open_store(store).keys(bundles.HOME_PREFIX + "/"))


async def assert_no_bundle_bytes(stack: Stack, job_id: str, marker: str) -> None:
    text = await history_json(stack, job_id)
    assert len(text.encode()) < MAX_HISTORY_BYTES, f"{job_id}: history is {len(text)} bytes"
    assert marker not in text, f"{job_id}: workspace content in its history"


def peer_secrets_in(environ: dict[str, str], stack: Stack) -> list[str]:
    """Names (or values) of any peer cluster's object-store credentials in ``environ``."""
    found = []
    for cluster in stack.config.clusters:
        if cluster.name == stack.config.home:
            continue
        for name, value in devstack.store_credentials(stack.config, cluster.name).items():
            if name in environ or value in environ.values():
                found.append(f"{cluster.name}:{name}")
    return found


async def test_the_seeds_cli_examples_run_the_users_script_on_a_peer_pinned_and_at_home(
    stack: Stack, tmp_path: Path
) -> None:
    ws, marker = make_workspace(tmp_path / "ws")
    spilled = await stack.cli(
        "job", "run", "--device-type=h100", "--gpu-count=8", "my_training_script.py", cwd=ws
    )
    assert spilled.code == 0, spilled.stderr
    job_id, _, output = spilled.stdout.partition("\n")
    status = await stack.iris.describe(job_id)
    assert status.cluster in {"cw-us-east-02a", "cw-rno2a"}, status.reason
    assert output == expected_output(marker, status.cluster)
    assert status.spec is not None and status.spec.command == ["python", "my_training_script.py"]
    assert "bundle sha256:" in spilled.stderr  # the CLI says what it ships

    pinned = await stack.cli(
        "job", "run", "--target-cluster=cw-us-east-02a", "--device-type=h100", "--gpu-count=8",
        "my_training_script.py", cwd=ws,
    )  # fmt: skip
    assert pinned.code == 0, pinned.stderr
    pinned_id, _, output = pinned.stdout.partition("\n")
    assert output == expected_output(marker, "cw-us-east-02a")

    home = await stack.cli("job", "run", "my_training_script.py", cwd=ws)
    assert home.code == 0, home.stderr
    home_id, _, output = home.stdout.partition("\n")
    assert output == expected_output(marker, "marin")
    assert (await stack.iris.describe(home_id)).cluster == "marin"

    # BUILDING is a state of its own, in the job's events and in the state the Web UI shows, while
    # the bundle is staged: for each job whose cluster did not hold it yet. The pinned job's
    # cluster holds it already if the first job ran there: then it is launched at once.
    first_there = status.cluster == "cw-us-east-02a"
    for jid, staged in ((job_id, True), (pinned_id, not first_there), (home_id, True)):
        await assert_no_bundle_bytes(stack, jid, marker)
        st = await stack.iris.describe(jid)
        building = [e.message for e in st.events if e.state is JobState.BUILDING]
        assert any("Staging workspace bundle" in m for m in building) is staged, (jid, building)
        assert ("BUILDING" in await visible_states(stack, jid)) is staged
    described = await stack.cli("job", "describe", pinned_id)
    assert ("uploaded to cw-us-east-02a" in described.stdout) is not first_there, described.stdout
    assert not peer_secrets_in(dict(os.environ), stack), "the home worker's process holds a peer secret"


async def test_the_seeds_sdk_example_runs_the_users_script(stack: Stack, tmp_path: Path) -> None:
    ws, marker = make_workspace(tmp_path / "ws")
    program = (
        "from iris.client import IrisClient\n"
        "client = IrisClient(cluster='marin')\n"
        "job_id = client.submit(script='my_training_script.py', device_type='h100', gpu_count=8)\n"
        "print(f'Submitted job {job_id}')\n"
        "status = client.wait(job_id, timeout_s=120)\n"
        "print(status.state.value, status.cluster)\n"
        "print(client.logs(job_id).data, end='')\n"
    )
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", program, cwd=ws, env=stack.cli_env(),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, err = await asyncio.wait_for(proc.communicate(), 180)
    assert proc.returncode == 0, err.decode()
    lines = out.decode().split("\n", 2)
    assert lines[0].startswith("Submitted job ")
    state, cluster = lines[1].split()
    assert state == "SUCCEEDED" and cluster in {"cw-us-east-02a", "cw-rno2a"}
    assert lines[2] == expected_output(marker, cluster)
    await assert_no_bundle_bytes(stack, lines[0].removeprefix("Submitted job "), marker)


async def test_a_ray_peer_runs_the_bundle_as_its_working_dir(ray_stack: Stack, tmp_path: Path) -> None:
    ws, marker = make_workspace(tmp_path / "ws")
    job_id = await ray_stack.iris.submit(
        script="my_training_script.py", workdir=ws, device_type="h100", gpu_count=8, target_cluster="cw-rno2a"
    )
    final = await ray_stack.iris.wait(job_id, timeout_s=180)
    assert final.state is JobState.SUCCEEDED, final.reason
    assert (await ray_stack.iris.logs(job_id)).data == expected_output(marker, "cw-rno2a")
    assert any(e.state is JobState.BUILDING for e in final.events)
    await assert_no_bundle_bytes(ray_stack, job_id, marker)


async def test_cluster_option_selects_the_home_and_refuses_other_names(stack: Stack) -> None:
    ok = await stack.cli("--cluster=marin", "rpc", "controller", "list-peers")
    assert ok.code == 0, ok.stderr
    peers = {p["peer_id"]: p for p in json.loads(ok.stdout)["peers"]}
    assert set(peers) == {"marin", "cw-us-east-02a", "cw-rno2a"}
    backend = peers["cw-us-east-02a"]["backends"][0]
    assert backend["advertised_attributes"]["device-variant"] == ["h100"]
    assert set(backend["availability"]) >= {"amounts", "held_by_band"}

    for name, words in (("nowhere", "unknown cluster 'nowhere'"), ("cw-rno2a", "--cluster=marin")):
        res = await stack.cli(f"--cluster={name}", "rpc", "controller", "list-peers")
        assert res.code == 2 and res.stdout == ""
        assert len(res.stderr.strip().splitlines()) == 1 and words in res.stderr, res.stderr


async def test_a_workspace_over_the_limit_is_refused_before_anything_starts(
    stack: Stack, tmp_path: Path
) -> None:
    ws, _ = make_workspace(tmp_path / "ws")
    for name, size in (("weights/big.bin", 30 * bundles.MIB), ("data/shard.bin", 2 * bundles.MIB)):
        (ws / name).parent.mkdir(parents=True, exist_ok=True)
        with (ws / name).open("wb") as f:
            f.truncate(size)  # sparse: no disk used, still 30 MiB to ship
    before = await asyncio.to_thread(bundles_at_home, stack)
    res = await stack.cli("job", "run", "--job-name", "too-large", "my_training_script.py", cwd=ws)
    assert res.code == 2, res.stderr
    line = res.stderr.strip()
    assert len(line.splitlines()) == 1
    assert "32.0 MiB" in line and "25.0 MiB limit" in line, line
    assert line.index("weights/big.bin (30.0 MiB)") < line.index("data/shard.bin (2.0 MiB)"), line
    assert (await stack.cli("job", "describe", "tester/too-large")).code == 3  # never started
    assert await asyncio.to_thread(bundles_at_home, stack) == before

    # A script the workspace does not ship is refused too, naming it.
    missing = await stack.cli(
        "job", "run", "--job-name", "no-script", "train.py", cwd=tmp_path / "ws" / "data"
    )
    assert missing.code == 2 and "train.py is not in the workspace" in missing.stderr, missing.stderr


async def test_an_unchanged_workspace_is_stored_and_sent_once_and_an_empty_one_not_at_all(
    stack: Stack, tmp_path: Path
) -> None:
    ws, marker = make_workspace(tmp_path / "ws")
    proxy = stack.proxies["cw-us-east-02a"]
    ids = [await stack.iris.submit(script="my_training_script.py", workdir=ws, **PINNED) for _ in range(2)]
    finals = [await stack.iris.wait(job_id, timeout_s=120) for job_id in ids]
    assert all(f.state is JobState.SUCCEEDED for f in finals), [f.reason for f in finals]
    spec = finals[0].spec
    assert spec is not None and spec.bundle is not None
    assert finals[1].spec is not None and finals[1].spec.bundle == spec.bundle  # same content, same id
    assert proxy.requests[f"PUT /v1/bundles/{spec.bundle.sha256}"] == 1
    # Submitted together: one upload. The other job was launched after it (no staging), or found
    # the bundle missing too and waited for that upload ("already on").
    building = [[e.message for e in f.events if e.state is JobState.BUILDING] or ["-"] for f in finals]
    ends = sorted(messages[-1] for messages in building)
    assert ends[1] == f"workspace bundle {spec.bundle.short} uploaded to cw-us-east-02a", ends
    assert ends[0] in ("-", f"workspace bundle {spec.bundle.short} already on cw-us-east-02a"), ends
    # Submitted again later: stored at home once, not sent again, not even asked about: its launch
    # is accepted at once, with no BUILDING and no staging request (issue 31).
    asked = proxy.requests[f"GET /v1/bundles/{spec.bundle.sha256}"]
    again = await stack.iris.submit(script="my_training_script.py", workdir=ws, **PINNED)
    final = await stack.iris.wait(again, timeout_s=120)
    assert final.state is JobState.SUCCEEDED, final.reason
    assert not any(e.state is JobState.BUILDING for e in final.events)
    assert proxy.requests[f"PUT /v1/bundles/{spec.bundle.sha256}"] == 1
    assert proxy.requests[f"GET /v1/bundles/{spec.bundle.sha256}"] == asked
    assert (await stack.iris.logs(again)).data == expected_output(marker, "cw-us-east-02a")
    assert bundles.home_key(spec.bundle.sha256) in await asyncio.to_thread(bundles_at_home, stack)

    empty = tmp_path / "empty"
    empty.mkdir()
    job_id = await stack.iris.submit(["echo", "nothing shipped"], workdir=empty)
    final = await stack.iris.wait(job_id, timeout_s=60)
    assert final.state is JobState.SUCCEEDED and final.spec is not None and final.spec.bundle is None
    assert not any(e.state is JobState.BUILDING for e in final.events)


def _tar(members: list[tuple[tarfile.TarInfo, bytes]]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for info, data in members:
            tar.addfile(info, io.BytesIO(data) if data else None)
    return buf.getvalue()


async def test_a_peer_stores_only_bundles_that_match_their_id_and_are_safe(
    stack: Stack, tmp_path: Path
) -> None:
    ws, _ = make_workspace(tmp_path / "ws")
    good = bundles.pack(ws)
    assert good is not None
    info = tarfile.TarInfo("../../escape.sh")
    info.size = 3
    escape = _tar([(info, b"hi\n")])
    link = tarfile.TarInfo("keys")
    link.type, link.linkname = tarfile.SYMTYPE, "/etc"
    linked = _tar([(link, b"")])
    async with ControllerClient.for_cluster(stack.config, "cw-rno2a") as peer:
        # Bytes that do not hash to the id they are sent under.
        with pytest.raises(InvalidArgument, match="do not hash"):
            await peer.put_bundle(bundles.digest(b"something else"), good.data)
        # Correctly hashed, but not a safe bundle.
        for data, why in ((escape, "not a relative path"), (linked, "not a regular file"), (b"junk", "gzip")):
            with pytest.raises(InvalidArgument, match=why):
                await peer.put_bundle(bundles.digest(data), data)
            with pytest.raises(NotFound):
                await peer.bundle_info(bundles.digest(data))
        with pytest.raises(InvalidArgument):
            await peer.bundle_info("not-a-sha")
    # Nobody but a trusted cluster may store one.
    async with ControllerClient(stack.config.cluster("cw-rno2a").url) as anonymous:
        with pytest.raises(Unauthenticated):
            await anonymous.put_bundle(good.ref.sha256, good.data)


async def test_a_handoff_whose_replies_are_lost_uploads_once_and_runs_once(
    stack: Stack, tmp_path: Path
) -> None:
    ws, marker = make_workspace(tmp_path / "ws")
    proxy = stack.proxies["cw-us-east-02a"]
    proxy.lose_replies["PUT /v1/bundles/"] += 1
    # Both launches' replies: "no such bundle" to the first, then the acceptance after staging.
    proxy.lose_replies["POST /v1/jobs"] += 2
    lost = proxy.lost_replies
    try:
        job_id = await stack.iris.submit(script="my_training_script.py", workdir=ws, **PINNED)
        final = await stack.iris.wait(job_id, timeout_s=120)
    finally:
        proxy.lose_replies.clear()
    assert proxy.lost_replies == lost + 3, "the three replies were lost"
    assert final.state is JobState.SUCCEEDED, final.reason
    assert final.spec is not None and final.spec.bundle is not None
    assert proxy.requests[f"PUT /v1/bundles/{final.spec.bundle.sha256}"] == 1
    async with ControllerClient.for_cluster(stack.config, "cw-us-east-02a") as peer:
        assert (await peer.status(job_id)).attempts == 1
    assert (await stack.iris.logs(job_id)).data == expected_output(marker, "cw-us-east-02a")


async def test_a_launch_of_a_bundle_the_peer_lacks_makes_no_job_until_it_is_staged(
    stack: Stack, tmp_path: Path
) -> None:
    """``launch_job`` against a real peer (LAUNCH_FIRST_PATCH's first send): the peer lacks the
    bundle, so the activity fails BUNDLE_MISSING, non-retryable, having sent nothing else and
    left no job there. The send after staging (``stage_missing``) stages and launches."""
    ws, _ = make_workspace(tmp_path / "ws")
    packed = bundles.pack(ws)
    assert packed is not None
    await stack.iris.store_bundle(packed.ref, packed)
    cluster = "cw-rno2a"
    proxy = stack.proxies[cluster]
    job_id = f"tester/launch-first-{packed.ref.sha256[:8]}"
    request = LaunchRequest(
        job_id=job_id,
        command=["true"],
        band=Band.BATCH,
        user="tester@example.com",
        requester=stack.config.home,
        nonce=f"{job_id}@1",
        backend_id="h100-rno2a",
        bundle=packed.ref,
    )
    activities = PeerActivities(stack.config)
    env = ActivityEnvironment()
    with pytest.raises(ApplicationError) as refused:
        await env.run(
            activities.launch_job, LaunchInput(cluster=cluster, request=request, stage_missing=False)
        )
    assert (refused.value.type, refused.value.non_retryable) == (contract.BUNDLE_MISSING, True)
    assert proxy.requests[f"PUT /v1/bundles/{packed.ref.sha256}"] == 0
    assert proxy.requests[f"GET /v1/bundles/{packed.ref.sha256}"] == 0
    async with ControllerClient.for_cluster(stack.config, cluster) as peer:
        with pytest.raises(NotFound):
            await peer.status(job_id)
        launched = await env.run(activities.launch_job, LaunchInput(cluster=cluster, request=request))
        assert launched.nonce == request.nonce
        assert proxy.requests[f"PUT /v1/bundles/{packed.ref.sha256}"] == 1
        assert (await peer.status(job_id)).attempts == 1


async def test_a_peer_restarted_between_upload_and_launch_still_runs_the_job(
    stack: Stack, tmp_path: Path
) -> None:
    ws, marker = make_workspace(tmp_path / "ws")
    proxy = stack.proxies["cw-us-east-02a"]
    peer = stack.services["controller cw-us-east-02a"]
    proxy.down_after = "PUT /v1/bundles/"
    try:
        job_id = await stack.iris.submit(script="my_training_script.py", workdir=ws, **PINNED)

        async def uploaded_and_down() -> bool:
            return proxy.down

        await wait_until(uploaded_and_down, timeout=60, what="the bundle upload")
        await asyncio.to_thread(peer.stop)
        peer.start()
        await asyncio.to_thread(peer.wait_ready, 60)
    finally:
        proxy.down_after = None
        proxy.down = False
    final = await stack.iris.wait(job_id, timeout_s=120)
    assert final.state is JobState.SUCCEEDED, final.reason
    assert final.spec is not None and final.spec.bundle is not None
    assert proxy.requests[f"PUT /v1/bundles/{final.spec.bundle.sha256}"] == 1
    assert (await stack.iris.logs(job_id)).data == expected_output(marker, "cw-us-east-02a")


async def test_a_home_store_that_refuses_the_bundle_is_one_line_and_starts_nothing(
    stack: Stack, tmp_path: Path
) -> None:
    ws, _ = make_workspace(tmp_path / "ws")
    cfg = stack.config.model_copy(deep=True)
    store = cfg.home_cluster.object_store
    assert store is not None
    store.bucket = "no-such-bucket"
    config_file = tmp_path / "clusters.json"
    config_file.write_text(cfg.model_dump_json())
    res = await stack.cli(
        "--config", str(config_file), "job", "run", "--job-name", "no-store", "my_training_script.py", cwd=ws
    )
    assert res.code == 4, res.stderr
    assert len(res.stderr.strip().splitlines()) == 1 and "no-such-bucket" in res.stderr, res.stderr
    assert (await stack.cli("job", "describe", "tester/no-store")).code == 3


async def test_a_bundle_lost_from_the_home_store_parks_the_job_until_an_operator_restores_it(
    stack: Stack, tmp_path: Path
) -> None:
    ws, marker = make_workspace(tmp_path / "ws")
    packed = bundles.pack(ws)
    assert packed is not None
    spec = build_spec(
        ["python", "my_training_script.py"], name=f"lost-{marker[:8]}", bundle=packed.ref, **PINNED
    )
    # The SDK refuses to start a job whose bundle the home store does not hold...
    with pytest.raises(InvalidJob, match="not in the home cluster's store"):
        await stack.iris.submit_spec(spec)
    # ...so start the workflow as a job whose bundle vanished after submit would look (signed by
    # its user, as the SDK would have).
    spec = spec.model_copy(update={"signature": stack.iris.sign(Action.SUBMIT, spec.user, spec.job_id, spec)})
    await stack.client.start_workflow(
        JOB_WORKFLOW,
        spec,
        id=spec.job_id,
        task_queue=stack.config.temporal.task_queue,
        search_attributes=start_search_attributes(spec),
    )
    parked = await wait_state(stack, spec.job_id, JobState.HANDOFF_FAILED)
    assert parked.reason == f"workspace bundle {packed.ref.short} is missing from the home object store"
    assert parked.handoff_attempts == 0  # never launched
    await stack.iris.store_bundle(packed.ref, packed)  # the operator restores it, then replays
    await stack.iris.replay_handoff(spec.job_id)
    final = await stack.iris.wait(spec.job_id, timeout_s=120)
    assert final.state is JobState.SUCCEEDED, final.reason
    assert (await stack.iris.logs(spec.job_id)).data == expected_output(marker, "cw-us-east-02a")


async def test_a_bundle_the_peer_refuses_ends_the_job_handoff_rejected(stack: Stack) -> None:
    link = tarfile.TarInfo("keys")
    link.type, link.linkname = tarfile.SYMTYPE, "/etc"
    data = _tar([(link, b"")])
    ref = bundles.BundleRef(sha256=bundles.digest(data), size=len(data), files=1, workspace_bytes=0)
    store = stack.config.home_cluster.object_store
    assert store is not None
    await asyncio.to_thread(open_store(store).put, bundles.home_key(ref.sha256), data)
    spec = build_spec(["true"], name=f"hostile-{ref.sha256[:8]}", bundle=ref, **PINNED)
    job_id = await stack.iris.submit_spec(spec)
    final = await stack.iris.wait(job_id, timeout_s=60)
    assert final.state is JobState.HANDOFF_REJECTED, final.reason
    assert "cw-us-east-02a refused workspace bundle" in final.reason and "not a regular file" in final.reason
    assert final.handoff_attempts == 0


async def test_concurrent_writers_of_one_bundle_key_all_succeed_and_one_writes(stack: Stack) -> None:
    """Six submits of one workspace at once write its content-addressed key concurrently: one
    create-if-absent wins, the others are told it exists (not an outage), on GCS and on S3."""
    home = stack.config.home_cluster.object_store
    peer = stack.config.cluster("cw-rno2a").object_store
    assert home is not None and peer is not None
    for config, environ in ((home, None), (peer, {"K": "test", "S": "test"})):
        if environ is not None:
            config = config.model_copy(update={"access_key_env": "K", "secret_key_env": "S"})
        store = open_store(config, environ=environ)
        key = f"race/{uuid.uuid4().hex}"
        written = await asyncio.gather(
            *(asyncio.to_thread(store.put, key, b"same bytes", if_absent=True) for _ in range(6))
        )
        assert sorted(written) == [False] * 5 + [True], (config.kind, written)
        assert store.get(key) == b"same bytes"
