"""`iris dev` without its development dependencies says what is missing (service-free)."""

from __future__ import annotations

import importlib.util

import pytest

from iris import devstack


def test_missing_emulators_are_named(monkeypatch: pytest.MonkeyPatch) -> None:
    assert devstack.missing_emulators() == []  # the dev group is installed here
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "moto" else real(name, *a)
    )
    assert devstack.missing_emulators() == ["moto[server]"]
