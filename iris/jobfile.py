"""Job files: a job described in YAML or JSON (`iris job run -f job.yaml`).

The file holds what the flags of `iris job run` say, grouped::

    name: train-llama
    command: [python, train.py, --epochs, "3"]
    workdir: .                 # relative to this file; null ships no workspace
    priority: interactive      # production | interactive | batch
    resources: {device_type: gpu, device_variant: h100, gpu_count: 8, replicas: 1}
    constraints: {target_cluster: cw-rno2a, region: us-east, preemptible: false}
    env: {WANDB_MODE: offline}
    artifacts: [s3://datasets/tokens/shard-0]
    retries: {failure: 1, preemption: 2}
    timeout: 2h                # each attempt's wall-clock limit (90s, 10m, 2h, 1d or seconds)
    scheduling_timeout: 30m    # give up if not placed within

:class:`JobFile` is the model; unknown fields are refused. Flags given on the command line override
the file's values (``--env`` adds or replaces single variables). Its JSON Schema is
``docs/job.schema.json``, regenerated with ``uv run python -m iris.jobfile``; a test checks that
the file matches the model. From Python::

    from iris.jobfile import load_job_file
    job_id = client.submit(**load_job_file("job.yaml").submission())  # workdir: the file's directory
"""

from __future__ import annotations

import json
import shlex
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, Literal, TypeAlias

import yaml
from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    WithJsonSchema,
)

from iris.jobs import MAX_RETRIES, MAX_TIMEOUT_S

SCHEMA_PATH = Path(__file__).resolve().parents[1] / "docs" / "job.schema.json"
# The largest job file read: a job is a few lines; anything this big is not one.
MAX_FILE_BYTES = 1024 * 1024
MAX_SCHEDULING_TIMEOUT_S = 30 * 86400
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


class JobFileError(ValueError):
    """A job file that cannot be used; ``str()`` is one line naming the file and the field."""


def parse_duration(value: object) -> float:
    """``90s``, ``10m``, ``2h``, ``1d`` or a number of seconds, as seconds; ValueError otherwise."""
    if isinstance(value, bool):
        raise ValueError("expected a duration such as 90s, 10m, 2h or 1d")
    if isinstance(value, int | float):
        seconds = float(value)
    elif isinstance(value, str):
        text = value.strip().lower()
        try:
            unit = _UNITS.get(text[-1:], 0)
            seconds = float(text[:-1]) * unit if unit else float(text)
        except ValueError:
            raise ValueError(f"invalid duration {value[:40]!r}: use e.g. 90s, 10m, 2h, 1d") from None
    else:
        raise ValueError("expected a duration such as 90s, 10m, 2h or 1d")
    return seconds  # the range (NaN and infinity are outside every one) is the caller's to check


def _within(max_s: float) -> Callable[[float], float]:
    """A duration's check: above 0 and at most ``max_s`` seconds."""

    def check(seconds: float) -> float:
        if not 0 < seconds <= max_s:
            got = (
                f"{seconds / 86400:g} days"
                if seconds >= 86400 and seconds != float("inf")
                else f"{seconds:g}s"
            )
            raise ValueError(f"must be more than 0s and at most {max_s / 86400:g} days, got {got}")
        return seconds

    return check


def _duration_schema(max_s: float) -> dict[str, Any]:
    return {
        "anyOf": [
            {"type": "number", "exclusiveMinimum": 0, "maximum": max_s},
            {"type": "string", "pattern": r"^\s*[0-9]+(\.[0-9]+)?\s*[smhdSMHD]?\s*$"},
        ],
        "description": "seconds, or a number with a unit: 90s, 10m, 2h, 1d",
    }


Timeout: TypeAlias = Annotated[
    float,
    BeforeValidator(parse_duration),
    AfterValidator(_within(MAX_TIMEOUT_S)),
    WithJsonSchema(_duration_schema(MAX_TIMEOUT_S)),
]
SchedulingTimeout: TypeAlias = Annotated[
    float,
    BeforeValidator(parse_duration),
    AfterValidator(_within(MAX_SCHEDULING_TIMEOUT_S)),
    WithJsonSchema(_duration_schema(MAX_SCHEDULING_TIMEOUT_S)),
]
_TEXT_OR_NUMBER = {"anyOf": [{"type": "string"}, {"type": "number"}]}
_COMMAND_SCHEMA = {
    "anyOf": [
        {"type": "array", "items": _TEXT_OR_NUMBER, "minItems": 1},
        {"type": "string", "minLength": 1},
    ],
    "description": "the command: a list of arguments, or one string split as a shell would",
}
_ENV_SCHEMA = {"type": "object", "additionalProperties": _TEXT_OR_NUMBER}


def _numbers_as_text(value: object) -> object:
    """YAML reads ``3`` and ``1e-4`` as numbers; as an argument or a variable they are text."""
    if isinstance(value, int | float) and not isinstance(value, bool):
        return str(value)
    return value


def _command(value: object) -> object:
    """A command given as one string is split as a shell would (``python train.py --lr 3e-4``)."""
    if isinstance(value, str):
        try:
            return shlex.split(value)
        except ValueError as exc:
            raise ValueError(f"cannot split the command: {exc}") from None
    if isinstance(value, list):
        return [_numbers_as_text(v) for v in value]
    return value


def _env(value: object) -> object:
    if isinstance(value, dict):
        return {k: _numbers_as_text(v) for k, v in value.items()}
    return value


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", str_strip_whitespace=True)


class Resources(_Strict):
    """What the job runs on: ``replicas`` x ``gpu_count`` devices on one backend."""

    device_type: str | None = Field(default=None, description="cpu, gpu, tpu, or a variant such as h100")
    device_variant: str | None = Field(default=None, description="e.g. h100")
    gpu_count: int = Field(default=0, ge=0, description="devices per replica")
    replicas: int = Field(default=1, ge=1, description="replicas, all on one backend")


class Constraints(_Strict):
    """Where the job may run."""

    target_cluster: str | None = Field(default=None, description="pin the job to this cluster")
    region: str | None = None
    zone: str | None = None
    preemptible: bool | None = None


class Retries(_Strict):
    """More attempts after one that failed (a replica exited non-zero) or one its cluster lost."""

    failure: int = Field(default=0, ge=0, le=MAX_RETRIES)
    preemption: int = Field(default=1, ge=0, le=MAX_RETRIES)


class JobFile(_Strict):
    """An Iris job (`iris job run -f FILE`): the same fields as the flags of `iris job run`."""

    model_config = ConfigDict(
        title="Iris job",
        json_schema_extra={"$schema": "https://json-schema.org/draft/2020-12/schema"},
    )

    name: str | None = Field(default=None, description="job name; its id is <user>/<name>")
    command: Annotated[list[str], BeforeValidator(_command), WithJsonSchema(_COMMAND_SCHEMA)] = Field(
        min_length=1
    )
    workdir: str | None = Field(
        default=".",
        description="the workspace shipped with the job, relative to this file; null ships none",
    )
    priority: Literal["production", "interactive", "batch"] = "interactive"
    resources: Resources = Resources()
    constraints: Constraints = Constraints()
    env: Annotated[dict[str, str], BeforeValidator(_env), WithJsonSchema(_ENV_SCHEMA)] = Field(
        default_factory=dict, description="environment variables of the job"
    )
    artifacts: list[str] = Field(default_factory=list, description="gs://… or s3://… that must exist")
    retries: Retries = Retries()
    timeout: Timeout | None = Field(
        default=None, description="each attempt's wall-clock limit; never retried"
    )
    scheduling_timeout: SchedulingTimeout | None = Field(
        default=None, description="give up if not placed within"
    )

    # The directory of the file it was read from: a relative workdir is relative to it.
    _base: Path | None = PrivateAttr(default=None)

    def submission(self, base: Path | None = None) -> dict[str, Any]:
        """The keyword arguments of ``prepare_submission`` (and ``AsyncIrisClient.submit``):
        ``command``, ``workdir`` (resolved against ``base``, by default the directory of the file
        it was read from) and ``build_spec``'s options."""
        base = base if base is not None else self._base
        workdir: Path | None = None
        if self.workdir is not None:
            workdir = Path(self.workdir).expanduser()
            if not workdir.is_absolute() and base is not None:
                workdir = base / workdir
        r, c = self.resources, self.constraints
        return {
            "command": list(self.command),
            "workdir": workdir,
            "name": self.name,
            "device_type": r.device_type,
            "device_variant": r.device_variant,
            "gpu_count": r.gpu_count,
            "replicas": r.replicas,
            "priority": self.priority,
            "target_cluster": c.target_cluster,
            "region": c.region,
            "zone": c.zone,
            "preemptible": c.preemptible,
            "artifacts": list(self.artifacts),
            "env": dict(self.env),
            "scheduling_timeout_s": self.scheduling_timeout,
            "max_retries_failure": self.retries.failure,
            "max_retries_preemption": self.retries.preemption,
            "timeout_s": self.timeout,
        }


def _field_path(loc: tuple[int | str, ...]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "(the file)"


def _allowed(loc: tuple[int | str, ...]) -> list[str]:
    """The fields allowed where an unknown one was found."""
    model: type[BaseModel] = JobFile
    for part in loc[:-1]:
        field = model.model_fields.get(str(part))
        annotation = field.annotation if field is not None else None
        if not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
            return []
        model = annotation
    return list(model.model_fields)


def one_line(error: ValidationError) -> str:
    """The first problem of a validation error, naming its field; how many more there are."""
    errors = error.errors(include_url=False)
    first = errors[0]
    loc = tuple(first["loc"])
    if first["type"] == "extra_forbidden":
        allowed = _allowed(loc)
        message = "unknown field" + (f" (allowed here: {', '.join(allowed)})" if allowed else "")
    else:
        message = first["msg"]
        if message.startswith("Value error, "):
            message = message[len("Value error, ") :]
    more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
    return f"{_field_path(loc)}: {message}{more}"


def parse_job(data: object, source: str = "job file") -> JobFile:
    """A job file's parsed content as a JobFile; JobFileError (one line) if it is not one."""
    if not isinstance(data, dict):
        raise JobFileError(f"{source}: expected a mapping of fields (command, resources, ...)")
    try:
        return JobFile.model_validate(data)
    except ValidationError as exc:
        raise JobFileError(f"{source}: {one_line(exc)}") from None


def load_job_file(path: str | Path) -> JobFile:
    """Read a job file, YAML or JSON (by content: JSON is read as YAML unless it ends in .json)."""
    p = Path(path)
    try:
        size = p.stat().st_size
        if size > MAX_FILE_BYTES:
            raise JobFileError(f"{p}: larger than {MAX_FILE_BYTES // 1024} KiB; not a job file")
        text = p.read_text(encoding="utf-8")
    except OSError as exc:
        raise JobFileError(f"cannot read job file {p}: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise JobFileError(f"{p}: not UTF-8 text") from None
    try:
        data = json.loads(text) if p.suffix.lower() == ".json" else yaml.safe_load(text)
    except json.JSONDecodeError as exc:
        raise JobFileError(f"{p}: not valid JSON: {exc.msg} (line {exc.lineno})") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" (line {mark.line + 1})" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise JobFileError(f"{p}: not valid YAML: {problem}{where}") from None
    job = parse_job(data, str(p))
    job._base = p.resolve().parent
    return job


def schema_text() -> str:
    """docs/job.schema.json as it must read: the model's JSON Schema."""
    return json.dumps(JobFile.model_json_schema(), indent=2, ensure_ascii=False) + "\n"


def main(argv: list[str] | None = None) -> int:
    """``python -m iris.jobfile``: write docs/job.schema.json; ``--check``: fail if it is stale."""
    args = sys.argv[1:] if argv is None else argv
    if args == ["--check"]:
        current = SCHEMA_PATH.read_text(encoding="utf-8") if SCHEMA_PATH.exists() else ""
        if current != schema_text():
            print(f"{SCHEMA_PATH} is stale: run `uv run python -m iris.jobfile`", file=sys.stderr)
            return 1
        return 0
    if args:
        print("usage: python -m iris.jobfile [--check]", file=sys.stderr)
        return 2
    SCHEMA_PATH.write_text(schema_text(), encoding="utf-8")
    print(f"wrote {SCHEMA_PATH}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
