"""Slurm backend settings and what the backend reads of Slurm, service-free (issue 30): config
validation, the demo topology on Slurm, `iris dev --backend slurm` refusals, and the parsers of
``squeue --json`` / ``sinfo --json`` output as Slurm 22.05 writes it (captured on this machine)."""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import readme
from pydantic import ValidationError

from iris import slurmdev
from iris.config import PROJECT_ROOT, BackendConfig, load_config
from iris.controller.executors.base import Demand
from iris.controller.executors.slurm import (
    SlurmNode,
    batch_script,
    capacity,
    exit_code,
    parse_gres,
    parse_jobs,
    parse_nodes,
    time_limit,
    unreachable_by,
)
from iris.controller.models import LaunchRequest
from iris.controller.state import JobRecord
from iris.policy.models import DeviceRequest

SLURM_KEYS = {"kind", "slurm_partition", "slurm_gres"}


def slurm(**kw: object) -> BackendConfig:
    return BackendConfig.model_validate(
        {"id": "s", "kind": "slurm", "devices": {"h100": 8}, "slurm_partition": "gpu", **kw}
    )


def test_a_slurm_backend_is_validated() -> None:
    b = slurm(slurm_partitions={"batch": "low"}, slurm_gres={"H100": "a-h100"})
    assert b.slurm_partition_for("batch") == "low" and b.slurm_partition_for("production") == "gpu"
    assert b.slurm_gres_type("h100") == "a-h100" and slurm().slurm_gres_type("h100") == "h100"
    bad = [
        ({"slurm_partition": ""}, "needs slurm_partition"),
        ({"slurm_partition": "a b"}, "needs slurm_partition"),
        ({"slurm_partitions": {"urgent": "x"}}, "unknown band 'urgent'"),
        ({"slurm_partitions": {"batch": "x,y"}}, "is not a partition name"),
        ({"slurm_gres": {"a100": "x"}}, "not in devices"),
        ({"slurm_gres": {"h100": "h100:2"}}, "letters, digits"),
        ({"slurm_conf": "etc/slurm.conf"}, "not an absolute path"),
        ({"slurm_work_dir": "work"}, "not an absolute path"),
        ({"slurm_sbatch_args": ["account=ml"]}, "not an sbatch option"),
        ({"slurm_env": {"A=B": "x"}}, "invalid variable"),
        ({"slurm_cpus": 0}, "greater than or equal to 1"),
    ]
    for fields, message in bad:
        with pytest.raises(ValidationError, match=message):
            slurm(**fields)
    # Only a Slurm backend needs a partition.
    assert BackendConfig(id="p").kind == "process"


def test_the_slurm_demo_differs_from_the_demo_only_in_backend_engines() -> None:
    plain = load_config(PROJECT_ROOT / "config" / "clusters.toml")
    on_slurm = load_config(PROJECT_ROOT / "config" / "clusters-slurm.toml")
    assert plain.model_dump(exclude={"clusters"}) == on_slurm.model_dump(exclude={"clusters"})
    kinds = {}
    for mine, theirs in zip(plain.clusters, on_slurm.clusters, strict=True):
        assert mine.model_dump(exclude={"backends"}) == theirs.model_dump(exclude={"backends"})
        for a, b in zip(mine.backends, theirs.backends, strict=True):
            assert a.model_dump(exclude=SLURM_KEYS) == b.model_dump(exclude=SLURM_KEYS)
            kinds[b.id] = b.kind
    assert kinds == {
        "cpu-us-central1-a": "process",
        "cpu-us-central1-b": "process",
        "h100-us-east-02a": "slurm",
        "h100-rno2a": "slurm",
    }
    # One Slurm for both peers, each its own GRES type: their GPUs stay apart.
    spec = slurmdev.spec_for(on_slurm)
    assert spec is not None
    assert spec.gres == {"cw-us-east-02a-h100": 16, "cw-rno2a-h100": 8} and spec.partitions == ("iris",)
    assert slurmdev.spec_for(plain) is None


def test_dev_slurm_refuses_a_config_without_slurm_backends(tmp_path: Path) -> None:
    plain = PROJECT_ROOT / "config" / "clusters.toml"
    res = subprocess.run(
        [str(Path(sys.executable).parent / "iris"), "--config", str(plain),
         "dev", "--backend", "slurm", "--data-dir", str(tmp_path / "data")],
        capture_output=True, text=True, timeout=60, env={**os.environ},
    )  # fmt: skip
    assert res.returncode == 2, res.stderr
    assert 'no backend with kind = "slurm"' in res.stderr
    assert not (tmp_path / "data").exists()  # nothing started


# `squeue --json` and `sinfo --json` of Slurm 22.05.8 (trimmed to the fields read).
SQUEUE = {
    "meta": {"plugin": {"type": "openapi/v0.0.38"}, "Slurm": {"release": "22.05.8"}},
    "errors": [],
    "jobs": [
        {"job_id": 4, "job_state": "RUNNING", "comment": "iris:abc", "name": "iris:alice/x",
         "exit_code": 0, "start_time": 1796519398, "restart_cnt": 0, "state_reason": "None",
         "nodes": "node1", "partition": "iris", "user_name": "nobody"},
        {"job_id": 5, "job_state": "FAILED", "comment": "", "exit_code": 768,
         "state_reason": "NonZeroExitCode"},
        {"job_id": 6, "job_state": "FAILED", "comment": "", "exit_code": 9,
         "state_reason": "JobLaunchFailure"},
        {"job_id": 7, "job_state": "COMPLETING", "comment": "iris:def", "exit_code": 0},
        {"job_id": 8, "job_state": "PENDING", "comment": "iris:ghi", "exit_code": 0, "start_time": 0},
    ],
}  # fmt: skip
SINFO = {
    "nodes": [
        {"name": "node1", "state": "mixed", "state_flags": [], "partitions": ["iris"],
         "gres": "gpu:cw-us-east-02a-h100:16,gpu:t-jobs.x:8",
         "gres_used": "gpu:cw-us-east-02a-h100:2(IDX:0-1),gpu:t-jobs.x:3(IDX:16-18)"},
        {"name": "node2", "state": "idle", "state_flags": ["DRAIN"], "partitions": ["iris"],
         "gres": "gpu:t-jobs.x:8(S:0-1)", "gres_used": "gpu:t-jobs.x:0(IDX:N/A)"},
        {"name": "node3", "state": "down", "state_flags": ["NOT_RESPONDING"], "partitions": ["iris"],
         "gres": "gpu:t-jobs.x:8", "gres_used": "gpu:t-jobs.x:0(IDX:N/A)"},
        {"name": "node4", "state": "idle", "state_flags": [], "partitions": ["other"],
         "gres": "gpu:t-jobs.x:8", "gres_used": "gpu:t-jobs.x:0(IDX:N/A)"},
        {"name": "node5", "state": "allocated", "state_flags": [], "partitions": ["iris", "other"],
         "gres": "gpu:4", "gres_used": "gpu:4(IDX:0-3)"},
    ]
}  # fmt: skip


def test_squeue_json_is_read_with_exit_codes_as_a_shell_gives_them() -> None:
    jobs = {j.job_id: j for j in parse_jobs(SQUEUE)}
    running = jobs[4]
    assert (running.started, running.terminal, running.pending) == (True, False, False)
    assert (running.comment, running.name, running.user, running.start_s) == (
        "iris:abc", "iris:alice/x", "nobody", 1796519398,
    )  # fmt: skip
    assert jobs[7].started and not jobs[7].terminal  # COMPLETING: still holding its GPUs
    assert jobs[8].pending
    # The wait status: `exit 3` is 768, SIGKILL 9.
    assert [exit_code(jobs[i].exit_status) for i in (4, 5, 6)] == [0, 3, 137]
    # Later versions wrap numbers: {"set": true, "number": N}.
    (wrapped,) = parse_jobs({"jobs": [{"job_id": {"set": True, "number": 9}, "job_state": ["RUNNING"]}]})
    assert (wrapped.job_id, wrapped.state) == (9, "RUNNING")


def test_sinfo_gres_give_each_token_its_type_s_gpus_on_the_backend_s_up_nodes() -> None:
    assert parse_gres("gpu:h100:8(S:0-1),gpu:a100:2") == [("gpu", "h100", 8), ("gpu", "a100", 2)]
    assert parse_gres("gpu:h100:2(IDX:0,3),gpu:4") == [("gpu", "h100", 2), ("gpu", "", 4)]
    assert parse_gres("(null)") == [] and parse_gres("") == []
    nodes = parse_nodes(SINFO)
    assert isinstance(nodes[0], SlurmNode) and nodes[1].alive and not nodes[1].open and not nodes[2].alive
    totals, free = capacity(nodes, ["iris"], {"east": "cw-us-east-02a-h100", "jobs": "t-jobs.x", "any": ""})
    # node2 drains (its GPUs count, none free), node3 is down, node4 is in another partition;
    # untyped node5's GPUs count for "any" type only.
    assert totals == {"east": 16, "jobs": 16, "any": 16 + 16 + 4}
    assert free == {"east": 14, "jobs": 5, "any": 14 + 5}


def job(replicas: int = 1) -> JobRecord:
    req = LaunchRequest(
        job_id="alice/x",
        command=["python", "train.py", "--name", "it's"],
        device=DeviceRequest(type="gpu", variant="h100", count=2, replicas=replicas),
        user="alice",
        requester="home",
        nonce="n",
        backend_id="s",
    )
    return JobRecord.new(req, seq=1, run_id="r1", attempts=1)


def test_the_batch_script_runs_the_command_as_the_batch_step_or_one_srun_task_per_replica() -> None:
    one = batch_script(job(), Demand("h100", 2, 1))
    assert one.startswith("#!/bin/sh\n") and one.endswith("exec python train.py --name 'it'\"'\"'s'\n")
    gang = batch_script(job(3), Demand("h100", 2, 3))
    assert "exec srun --kill-on-bad-exit=1 --gpu-bind=per_task:2 /bin/sh -c" in gang
    assert "'IRIS_REPLICA_INDEX=$SLURM_PROCID exec \"$@\"' iris-replica python train.py" in gang
    assert "--gpu-bind" not in batch_script(job(3), Demand("cpu", 1, 3))
    # Slurm's own limit backs the controller's: whole minutes, more than the timeout.
    assert [time_limit(t) for t in (1, 59, 60, 3600)] == ["2", "2", "3", "62"]


def test_a_work_dir_the_job_s_user_cannot_reach_is_named(tmp_path: Path) -> None:
    closed = tmp_path / "closed"
    (closed / "work").mkdir(parents=True)
    closed.chmod(0o700)
    nobody = 65534
    os.chmod(tmp_path, 0o711)
    assert unreachable_by(closed / "work", nobody, nobody) in (closed, tmp_path, *tmp_path.parents)
    assert unreachable_by(closed / "work", 0, 0) is None
    opened = Path("/tmp")
    assert unreachable_by(opened, nobody, nobody) is None


def test_the_readme_slurm_block_is_a_valid_backend() -> None:
    data = tomllib.loads(readme.block("slurm-backend").text)
    (backend,) = data["clusters"]["backends"]
    parsed = BackendConfig.model_validate(backend)
    assert parsed.kind == "slurm" and parsed.slurm_gres_type("h100") == "h100"
    assert (
        parsed.slurm_partition_for("batch") == "gpu-low"
        and parsed.slurm_partition_for("interactive") == "gpu"
    )
