"""The history half of the secret scan (tests/secret_scan.py) searches a history as Temporal keeps it,
in protobuf: a secret in a payload, in a memo, in a failure message or in a search attribute is
found, whichever of its forms (PEM body, raw bytes, hex, base64) leaked. Service-free: the scan's
teardown run over each real stack asserts that it read histories at all."""

from __future__ import annotations

import base64
import os
import tempfile
from pathlib import Path

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from secret_scan import Scan, history_bytes, key_needles, scan_files
from temporalio.api.common.v1 import Payload
from temporalio.api.failure.v1 import Failure
from temporalio.api.history.v1 import HistoryEvent
from temporalio.client import WorkflowHistory


def key_file(tmp_path: Path) -> tuple[Path, bytes]:
    key = Ed25519PrivateKey.generate()
    tmp_path.mkdir(parents=True, exist_ok=True)
    path = tmp_path / "peer.key"
    none = serialization.NoEncryption()
    path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, none))
    return path, key.private_bytes(serialization.Encoding.Raw, serialization.PrivateFormat.Raw, none)


def history_with(
    payload: bytes = b'{"ok": 1}', memo: bytes = b'"quiet"', failure: str = ""
) -> WorkflowHistory:
    started = HistoryEvent(event_id=1)
    started.workflow_execution_started_event_attributes.input.payloads.append(
        Payload(metadata={"encoding": b"json/plain"}, data=payload)
    )
    started.workflow_execution_started_event_attributes.memo.fields["note"].CopyFrom(Payload(data=memo))
    failed = HistoryEvent(event_id=2)
    failed.activity_task_failed_event_attributes.failure.CopyFrom(Failure(message=failure))
    return WorkflowHistory("wf", [started, failed])


def hits(needles: dict[str, bytes], history: WorkflowHistory) -> list[str]:
    scan = Scan(needles)
    scan.search("history", "wf", history_bytes(history))
    return scan.hits


def test_a_secret_anywhere_in_a_history_is_found_in_each_form(tmp_path: Path) -> None:
    path, raw = key_file(tmp_path)
    needles = key_needles(path)
    assert hits(needles, history_with()) == []
    forms = {
        "raw bytes": raw,
        "raw hex": raw.hex().encode(),
        "raw base64": base64.b64encode(raw),
        "raw base64url": base64.urlsafe_b64encode(raw),
        "PEM body": needles["peer.key PEM body"],
    }
    for form, leaked in forms.items():
        # In a payload (the bytes themselves, or inside JSON), in a memo, in a failure message.
        histories = [history_with(payload=b"\x00" + leaked), history_with(memo=b'"' + leaked + b'"')]
        if form != "raw bytes":  # a string holds text
            histories.append(history_with(payload=b'{"key": "' + leaked + b'"}'))
            histories.append(history_with(failure=leaked.decode()))
        for history in histories:
            found = hits(needles, history)
            assert f"peer.key {form} in history wf" in found, (form, found)


def test_the_file_scan_finds_a_planted_key_and_leaves_out_virtual_environments() -> None:
    # Outside the session's temporary directories: the session's own scan would find the plant.
    with tempfile.TemporaryDirectory() as where:
        planted(Path(where))


def planted(tmp_path: Path) -> None:
    key, raw = key_file(tmp_path / "keys")
    needles = key_needles(key)
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "job.log").write_bytes(b"leaked: " + raw.hex().encode())
    venv = tmp_path / "home" / ".venv"
    (venv / "lib").mkdir(parents=True)
    (venv / "pyvenv.cfg").write_text("home = /usr\n")
    (venv / "lib" / "site.py").write_bytes(raw.hex().encode())  # what an install wrote: not scanned
    os.mkfifo(tmp_path / "logs" / "pipe")  # read, it would block for ever: not a regular file
    (tmp_path / "logs" / "link").symlink_to(tmp_path / "logs" / "job.log")
    scan = Scan(needles)
    scan_files([tmp_path], scan)
    assert scan.hits == ["peer.key raw hex in file logs/job.log"], scan.hits
    assert scan.items["file"] == 1  # the key file itself is left out, and so is the environment
