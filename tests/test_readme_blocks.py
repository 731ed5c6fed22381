"""Every README block is a test (issue 27; tests/readme.py): each fenced block names the test that
owns it, and each owner exists and names its block. The examples are run and compared by
tests/e2e/test_readme.py; the blocks that are not commands to run here (the CLI's synopsis, the data
flow, the metrics and tracing samples, a Ray backend, a deployment's worker command) are checked
against the code they describe, and the matcher itself is checked on small cases.
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import readme
import typer
from typer._click.core import Command, Context

from cli.app import app
from iris import contract, devstack, metrics, tracing
from iris.config import BackendConfig, load_config

IRIS = Path(sys.executable).parent / "iris"


def _test_functions(path: Path) -> dict[str, str]:
    """Each test function of a file, with its source."""
    source = path.read_text()
    tree = ast.parse(source)
    return {
        node.name: ast.get_source_segment(source, node) or ""
        for node in tree.body
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name.startswith("test_")
    }


def test_every_block_names_a_test_that_exists_and_names_it() -> None:
    blocks = readme.blocks()
    assert len(blocks) >= 20
    unowned = [f"README.md:{b.line} ({b.lang or 'plain'})" for b in blocks if b.name is None]
    assert not unowned, (
        f"blocks with no '<!-- block: NAME · test: FILE::TEST -->' line before them: {unowned}"
    )
    names = [b.name for b in blocks]
    assert len(set(names)) == len(names), names
    for b in blocks:
        assert b.test is not None and b.name is not None
        file, _, func = b.test.partition("::")
        functions = _test_functions(readme.PROJECT_ROOT / file)
        assert func in functions, f"{b.name}: no test {b.test}"
        # The owner (or the helper it calls) reads its block by name.
        module = (readme.PROJECT_ROOT / file).read_text()
        assert f'"{b.name}"' in functions[func] or f'"{b.name}"' in module, f"{b.test} never reads {b.name!r}"


def test_a_changed_output_fails_and_an_interleaving_passes() -> None:
    (cmd,) = readme.commands(
        "$ run \\\n    --flag x\nalice/id-1a2b3c\n12:00:01 RUNNING  on a\nout\n…\n12:00:02 DONE  ok\n"
    )
    assert cmd.command == "run --flag x"
    err = "13:14:15 RUNNING   on a\n13:14:16 QUEUED x\n13:14:17 DONE ok\n"
    readme.check_output(cmd, "alice/id-9f8e7d\nout\n", err)  # times, suffix and spacing normalised; … spans
    with pytest.raises(AssertionError, match="is not what it prints now"):
        readme.check_output(cmd, "alice/id-9f8e7d\nout changed\n", err)
    with pytest.raises(AssertionError):  # stdout's own order is kept
        readme.check_output(readme.commands("$ x\na\nb\n")[0], "b\na\n", "")
    with pytest.raises(AssertionError):  # nothing left over
        readme.check_output(readme.commands("$ x\na\n")[0], "a\nextra\n", "")
    assert readme.interleaves(["a", "x", "b"], ["a", "b"], ["x"])
    (multi,) = readme.commands("$ python -c '\nprint(1)\n\nprint(2)'\n1\n2\n")
    assert multi.command == "python -c '\nprint(1)\n\nprint(2)'" and multi.output == ["1", "2"]


def test_the_doctor_block_is_what_iris_doctor_prints() -> None:
    (cmd,) = readme.commands(readme.block("doctor").text)
    assert cmd.command == "uv run iris doctor"
    res = subprocess.run([str(IRIS), "doctor"], capture_output=True, text=True, timeout=120)
    lines = res.stdout.splitlines()
    missing = [line for line in lines if line.startswith("MISSING")]
    if missing:
        pytest.skip(f"iris doctor finds something missing here: {missing[0]}")
    assert res.returncode == 0, res.stdout
    # The check and its name; the third column is this machine's paths.
    assert [line.split()[:2] for line in lines] == [line.split()[:2] for line in cmd.output]


def test_the_two_commands_are_the_cli_and_the_suite() -> None:
    lines = [line.split("#")[0].strip() for line in readme.block("two-commands").text.splitlines()]
    assert lines == ["uv run iris dev", "uv run pytest", 'uv run pytest -m "not e2e"']
    assert subprocess.run([str(IRIS), "dev", "--help"], capture_output=True, timeout=60).returncode == 0
    pyproject = tomllib.loads((readme.PROJECT_ROOT / "pyproject.toml").read_text())
    markers = pyproject["tool"]["pytest"]["ini_options"]["markers"]
    assert any(m.startswith("e2e:") for m in markers)


def _command(path: list[str]) -> Command:
    cmd: Command = typer.main.get_command(app)
    ctx = Context(cmd)
    for word in path:
        assert hasattr(cmd, "get_command"), f"iris {' '.join(path)}: {cmd.name} has no subcommands"
        sub = cmd.get_command(ctx, word)
        assert sub is not None, f"iris {' '.join(path)}: no command {word!r}"
        cmd = sub
    return cmd


def _options(cmd: Command) -> set[str]:
    return {o for p in cmd.params for o in (*p.opts, *p.secondary_opts)}


def test_the_usage_synopsis_names_real_commands_and_options() -> None:
    entries: list[str] = []
    for line in readme.block("usage").text.splitlines():
        text = line.split("  #")[0]
        if text.startswith("iris "):
            entries.append(text)
        elif text.strip().startswith("["):
            entries[-1] += " " + text.strip()
    assert len(entries) >= 13
    for entry in entries:
        words = entry.split()[1:]
        if words[0].startswith("["):  # the root line: global options
            commands = [typer.main.get_command(app)]
        else:
            base = [words[0]]
            group = _command(base)
            rest = words[1:]
            if hasattr(group, "get_command") and rest:
                # `keys generate CLUSTER | ensure [...]`: two subcommands on one line.
                names = [rest[0]] + ([rest[3]] if len(rest) > 3 and rest[2] == "|" else [])
                commands = [_command([*base, n]) for n in names]
            else:
                commands = [group]
        known = set().union(*(_options(c) for c in commands))
        for option in re.findall(r"(?<![\w-])(--?[a-z][\w-]*)", entry):
            if option == "--":
                continue
            assert option in known, f"`{entry}`: iris has no {option} there"


def test_the_data_flow_names_real_activities_and_messages() -> None:
    text = readme.block("data-flow").text
    names = {v for k, v in vars(contract).items() if k.isupper() and isinstance(v, str)}
    shown = ["fetch_reports", "promote_job", "check_artifacts", "stage_bundle", "launch_job"]
    shown += ["mirror_job", "place", "explain", "cancel_job", "JobWorkflow", "PlacementManager"]
    for name in shown:
        assert name in text and name in names, name


def test_the_workers_block_is_a_valid_worker_command() -> None:
    cmds = readme.commands(readme.block("workers").text)
    assert cmds[0].command.startswith("export IRIS_STORE_URL=postgresql+psycopg://")
    words = cmds[1].command.split("#")[0].split()
    assert words[:3] == ["uv", "run", "iris"] and words[5] == "worker"
    assert "--config" in _options(typer.main.get_command(app))
    res = subprocess.run([str(IRIS), *words[3:], "--help"], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr


def test_the_metrics_blocks_name_what_the_stack_serves() -> None:
    cfg = load_config()
    targets = devstack.metrics_targets(cfg, "127.0.0.1:9464", 9465)
    endpoints = readme.block("metrics-endpoints").text
    for t in targets:
        assert re.search(rf"{re.escape(t.url)}\s+{re.escape(t.name)}\b", endpoints), t
    exported = {v for k, v in vars(metrics).items() if k.isupper() and isinstance(v, str)}
    shown = set(
        re.findall(r"^(iris_\w+?)(?:_count|_bucket|_sum)?[{ ]", readme.block("metrics-curl").text, re.M)
    )
    assert shown and shown <= exported, shown - exported
    jobs = {t.job for t in targets}
    for line in readme.block("metrics-targets").text.splitlines():
        assert line.split()[0] in jobs and line.endswith(" up"), line


def test_the_tracing_blocks_name_real_services_and_spans() -> None:
    tree = readme.block("tracing-tree").text
    services = set(re.findall(r"\[([\w-]+)\]", tree))
    cfg = load_config()
    known = {tracing.CLIENT_SERVICE, tracing.WORKER_SERVICE} | {
        tracing.controller_service(c) for c in cfg.cluster_names
    }
    assert services and services <= known, services - known
    activities = set(re.findall(r"(?:Start|Run)Activity:(\w+)", tree))
    assert activities and activities <= {v for v in vars(contract).values() if isinstance(v, str)}
    (cmd,) = readme.commands(readme.block("tracing-run").text)
    assert cmd.command.startswith("uv run iris job run --job-name hello-traced")


def test_the_ray_backend_block_is_a_valid_backend() -> None:
    data = tomllib.loads(readme.block("ray-backend").text)
    (backend,) = data["clusters"]["backends"]
    parsed = BackendConfig.model_validate(backend)
    assert parsed.kind == "ray" and parsed.ray_resource("h100") == "h100"


def test_no_block_is_left_to_a_placeholder_path() -> None:
    """The README's recorded paths are the checkout's: tests map them to their own directories."""
    for b in readme.blocks():
        for path in re.findall(r"(?<![\w.])/(?:home|tmp)/\S+", b.text):
            assert path.startswith("/home/you/"), f"{b.name}: a machine's own path {path}"
    assert os.sep == "/"
