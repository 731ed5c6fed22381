"""Job files (`iris job run -f job.yaml`, iris/jobfile.py), with no service: the model, its JSON
Schema in docs/job.schema.json, and the one-line refusal of a file with an invalid field.

The CLI runs in this process through ``cli.app.main`` (its one-line errors and exit codes). A file
that is refused must be refused before anything is contacted: the config these tests point the CLI
at names a Temporal address where nothing listens, so a command that got that far would end with
exit 4 ("cannot reach Temporal"), not 2. Flags overriding a file's values are checked on the real
stack (tests/e2e/test_cli_ux.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from cli_main import iris

from iris import devstack
from iris.config import load_config
from iris.jobfile import SCHEMA_PATH, JobFile, JobFileError, load_job_file, parse_duration, schema_text

YAML_JOB = """\
name: train-llama
command: [python, train.py, --epochs, 3]
workdir: src
priority: batch
resources:
  device_type: gpu
  device_variant: h100
  gpu_count: 8
  replicas: 2
constraints: {target_cluster: cw-rno2a, region: us-east, preemptible: false}
env: {WANDB_MODE: offline, SEED: 7}
artifacts: [s3://datasets/tokens/shard-0]
retries: {failure: 1, preemption: 2}
timeout: 2h
scheduling_timeout: 30m
"""


def test_the_schema_file_matches_the_model() -> None:
    repo = Path(__file__).resolve().parents[1]
    assert repo / "docs" / "job.schema.json" == SCHEMA_PATH
    on_disk = SCHEMA_PATH.read_text(encoding="utf-8")
    assert on_disk == schema_text(), "docs/job.schema.json is stale: run `uv run python -m iris.jobfile`"
    schema = json.loads(on_disk)
    assert schema["additionalProperties"] is False
    assert schema["required"] == ["command"]
    assert set(schema["properties"]) == set(JobFile.model_fields)


def test_yaml_and_json_read_the_same_job(tmp_path: Path) -> None:
    as_yaml = tmp_path / "job.yaml"
    as_yaml.write_text(YAML_JOB)
    as_json = tmp_path / "job.json"
    as_json.write_text(json.dumps(yaml.safe_load(YAML_JOB)))
    # A relative workdir is relative to the file, wherever the reader runs.
    from_yaml = load_job_file(as_yaml).submission()
    assert load_job_file(as_json).submission() == from_yaml
    assert from_yaml == {
        "command": ["python", "train.py", "--epochs", "3"],
        "workdir": tmp_path / "src",
        "name": "train-llama",
        "device_type": "gpu",
        "device_variant": "h100",
        "gpu_count": 8,
        "replicas": 2,
        "priority": "batch",
        "target_cluster": "cw-rno2a",
        "region": "us-east",
        "zone": None,
        "preemptible": False,
        "artifacts": ["s3://datasets/tokens/shard-0"],
        "env": {"WANDB_MODE": "offline", "SEED": "7"},
        "scheduling_timeout_s": 1800.0,
        "max_retries_failure": 1,
        "max_retries_preemption": 2,
        "timeout_s": 7200.0,
    }


def test_defaults_a_command_string_and_no_workspace(tmp_path: Path) -> None:
    path = tmp_path / "job.yaml"
    path.write_text("command: python train.py --lr 3e-4 'a b'\nworkdir: null\n")
    kw = load_job_file(path).submission(base=tmp_path)
    assert kw["command"] == ["python", "train.py", "--lr", "3e-4", "a b"]
    assert kw["workdir"] is None
    assert (kw["priority"], kw["gpu_count"], kw["replicas"]) == ("interactive", 0, 1)
    assert (kw["max_retries_failure"], kw["max_retries_preemption"]) == (0, 1)
    assert kw["timeout_s"] is None and kw["env"] == {}


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("90s", 90.0), ("10m", 600.0), ("2h", 7200.0), ("1d", 86400.0), ("45", 45.0), (1.5, 1.5)],
)
def test_durations(text: object, seconds: float) -> None:
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["", "abc", "10x", True, None])
def test_invalid_durations(text: object) -> None:
    with pytest.raises(ValueError):
        parse_duration(text)


@pytest.fixture
def unreachable_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The demo config with Temporal where nothing listens: reaching it would be exit 4."""
    cfg = load_config()
    cfg.temporal.address = f"127.0.0.1:{devstack.free_port()}"
    path = tmp_path / "clusters.json"
    path.write_text(cfg.model_dump_json())
    monkeypatch.setenv("IRIS_CONFIG", str(path))
    return path


BAD_FILES = [
    ("job.yaml", "command: [python, t.py]\nresource: {gpu_count: 2}\n", "resource: unknown field"),
    ("job.yaml", "command: [python, t.py]\nresources: {gpu_cont: 2}\n", "resources.gpu_cont: unknown field"),
    ("job.yaml", "command: [python, t.py]\nresources: {gpu_count: many}\n", "resources.gpu_count: "),
    ("job.yaml", "command: [python, t.py]\ntimeout: soon\n", "timeout: invalid duration 'soon'"),
    ("job.yaml", "command: [python, t.py]\ntimeout: 400d\n", "timeout: must be more than 0s"),
    ("job.yaml", "command: [t.py]\nscheduling_timeout: nan\n", "scheduling_timeout: must be more than 0s"),
    ("job.yaml", "command: [python, t.py]\nretries: {failure: -1}\n", "retries.failure: "),
    ("job.yaml", "command: [python, t.py]\npriority: urgent\n", "priority: "),
    ("job.yaml", "command: [python, t.py]\nenv: {A: [1, 2]}\n", "env.A: "),
    ("job.yaml", "name: x\n", "command: Field required"),
    ("job.yaml", "- python\n- t.py\n", "expected a mapping of fields"),
    ("job.yaml", "command: [python, t.py\n", "not valid YAML"),
    ("job.json", '{"command": ["t.py"], "constraints": {"zone": 3}}', "constraints.zone: "),
    ("job.json", '{"command": ["python", "t.py"],}', "not valid JSON"),
]  # fmt: skip


@pytest.mark.parametrize(("name", "content", "expected"), BAD_FILES, ids=[e for _, _, e in BAD_FILES])
def test_a_file_with_an_invalid_field_is_one_line_and_exit_2(
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    unreachable_config: Path,
    name: str,
    content: str,
    expected: str,
) -> None:
    path = tmp_path / name
    path.write_text(content)
    (tmp_path / "t.py").write_text("print('hi')\n")
    code, out, err = iris(monkeypatch, capsys, "job", "run", "-f", str(path))
    assert code == 2, err
    assert out == ""
    assert err.count("\n") == 1, err
    assert err.startswith(f"error: {path}: ") and expected in err, err


def test_a_valid_file_gets_as_far_as_temporal(
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    unreachable_config: Path,
) -> None:
    """The counterpart of the refusals above: a good file passes every local check, so the command
    goes on to contact Temporal (here: nobody listens, exit 4)."""
    path = tmp_path / "job.yaml"
    path.write_text("command: [python, t.py]\nresources: {device_type: h100, gpu_count: 1}\n")
    (tmp_path / "t.py").write_text("print('hi')\n")
    code, _, err = iris(monkeypatch, capsys, "job", "run", "-f", str(path), "--no-wait")
    assert code == 4, err
    assert "cannot reach Temporal" in err


def test_a_missing_file_is_one_line() -> None:
    with pytest.raises(JobFileError, match=r"cannot read job file .*nowhere\.yaml"):
        load_job_file("nowhere.yaml")
