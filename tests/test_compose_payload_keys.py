"""docker-compose.yml encrypts job payloads by default: the workers, and only they, hold the payload
key ring, read-only, and are pointed at it (docs/SECURITY.md, "Payload encryption")."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from test_compose import COMPOSE_FILE, _mutated, normalized

from iris.payloadcodec import PAYLOAD_KEYS_ENV

RING_VOLUME = "keys-payload"
# The services that may hold it: the one that creates it, and the workers.
HOLDERS = {"keys", "worker"}


def payload_key_gaps(project: dict[str, Any]) -> list[str]:
    """Where the compose file would leave payloads in plain text, or the ring with a process
    that is not a worker (a controller runs jobs; Temporal and its UI must see ciphertext only)."""
    found = []
    services = project["services"]
    for name, svc in services.items():
        mounts = [v for v in svc.get("volumes") or [] if v.get("source") == RING_VOLUME]
        if mounts and name not in HOLDERS:
            found.append(f"{name}: mounts the payload key ring")
        if PAYLOAD_KEYS_ENV in (svc.get("environment") or {}) and name != "worker":
            found.append(f"{name}: is pointed at the payload key ring")
    worker = services["worker"]
    mount = next((v for v in worker.get("volumes") or [] if v.get("source") == RING_VOLUME), None)
    ring = str((worker.get("environment") or {}).get(PAYLOAD_KEYS_ENV) or "")
    if mount is None:
        found.append("worker: no payload key ring mounted (histories would hold job payloads in plain text)")
    elif not mount.get("read_only"):
        found.append("worker: the payload key ring is mounted writable")
    elif not ring.startswith(str(mount["target"]).rstrip("/") + "/"):
        found.append(f"worker: {PAYLOAD_KEYS_ENV}={ring!r} is not in the mounted ring {mount['target']}")
    keys = services["keys"]
    made = any(v.get("source") == RING_VOLUME for v in keys.get("volumes") or [])
    if not made or "iris keys ensure" not in " ".join(keys.get("command") or []):
        found.append("keys: does not create the payload key ring")
    return found


def test_only_the_workers_hold_the_payload_key_ring() -> None:
    assert payload_key_gaps(normalized(COMPOSE_FILE)) == []


def _add_volume(service: str, volume: str) -> Any:
    def change(data: dict[str, Any]) -> None:
        svc = data["services"][service]
        svc["volumes"] = [*svc.get("volumes", []), volume]

    return change


def _worker_env(value: str | None) -> Any:
    def change(data: dict[str, Any]) -> None:
        env = data["services"]["worker"]["environment"]
        if value is None:
            del env[PAYLOAD_KEYS_ENV]
        else:
            env[PAYLOAD_KEYS_ENV] = value

    return change


def _worker_ring_writable(data: dict[str, Any]) -> None:
    volumes = data["services"]["worker"]["volumes"]
    volumes[:] = [v.removesuffix(":ro") if v.startswith(RING_VOLUME) else v for v in volumes]


@pytest.mark.parametrize(
    "change",
    [
        _add_volume("controller-marin", f"{RING_VOLUME}:/payload:ro"),
        _add_volume("temporal-ui", f"{RING_VOLUME}:/payload:ro"),
        _worker_env(None),
        _worker_env("/elsewhere/payload.keys"),
        _worker_ring_writable,
    ],
    ids=["controller-holds-it", "ui-holds-it", "worker-not-pointed", "worker-pointed-elsewhere", "writable"],
)
def test_a_ring_in_the_wrong_place_or_none_fails_validation(tmp_path: Path, change: Any) -> None:
    assert payload_key_gaps(_mutated(tmp_path, change)) != []
