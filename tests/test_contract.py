"""The Temporal contract (iris/contract.py) is the one place its names are spelled.

The workflows and activities declare themselves under the contract's names; the worker registers
exactly the contract's activities; and no other module of the product writes one of those names
as a string (the SDK sends a job's messages by typed reference to the workflow's methods, and the
placement manager's Updates by the contract's names).
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any

from iris import contract
from iris.config import load_config
from iris.store import FederationStore
from worker.main import WORKFLOWS, job_activities
from workflows.job import JobWorkflow
from workflows.placement import PlacementManager

ROOT = Path(__file__).resolve().parents[1]
PRODUCT = ("iris", "workflows", "activities", "worker", "cli")
# A string that happens to equal a contract name but means something else.
NOT_TEMPORAL = {
    ("cli/job.py", "cancel"),  # the `iris job cancel` command's name
    ("iris/controller/metrics.py", "status"),  # the HTTP status label of the request counter
}


def _definition(fn: Any, kind: str) -> str:
    # Signals and queries carry their definition in a dunder, Updates in ``_defn`` (temporalio 1.35).
    attr = "_defn" if kind == "update" else f"__temporal_{kind}_definition"
    return str(getattr(fn, attr).name)


def test_workflows_declare_themselves_under_the_contracts_names() -> None:
    types = {getattr(w, "__temporal_workflow_definition").name for w in WORKFLOWS}
    assert types == set(contract.WORKFLOW_TYPES)
    messages = {
        _definition(JobWorkflow.place, "signal"),
        _definition(JobWorkflow.explain, "signal"),
        _definition(JobWorkflow.explain_reason, "signal"),
        _definition(JobWorkflow.expire, "signal"),
        _definition(JobWorkflow.cancel, "signal"),
        _definition(JobWorkflow.cancel_job, "update"),
        _definition(JobWorkflow.replay_handoff, "update"),
        _definition(JobWorkflow.status, "query"),
        _definition(JobWorkflow.observe, "signal"),
        _definition(JobWorkflow.want_logs, "signal"),
        _definition(PlacementManager.wake, "signal"),
        _definition(PlacementManager.last_tick, "query"),
        _definition(PlacementManager.queue_positions, "update"),
        _definition(PlacementManager.dry_run, "update"),
    }
    assert messages == set(contract.MESSAGE_NAMES)


def test_the_worker_registers_exactly_the_contracts_activities(tmp_path: Path) -> None:
    store = FederationStore(f"sqlite:///{tmp_path / 'federation.db'}")
    try:
        registered = job_activities(load_config(), store)
    finally:
        store.close()
    names = [getattr(fn, "__temporal_activity_definition").name for fn in registered]
    assert sorted(names) == sorted(contract.ACTIVITY_NAMES)


def _strings(tree: ast.AST) -> list[ast.Constant]:
    docstrings = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr):
            docstrings.add(id(body[0].value))
    excluded = set()
    for node in ast.walk(tree):  # __all__ lists Python names, not Temporal ones
        if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "__all__" for t in node.targets):
            excluded |= {id(c) for c in ast.walk(node.value)}
    return [
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant)
        and isinstance(node.value, str)
        and id(node) not in docstrings | excluded
    ]


def test_no_other_module_spells_a_contract_name() -> None:
    names = {
        *contract.MESSAGE_NAMES,
        *contract.ACTIVITY_NAMES,
        *contract.WORKFLOW_TYPES,
        *contract.ERROR_TYPES,
        *contract.SEARCH_ATTRIBUTES,
    }
    found = []
    for package in PRODUCT:
        for path in sorted((ROOT / package).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if rel == "iris/contract.py":
                continue
            for node in _strings(ast.parse(path.read_text())):
                if node.value in names and (rel, node.value) not in NOT_TEMPORAL:
                    found.append(f"{rel}:{node.lineno}: {node.value!r}")
                elif any(f"{sa} =" in node.value for sa in contract.SEARCH_ATTRIBUTES):
                    found.append(f"{rel}:{node.lineno}: a visibility query naming a search attribute")
    assert not found, "spell these through iris/contract.py:\n" + "\n".join(found)
