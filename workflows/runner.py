"""The workflow sandbox the worker (and every replayer) runs our workflows in.

By default the sandbox re-imports a workflow's module, and everything it imports that is not
passed through, for every new run: for ``JobWorkflow`` that was about 18 ms of CPU per job, the
largest single cost of a job on the worker (issue 9). This package is passed through instead:
imported once, outside the sandbox. What the sandbox still does for it is refuse the
non-deterministic calls (clocks, randomness, I/O) at run time. What it no longer does is give each
run a fresh copy of this package's module globals, so they must hold nothing a run could change:
constants and read-only mappings only (``tests/determinism/test_determinism_module_state.py``).
"""

from __future__ import annotations

from temporalio.worker.workflow_sandbox import SandboxedWorkflowRunner, SandboxRestrictions

PASSED_THROUGH = ("workflows",)


def workflow_runner() -> SandboxedWorkflowRunner:
    return SandboxedWorkflowRunner(
        restrictions=SandboxRestrictions.default.with_passthrough_modules(*PASSED_THROUGH)
    )
