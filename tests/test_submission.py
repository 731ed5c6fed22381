"""Submission rules that need no service: `--cluster`, Python scripts, the workspace
(docs/DESIGN.md, "Workspace bundles").

The same checks run in the CLI and the SDK before anything is contacted, so a bad submission is
refused here, in milliseconds, with one line.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from iris.client import InvalidJob, IrisClient, prepare_submission
from iris.config import ConfigError, load_config

VENV_BIN = Path(sys.executable).parent


def test_a_first_argument_ending_in_py_runs_with_python(tmp_path: Path) -> None:
    (tmp_path / "train.py").write_text("print(1)\n")
    spec, bundle = prepare_submission(["train.py", "--lr", "3e-4"], workdir=tmp_path)
    assert spec.command == ["python", "train.py", "--lr", "3e-4"]
    assert bundle is not None and spec.bundle == bundle.ref
    assert spec.name.startswith("train-")
    # An interpreter named by the user is kept as given.
    spec, _ = prepare_submission(["python3.12", "train.py"], workdir=tmp_path)
    assert spec.command == ["python3.12", "train.py"]


def test_a_script_the_workspace_does_not_ship_is_refused(tmp_path: Path) -> None:
    (tmp_path / "train.py").write_text("print(1)\n")
    (tmp_path / ".irisignore").write_text("train.py\n")
    with pytest.raises(InvalidJob, match=r"^train.py is not in the workspace .*nothing was started$"):
        prepare_submission(["train.py"], workdir=tmp_path)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(InvalidJob, match=r"eval\.py is not in the workspace"):
        prepare_submission(["python", "eval.py"], workdir=empty)
    # Without a workspace, or with an absolute path, the script is the cluster's business.
    spec, bundle = prepare_submission(["train.py"], workdir=None)
    assert bundle is None and spec.bundle is None and spec.command == ["python", "train.py"]
    spec, _ = prepare_submission(["python", "/opt/app/train.py"], workdir=tmp_path)
    assert spec.command == ["python", "/opt/app/train.py"]


def test_an_empty_workspace_ships_no_bundle(tmp_path: Path) -> None:
    spec, bundle = prepare_submission(["echo", "hi"], workdir=tmp_path)
    assert bundle is None and spec.bundle is None


def test_cluster_names_the_home_cluster_only() -> None:
    cfg = load_config()
    cfg.check_cluster("marin")
    with pytest.raises(ConfigError, match=r"unknown cluster 'nowhere' \(clusters in this config: marin, "):
        cfg.check_cluster("nowhere")
    with pytest.raises(ConfigError, match=r"is a peer in this federation.*use --cluster=marin"):
        cfg.check_cluster("cw-rno2a")


@pytest.mark.parametrize("name", ["nowhere", "cw-us-east-02a"])
def test_the_sdk_refuses_another_cluster_before_connecting(name: str) -> None:
    with pytest.raises(InvalidJob, match=repr(name)):
        IrisClient(cluster=name)


def _iris_offline(args: list[str], **env: str) -> subprocess.CompletedProcess[str]:
    """The CLI with TEMPORAL_ADDRESS pointing nowhere: a command that got past its checks would
    fail differently."""
    return subprocess.run(
        [str(VENV_BIN / "iris"), *args],
        capture_output=True,
        text=True,
        env={"PATH": str(VENV_BIN), "TEMPORAL_ADDRESS": "127.0.0.1:9", **env},
        timeout=60,
    )


@pytest.mark.parametrize("args", [["rpc", "controller", "list-peers"], ["job", "list"], ["peers"]])
def test_the_cli_refuses_an_unknown_cluster_in_one_line_before_anything_runs(args: list[str]) -> None:
    res = _iris_offline(["--cluster=nowhere", *args])
    assert res.returncode == 2, res.stderr
    assert res.stdout == ""
    assert res.stderr.strip().splitlines() == [
        "error: unknown cluster 'nowhere' (clusters in this config: marin, cw-us-east-02a, cw-rno2a)"
    ]


# ---- job ids never take an internal workflow's id (issue 16) --------------------------------------


@pytest.mark.parametrize(
    ("user", "name"),
    [("iris-placement-manager", "iris-federation"), ("iris-placement-manager@corp.example", "x")],
)
def test_the_sdk_refuses_a_job_id_that_is_an_internal_workflow_id(user: str, name: str) -> None:
    # iris-placement-manager/iris-federation is the placement manager's workflow id: a job holding
    # it would keep the manager from ever starting.
    with pytest.raises(InvalidJob, match="reserved for the federation's own workflows"):
        prepare_submission(["true"], workdir=None, user=user, name=name)
    # Any other user may use the same name.
    spec, _ = prepare_submission(["true"], workdir=None, user="alice", name=name)
    assert spec.job_id == f"alice/{name}"


def test_the_cli_refuses_the_placement_managers_id_in_one_line_before_anything_runs() -> None:
    res = _iris_offline(
        ["job", "run", "--no-workdir", "--job-name", "iris-federation", "--", "true"],
        IRIS_USER="iris-placement-manager",
    )
    assert res.returncode == 2, res.stderr
    assert res.stdout == ""
    assert res.stderr.strip().splitlines() == [
        "error: invalid job id 'iris-placement-manager/iris-federation': it is reserved for the "
        "federation's own workflows; choose another --job-name"
    ]
