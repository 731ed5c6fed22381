"""`iris peers` and `iris rpc controller list-peers`: what every cluster reports right now."""

from __future__ import annotations

import datetime as dt
import json
from typing import TYPE_CHECKING, Any

import typer

from cli import common

if TYPE_CHECKING:
    from iris.policy.models import PeerReport
    from iris.reports import FederationView

rpc_app = typer.Typer(rich_markup_mode=None, help="Raw RPC views, as JSON.", no_args_is_help=True)
controller_app = typer.Typer(
    rich_markup_mode=None, help="The federation manager's controller view.", no_args_is_help=True
)
rpc_app.add_typer(controller_app, name="controller")


async def _view() -> FederationView:
    client = await common.client()
    return await client.peers()


def peer_json(report: PeerReport) -> dict[str, Any]:
    """One peer in the documented shape (docs/DESIGN.md, "Interfaces"), plus ``error`` when it is
    unreachable."""
    out: dict[str, Any] = {
        "peer_id": report.peer_id,
        "reachable": report.reachable,
        "last_contact_ms": report.last_contact_ms,
        "backends": [b.model_dump(mode="json") for b in report.backends],
    }
    if report.error:
        out["error"] = report.error
    return out


@controller_app.command("list-peers")
def list_peers_command() -> None:
    """Print `{peers:[{peer_id, reachable, last_contact_ms, backends:[{backend_id,
    advertised_attributes, availability}]}]}` for every cluster, the home one included."""
    view = common.run(_view())
    typer.echo(readable_json({"peers": [peer_json(r) for r in view.reports]}))


# A JSON value goes on one line when that line stays within this width, as the seed's example
# prints a backend's attributes and availability; anything longer is laid out, indent 2.
JSON_WIDTH = 200


def readable_json(value: Any, indent: int = 0, prefix: str = "") -> str:
    """``value`` as indented JSON whose small containers stay on one line (``prefix``: the key
    already written on the first line). Parses back to ``value``."""
    flat = json.dumps(value)
    if not isinstance(value, dict | list) or not value or indent + len(prefix) + len(flat) <= JSON_WIDTH:
        return flat
    inner = " " * (indent + 2)
    if isinstance(value, dict):
        items = [
            f"{inner}{json.dumps(k)}: {readable_json(v, indent + 2, json.dumps(k) + ': ')}"
            for k, v in value.items()
        ]
        return "{\n" + ",\n".join(items) + "\n" + " " * indent + "}"
    items = [f"{inner}{readable_json(v, indent + 2)}" for v in value]
    return "[\n" + ",\n".join(items) + "\n" + " " * indent + "]"


def _age_ms(ms: int | None) -> str:
    if ms is None:
        return "never"
    secs = max(0.0, dt.datetime.now().timestamp() - ms / 1000)
    return f"{secs:.1f}s ago" if secs < 120 else f"{int(secs // 60)}m ago"


def peers_command() -> None:
    """Every cluster: reachable, last contact, and per backend free/total, held by band, and how
    its jobs are sandboxed."""
    for line in peers_table(common.run(_view())):
        typer.echo(line)


def peers_table(view: FederationView) -> list[str]:
    """The lines of `iris peers` for ``view``. SANDBOX is the backend's own word on how its jobs are
    isolated (docs/SECURITY.md, "The job sandbox"): ``bwrap``, ``none: <why>``, or ``-`` from a
    backend that does not say (a Ray backend, an older controller)."""
    header = ("CLUSTER", "REACHABLE", "CONTACT", "BACKEND", "FREE/TOTAL", "HELD BY BAND", "SANDBOX")
    rows: list[tuple[str, ...]] = [header]
    for r in view.reports:
        name = f"{r.peer_id} (home)" if r.peer_id == view.home else r.peer_id
        if not r.reachable or not r.backends:
            rows.append(
                (
                    name,
                    "yes" if r.reachable else "no",
                    _age_ms(r.last_contact_ms),
                    "-",
                    "-",
                    r.error or "-",
                    "-",
                )
            )
            continue
        for i, b in enumerate(r.backends):
            a = b.availability
            if a is None:
                free, held = "shape only", "-"
            elif not a.total_amounts:
                free, held = "cpu", "-"
            else:
                free = " ".join(f"{t} {a.amounts.get(t, 0)}/{n}" for t, n in sorted(a.total_amounts.items()))
                held = (
                    " ".join(
                        f"{h.band.label}:" + ",".join(f"{t}={n}" for t, n in sorted(h.amounts.items()))
                        for h in a.held_by_band
                    )
                    or "-"
                )
            first = i == 0
            rows.append(
                (
                    name if first else "",
                    ("yes" if r.reachable else "no") if first else "",
                    _age_ms(r.last_contact_ms) if first else "",
                    b.backend_id,
                    free,
                    held,
                    b.sandbox or "-",
                )
            )
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    return ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in rows]
