"""The shape of the job workflow's code (issue 28): where each kind of write may happen."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest
from pydantic import ValidationError

ROOT = Path(__file__).resolve().parents[2]
WORKFLOWS = ROOT / "workflows"
JOB = WORKFLOWS / "job"


def job_modules() -> list[Path]:
    return sorted(JOB.rglob("*.py"))


def calls_of(tree: ast.AST, attr: str) -> list[int]:
    """Lines of every call ``<something>.<attr>(...)``."""
    return [
        node.lineno
        for node in ast.walk(tree)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == attr
    ]


def test_only_the_versions_module_asks_a_patch() -> None:
    askers = {
        path.relative_to(WORKFLOWS).as_posix()
        for path in sorted(WORKFLOWS.rglob("*.py"))
        if calls_of(ast.parse(path.read_text()), "patched")
    }
    assert askers == {"versions.py"}


DESIGN = ROOT / "docs" / "DESIGN.md"


def design_phase_table() -> dict[str, tuple[set[str], set[str]]]:
    """docs/DESIGN.md's "The phase machine" table: phase -> (states it shows, phases it may go to)."""
    text = DESIGN.read_text()
    section = text.split("### The phase machine", 1)[1].split("\n#", 1)[0]
    rows: dict[str, tuple[set[str], set[str]]] = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 3 or not cells[0].startswith("`"):
            continue

        def words(cell: str) -> set[str]:
            return {w.strip() for w in cell.split("·") if w.strip() not in ("", "—")}

        rows[cells[0].strip("`")] = (words(cells[1]), words(cells[2]))
    return rows


def test_the_transition_table_is_the_one_in_design_md() -> None:
    from workflows.job.transitions import NEXT, SHOWS

    code = {phase.value: ({s.value for s in SHOWS[phase]}, {n.value for n in NEXT[phase]}) for phase in NEXT}
    assert design_phase_table() == code


def test_only_the_transitions_module_assigns_a_job_state() -> None:
    """``status.state`` (or ``st.state`` of a status) is assigned in workflows/job/transitions.py only."""
    writers = set()
    for path in job_modules():
        for node in ast.walk(ast.parse(path.read_text())):
            targets = node.targets if isinstance(node, ast.Assign) else []
            targets += [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
            for target in targets:
                for sub in ast.walk(target):
                    if isinstance(sub, ast.Attribute) and sub.attr == "state":
                        writers.add(path.relative_to(JOB).as_posix())
    assert writers == {"transitions.py"}


def test_only_the_ends_module_records_an_attempts_end() -> None:
    """An attempt's ``end`` is written in workflows/job/ends.py only, as an AttemptEnd's value or
    NOT_DELIVERED."""
    writers = set()
    for path in job_modules():
        for node in ast.walk(ast.parse(path.read_text())):
            targets = node.targets if isinstance(node, ast.Assign) else []
            for target in targets:
                for sub in ast.walk(target):
                    if isinstance(sub, ast.Attribute) and sub.attr == "end":
                        writers.add(path.relative_to(JOB).as_posix())
    assert writers == {"ends.py"}


def test_an_attempts_end_reads_back_whatever_a_run_wrote() -> None:
    """Every string a run has written as an attempt's end (NOT_DELIVERED included, written before
    it was an AttemptEnd) reads back as its AttemptEnd, and is written back as the same string, so
    recorded histories replay; any other string is refused (issue 28)."""
    from iris.jobs import AttemptEnd, AttemptView
    from workflows.job.ends import ending

    base = {"number": 1, "cluster": "cw-a", "backend_id": "b", "nonce": "n", "started_ms": 0}
    assert ending(AttemptView.model_validate(base)) is None
    for word in ("SUCCEEDED", "FAILED", "TIMEOUT", "KILLED", "PREEMPTED", "NOT_DELIVERED"):
        view = AttemptView.model_validate_json(json.dumps({**base, "end": word}))
        assert ending(view) is AttemptEnd(word)
        assert json.loads(view.model_dump_json())["end"] == word
    with pytest.raises(ValidationError):
        AttemptView.model_validate({**base, "end": "LOST"})


# Acceptance 1 of issue 28: the workflows read by state, in small pieces.
MAX_FILE_LINES = 400
MAX_FUNCTION_LINES = 50


def test_no_workflow_module_is_longer_than_400_lines() -> None:
    lengths = {
        p.relative_to(ROOT).as_posix(): len(p.read_text().splitlines()) for p in WORKFLOWS.rglob("*.py")
    }
    assert {p: n for p, n in lengths.items() if n > MAX_FILE_LINES} == {}


def long_functions(source: str) -> dict[str, int]:
    """The functions and methods of ``source`` longer than MAX_FUNCTION_LINES, decorators and
    docstring included, with their lengths."""
    found = {}
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            start = min([d.lineno for d in node.decorator_list] + [node.lineno])
            assert node.end_lineno is not None
            if node.end_lineno - start + 1 > MAX_FUNCTION_LINES:
                found[node.name] = node.end_lineno - start + 1
    return found


def test_no_workflow_function_is_longer_than_50_lines() -> None:
    long = {p.relative_to(ROOT).as_posix(): long_functions(p.read_text()) for p in WORKFLOWS.rglob("*.py")}
    assert {p: f for p, f in long.items() if f} == {}


def test_the_size_check_sees_a_long_function() -> None:
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION_LINES))
    assert long_functions(f"@decorated\ndef f() -> None:\n{body}\n") == {"f": MAX_FUNCTION_LINES + 2}
    assert long_functions(f"def f() -> None:\n{body[: body.rindex(chr(10))]}\n") == {}


def test_no_exception_steers_the_lifecycle() -> None:
    """No private exception class (``_Ended``, ``_Parked``, ``_Adopted`` before issue 28) is
    raised anywhere under workflows/, and the Carry is gone."""
    for path in WORKFLOWS.rglob("*.py"):
        tree = ast.parse(path.read_text())
        raised = [
            ast.unparse(n.exc)
            for n in ast.walk(tree)
            if isinstance(n, ast.Raise) and n.exc is not None and ast.unparse(n.exc).startswith("_")
        ]
        assert raised == [], path
        classes = {n.name for n in ast.walk(tree) if isinstance(n, ast.ClassDef)}
        assert not classes & {"Carry", "_Ended", "_Parked", "_Adopted", "_Job"}, path
