"""``iris ARGS`` run in-process as ``cli.app.main()`` runs it (tests/test_cli_attempts.py,
tests/test_jobfile.py): the exit code (``os._exit`` is caught), stdout and stderr."""

from __future__ import annotations

import os
import sys

import pytest

from cli import app as cli_app


class Exited(Exception):
    def __init__(self, code: int) -> None:
        super().__init__(code)
        self.code = code


def iris(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], *args: str
) -> tuple[int, str, str]:
    """``iris ARGS`` as ``main()`` runs it: its exit code (``os._exit`` is caught), stdout, stderr."""

    def exit_(code: int) -> None:
        raise Exited(code)

    monkeypatch.setattr(sys, "argv", ["iris", *args])
    monkeypatch.setattr(os, "_exit", exit_)
    capsys.readouterr()
    with pytest.raises(Exited) as exited:
        cli_app.main()
    out, err = capsys.readouterr()
    return exited.value.code, out, err
