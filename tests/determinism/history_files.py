"""Reading a committed history file (tests/determinism/histories/) back as the run it recorded.

A file holds only the events (``temporal workflow show -o json``), not the workflow id, and runs
with the checked-submissions patch compare their id with their spec's job id (a signed spec runs
only under its own id: docs/DESIGN.md, "User → home"). A JobWorkflow history is therefore replayed
under the job id its start input names; any other under the file's name, as before.
"""

from __future__ import annotations

import base64
import binascii
import json
from pathlib import Path
from typing import Any

from temporalio.client import WorkflowHistory


def recorded_workflow_id(data: dict[str, Any]) -> str | None:
    """The job id a JobWorkflow history's start input names, if it names one."""
    events = data.get("events") or [{}]
    start = events[0].get("workflowExecutionStartedEventAttributes", {})
    if start.get("workflowType", {}).get("name") != "JobWorkflow":
        return None
    try:
        spec = json.loads(base64.b64decode(start["input"]["payloads"][0]["data"]))
    except (KeyError, IndexError, TypeError, ValueError, binascii.Error):
        return None
    job_id = spec.get("job_id") if isinstance(spec, dict) else None
    return job_id if isinstance(job_id, str) else None


def load(path: Path) -> WorkflowHistory:
    data = json.loads(path.read_text())
    return WorkflowHistory.from_json(recorded_workflow_id(data) or path.stem, data)
