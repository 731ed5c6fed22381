"""Fixtures of the security suite: the stack's real keys, a restricted controller, collected responses
(``Responses``: the stack's ``responses``, which the secret scan searches at the stack's teardown,
tests/secret_scan.py).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from security_support import RESTRICTED_DOMAIN, Keys, Responses, Restricted
from stack import Stack

from iris import devstack


@pytest.fixture(scope="session")
def keys(stack: Stack) -> Keys:
    return Keys(stack.key_dirs)


@pytest.fixture(scope="session")
def responses(stack: Stack) -> Responses:
    return Responses(stack.responses)


@pytest.fixture(scope="module")
async def restricted(stack: Stack) -> AsyncIterator[Restricted]:
    """A second real controller for cw-rno2a whose auth admits only ``*@allowed.example``.

    Same software, same pinned keys (the stack's key directory); only its allowed_submitters differ,
    since the stack's peers admit everyone (``*``).
    """
    root = stack.data_dir / "security-restricted"
    root.mkdir(exist_ok=True)
    cfg = stack.config.model_copy(deep=True)
    peer = cfg.cluster("cw-rno2a")
    peer.port = devstack.free_port()
    assert peer.auth is not None
    peer.auth.allowed_submitters = [f"*@{RESTRICTED_DOMAIN}"]
    config_file = root / "clusters.json"
    config_file.write_text(cfg.model_dump_json(indent=2))
    proc = devstack.controller(config_file, cfg, "cw-rno2a", root)
    proc.start()
    try:
        await asyncio.to_thread(proc.wait_ready, 60)
        yield Restricted(cfg, config_file, peer.url)
    finally:
        await asyncio.to_thread(proc.stop)
