"""The one real Ray head of a test process, shared by every test that uses Ray.

Starting a head costs 14–17 s and stopping one up to 40 s on this machine, so the session starts one
(``ray_head`` in tests/conftest.py) and stops it after the last test; every Ray user of the suite
sends its tests to the same test process (the ``ray`` xdist group, tests/conftest.py). Users keep
apart by resource name: the Ray-backed stack (``ray_stack``) its peers' ``<cluster>/h100``, the Ray
backend tests (tests/ray) one ``t-<scenario>/h100`` per scenario, the Ray preemption tests
(tests/preemption) one ``t-preempt-<test>/h100`` per test. So no test sees another's jobs in its
capacity. Job ids stay unique across all of them: Ray keeps every submission id it was given.
Only this head is ever stopped, never with ``ray stop``, which would end everyone's Ray.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

from iris import devstack
from iris.config import FederationConfig, load_config

PROJECT_ROOT = Path(__file__).resolve().parents[1]
RAY_STACK_CONFIG = PROJECT_ROOT / "config" / "clusters-ray.toml"

# The Ray backend tests' scenarios (tests/ray), each with its resource's size.
SCENARIOS = {"jobs": 16, "cap": 8, "down": 8, "restart": 8, "e2e": 8}
# The Ray preemption tests (tests/preemption/test_ray_preemption.py), each on PREEMPT_CHIPS of its own.
PREEMPT_TESTS = ("youngest", "fewest", "bands", "grace", "restart")
PREEMPT_CHIPS = 8
# Logical CPUs of the head: 4 for the stack's peers (every replica reserves its backend's ray_cpus,
# 0.1), 4 for the backend tests, 8 for the preemption tests; Ray does not bind them to cores.
HEAD_CPUS = 16


def resource(scenario: str) -> str:
    return f"t-{scenario}/h100"


def preempt_resource(test: str) -> str:
    return f"t-preempt-{test}/h100"


def on_ray_head(cfg: FederationConfig, spec: devstack.RayHeadSpec) -> None:
    """Point every Ray backend of ``cfg`` at ``spec``'s head (in place); their resource names stay."""
    for c in cfg.clusters:
        for b in c.backends:
            if b.kind == "ray":
                b.address = spec.address
                b.gcs_address = spec.gcs_address


def stack_resources() -> dict[str, float]:
    """What the Ray-backed stack's peers declare (config/clusters-ray.toml), by resource name."""
    cfg = load_config(RAY_STACK_CONFIG)
    (spec,) = devstack.ray_heads_for(cfg)
    return dict(spec.resources)


def session_resources() -> dict[str, float]:
    return {
        **stack_resources(),
        **{resource(s): float(n) for s, n in SCENARIOS.items()},
        **{preempt_resource(t): float(PREEMPT_CHIPS) for t in PREEMPT_TESTS},
    }


@contextlib.contextmanager
def local_head(resources: dict[str, float], num_cpus: int, root: Path) -> Iterator[devstack.RayHeadSpec]:
    """A real Ray head of the caller's own, on free ports, with these custom resources; stopped
    (only this head, never ``ray stop``) when the block ends."""
    spec = devstack.RayHeadSpec(
        dashboard_port=devstack.free_port(),
        gcs_port=devstack.free_port(),
        resources=resources,
        num_cpus=num_cpus,
    )
    head = devstack.ray_head(spec, root)
    head.start()
    try:
        head.wait_ready(120)
        yield spec
    finally:
        devstack.stop_ray_head(head)
