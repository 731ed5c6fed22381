"""A controller's Prometheus metrics, served at ``GET /metrics`` (docs/DESIGN.md, "Metrics").

Each app has a registry of its own (never prometheus_client's global one: several apps may share a
process, as in the tests). Names and label values are iris/metrics.py's. Every label value comes
from a bounded set: the configured backends and their device tokens, route templates (never a raw
path), HTTP methods and statuses, and the fixed outcomes and refusal reasons. Nothing names a job,
a user, a requester or a secret, so the endpoint needs no token.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4
from prometheus_client.registry import Collector
from starlette.routing import BaseRoute, Match
from starlette.types import Scope

from iris import metrics
from iris.config import ClusterConfig
from iris.controller.executors import BackendUnreachable, Executor
from iris.controller.models import ControllerJobState

# The media type of the exposition: Prometheus's text format 0.0.4, which every Prometheus reads
# (the library's newer default, 1.0.0, is the same text for these ASCII names).
CONTENT_TYPE = CONTENT_TYPE_PLAIN_0_0_4
# Methods counted by name; any other is ``other``.
METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})
UNMATCHED = "unmatched"
UNKNOWN_BACKEND = "unknown"


def route_template(scope: Scope, routes: list[BaseRoute]) -> str:
    """The template of the route that serves this request (e.g. ``/v1/jobs/{job_id:path}``), or
    ``unmatched``: the route the router chose, else the first that matches the path in full (a
    request answered before routing, e.g. a body too large)."""
    chosen = scope.get("route")
    path = getattr(chosen, "path", None)
    if isinstance(path, str):
        return path
    for route in routes:
        match, _ = route.matches(scope)
        if match is Match.FULL:
            found = getattr(route, "path", None)
            return found if isinstance(found, str) else UNMATCHED
    return UNMATCHED


class ControllerMetrics:
    """The counters a controller keeps, and the gauges read from its executor at each scrape.

    Counted here and exported by a collector of this registry alone: every counter is one
    ``<name>_total`` series per label set, without the ``_created`` twin prometheus_client's own
    Counter would add (a second name per counter that iris/metrics.py does not have)."""

    def __init__(self, cluster: ClusterConfig, executor: Callable[[], Executor | None]) -> None:
        self.registry = CollectorRegistry()
        self._backends = frozenset(b.id for b in cluster.backends)
        self.requests: dict[tuple[str, str, str], int] = {}
        # Every known series from the start (at 0), so a rate over the first one is right.
        self.launches: dict[tuple[str, str], int] = {
            (backend, outcome): 0 for backend in sorted(self._backends) for outcome in metrics.LAUNCH_OUTCOMES
        }
        self.refusals: dict[str, int] = dict.fromkeys(metrics.REFUSAL_REASONS, 0)
        self.registry.register(_Collector(self, executor))

    def request(self, method: str, route: str, status: int) -> None:
        key = (method if method in METHODS else "other", route, str(status))
        self.requests[key] = self.requests.get(key, 0) + 1

    def launched(self, backend_id: str, outcome: str) -> None:
        key = (backend_id if backend_id in self._backends else UNKNOWN_BACKEND, outcome)
        self.launches[key] = self.launches.get(key, 0) + 1

    def refused(self, reason: str) -> None:
        self.refusals[reason] = self.refusals.get(reason, 0) + 1

    def refused_launch(self, backend_id: str, reason: str) -> None:
        self.refused(reason)
        self.launched(backend_id, "refused")

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


class _Collector(Collector):
    """The counters, and running jobs and free devices read from the executor when scraped (none
    before it starts)."""

    def __init__(self, counts: ControllerMetrics, executor: Callable[[], Executor | None]) -> None:
        self._counts = counts
        self._executor = executor

    def collect(self) -> Iterator[Metric]:
        counts = self._counts
        requests = CounterMetricFamily(
            metrics.CONTROLLER_REQUESTS,
            "Requests answered, by method, route template and HTTP status",
            labels=["method", "route", "status"],
        )
        for (method, route, status), n in counts.requests.items():
            requests.add_metric([method, route, status], n)
        launches = CounterMetricFamily(
            metrics.CONTROLLER_LAUNCHES,
            "POST /v1/jobs that reached the launch handler, by backend and outcome",
            labels=["backend", "outcome"],
        )
        for (backend, outcome), n in counts.launches.items():
            launches.add_metric([backend, outcome], n)
        refusals = CounterMetricFamily(
            metrics.CONTROLLER_REFUSALS,
            "Requests refused by authentication or admission, by reason",
            labels=["reason"],
        )
        for reason, n in counts.refusals.items():
            refusals.add_metric([reason], n)
        yield requests
        yield launches
        yield refusals
        yield from self._executor_gauges()

    def _executor_gauges(self) -> Iterator[Metric]:
        running = GaugeMetricFamily(
            metrics.CONTROLLER_RUNNING_JOBS, "Jobs RUNNING on each backend", labels=["backend"]
        )
        free = GaugeMetricFamily(
            metrics.CONTROLLER_FREE_SLOTS,
            "Free devices in this controller's capacity report (cpu: CPU slots)",
            labels=["backend", "device"],
        )
        executor = self._executor()
        if executor is not None:
            per_backend = dict.fromkeys(executor.backends, 0)
            for job in executor.jobs.values():
                if job.state is ControllerJobState.RUNNING and job.backend_id in per_backend:
                    per_backend[job.backend_id] += 1
            for backend_id, count in per_backend.items():
                running.add_metric([backend_id], count)
            for backend_id, backend in executor.backends.items():
                try:
                    report = backend.report()
                except BackendUnreachable:  # its engine does not answer: no figure rather than 0
                    continue
                if report.availability is not None:
                    for token, amount in sorted(report.availability.amounts.items()):
                        free.add_metric([backend_id, token], amount)
        yield running
        yield free
