"""`iris job list --shares` (docs/DESIGN.md, "Fair share and aging"): after the table, each user
holding devices with the chips its jobs hold and its dominant share, as the placement manager's
inquiry answers them. No service: a stand-in for the SDK client."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from cli_main import iris
from test_cli_attempts import connected as connected

from iris.client import IrisError
from iris.inquiry import PositionsAnswer, UserShare


class Client:
    def __init__(self, answer: PositionsAnswer | None) -> None:
        self.answer = answer
        self.asked: list[list[str]] = []

    async def list(self, **kw: Any) -> list[Any]:
        return []

    async def with_positions(self, rows: list[Any]) -> list[Any]:
        return rows

    async def queue_answer(self, job_ids: list[str]) -> PositionsAnswer:
        self.asked.append(list(job_ids))
        if self.answer is None:
            raise IrisError("the placement manager is not running")
        return self.answer


def test_shares_follow_the_table(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], connected: Callable[[Any], list[int]]
) -> None:
    users = {"alice": UserShare(devices=10, share=0.625), "bob": UserShare(devices=2, share=0.125)}
    client = Client(PositionsAnswer(users=users))
    connected(client)
    code, out, err = iris(monkeypatch, capsys, "job", "list", "--shares")
    assert code == 0, err
    table = out.split("\n\n", 1)[1].splitlines()
    assert [line.split() for line in table] == [
        ["USER", "DEVICES", "SHARE"],
        ["alice", "10", "62%"],
        ["bob", "2", "12%"],
    ]
    assert client.asked == [[]]
    # Without --shares, the manager is not asked.
    client.asked.clear()
    code, out, _ = iris(monkeypatch, capsys, "job", "list")
    assert code == 0 and "SHARE" not in out and client.asked == []


def test_shares_say_why_they_are_missing_and_refuse_json(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], connected: Callable[[Any], list[int]]
) -> None:
    connected(Client(None))
    code, _, err = iris(monkeypatch, capsys, "job", "list", "--shares")
    assert code == 0 and err.strip() == "warning: no shares: the placement manager is not running"
    code, out, err = iris(monkeypatch, capsys, "job", "list", "--shares", "--json")
    assert (code, out, err.strip()) == (2, "", "error: --shares goes with a table, not -o json")
