"""``devstack.free_port`` picks below the kernel's ephemeral range (service-free): a port there is
never handed to another process's outgoing connection between the pick and its use."""

from __future__ import annotations

import random
import socket
from pathlib import Path

from iris import devstack


def test_a_free_port_is_below_the_ephemeral_range_and_bindable() -> None:
    below = devstack.unassigned_ports()
    assert below is not None, "this host's ephemeral range starts too low to test"
    ports = {devstack.free_port() for _ in range(20)}
    assert all(p in below for p in ports), sorted(ports)
    for port in ports:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", port))


def test_a_shared_random_seed_does_not_make_callers_pick_alike() -> None:
    # Processes whose `random` shares a seed (a test plugin seeding every worker alike) each draw
    # their ports: the OS's randomness is not that seed's.
    picks = []
    for _ in range(2):
        random.seed(1234)
        picks.append([devstack.free_port() for _ in range(5)])
    assert picks[0] != picks[1]


def test_an_unknown_or_too_low_range_falls_back_to_the_kernels_choice(tmp_path: Path) -> None:
    assert devstack.unassigned_ports(tmp_path / "missing") is None
    low = tmp_path / "range"
    low.write_text("1500\t60999\n")
    assert devstack.unassigned_ports(low) is None
    usual = tmp_path / "usual"
    usual.write_text("32768\t60999\n")
    assert devstack.unassigned_ports(usual) == range(16384, 32768)
