"""The project's payload converter: Pydantic's, except that no payload can make a worker fail a
workflow task for ever (docs/SECURITY.md, "Names and inputs"; docs/DESIGN.md, "User → home").

A job's workflow takes its inputs without type hints (a start holds one payload for two
parameters, so the SDK decodes it untyped; ``workflows/job.py`` then validates it), and the SDK
fails the task, again at every retry, on an input it cannot decode: a raw ``temporal workflow
start`` with ``--input-meta encoding=…`` or non-JSON data once held a job's name for ever that
way. Here a payload decoded without a type hint that cannot be decoded, or is still encrypted
(``EncryptionCodec(keep_undecryptable=True)`` left it so: a key this process lacks), comes back as
an ``Unreadable`` raw value, and the workflow ends such a start REJECTED.

Where a type is wanted (an activity's input or result, a signal's or an Update's argument, a
workflow's result read by a client), a payload still encrypted raises ``PayloadKeyError`` with the
codec's reason, as the codec did before: the CLI says in one line which key it lacks, and the
worker drops a signal it cannot read rather than failing its task.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from temporalio.api.common.v1 import Payload
from temporalio.common import RawValue
from temporalio.contrib.pydantic import PydanticPayloadConverter

from iris.payloadcodec import ENCODING, KEY_ID_METADATA, UNDECRYPTABLE_METADATA, PayloadKeyError


class Unreadable(RawValue):
    """A payload decoded without a type hint that this process cannot read (still encrypted, or
    undecodable): shown as a short line, never as its bytes."""

    def __str__(self) -> str:
        return f"(unreadable payload: {reason(self.payload)})"


def still_encrypted(payload: Payload) -> bool:
    return payload.metadata.get("encoding") == ENCODING


def reason(payload: Payload) -> str:
    """Why ``payload`` cannot be read: the codec's words when it left them, else its encoding."""
    why = payload.metadata.get(UNDECRYPTABLE_METADATA)
    if why:
        return why.decode(errors="replace")
    if still_encrypted(payload):
        key_id = payload.metadata.get(KEY_ID_METADATA, b"").decode(errors="replace")
        return f"a payload is encrypted with key {key_id[:40]!r}, which this process lacks"
    encoding = payload.metadata.get("encoding", b"<none>").decode(errors="replace")
    return f"a payload with encoding {encoding[:40]!r} does not decode"


class IrisPayloadConverter(PydanticPayloadConverter):
    """``PydanticPayloadConverter``; untyped decoding never raises (``Unreadable``), typed decoding
    of a still-encrypted payload raises its ``PayloadKeyError``."""

    def from_payloads(self, payloads: Sequence[Payload], type_hints: list[type] | None = None) -> list[Any]:
        if type_hints:
            for payload, hint in zip(payloads, type_hints, strict=False):
                if hint is not RawValue and still_encrypted(payload):
                    raise PayloadKeyError(reason(payload))
            return super().from_payloads(payloads, type_hints)
        values: list[Any] = []
        for payload in payloads:
            if still_encrypted(payload):
                values.append(Unreadable(payload))
                continue
            try:
                values.append(super().from_payloads([payload])[0])
            except Exception:
                values.append(Unreadable(payload))
        return values


__all__ = ["IrisPayloadConverter", "Unreadable", "reason", "still_encrypted"]
