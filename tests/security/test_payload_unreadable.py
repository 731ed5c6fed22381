"""A payload this process cannot read never fails a worker's task for ever (iris/payloadconverter.py,
``EncryptionCodec(keep_undecryptable=True)``; docs/SECURITY.md, "Names and inputs").

The SDK's converter (``iris.temporal.data_converter``) leaves a payload encrypted under a key it
lacks as it is, still encrypted, with the codec's reason beside it; where a value of a type is
wanted the converter raises that reason (``PayloadKeyError``: the CLI's one line, a dropped signal),
where none is (a workflow's start input) it gives an ``Unreadable`` raw value the job workflow
refuses. The codec on its own (the codec server's) still refuses what it cannot decrypt."""

from __future__ import annotations

import pytest
from temporalio.api.common.v1 import Payload

from iris.jobs import CancelRequest
from iris.payloadcodec import ENCODING, UNDECRYPTABLE_METADATA, EncryptionCodec, Keyring, PayloadKeyError
from iris.payloadconverter import Unreadable
from iris.temporal import data_converter

RING = Keyring.generate()


async def sealed(value: object, ring: Keyring = RING) -> Payload:
    (payload,) = await data_converter(ring).encode([value])
    assert payload.metadata["encoding"] == ENCODING
    return payload


async def test_the_lenient_codec_keeps_what_it_cannot_decrypt_and_says_why() -> None:
    foreign = await sealed(CancelRequest(reason="x"))
    strict = EncryptionCodec(Keyring.generate())
    with pytest.raises(PayloadKeyError, match="which this process lacks"):
        await strict.decode([foreign])
    (kept,) = await EncryptionCodec(Keyring.generate(), keep_undecryptable=True).decode([foreign])
    assert kept.metadata["encoding"] == ENCODING and kept.data == foreign.data  # still encrypted
    assert "which this process lacks" in kept.metadata[UNDECRYPTABLE_METADATA].decode()
    # What it can decrypt, it decrypts, as before.
    (opened,) = await EncryptionCodec(RING, keep_undecryptable=True).decode([foreign])
    assert opened.metadata["encoding"] == b"json/plain"


async def test_a_typed_value_of_an_unreadable_payload_raises_the_codecs_reason() -> None:
    converter = data_converter(Keyring.generate())
    foreign = await sealed(CancelRequest(reason="x"))
    with pytest.raises(
        PayloadKeyError, match=f"encrypted with key '{RING.current}', which this process lacks"
    ):
        await converter.decode([foreign], [CancelRequest])
    # Without a ring at all, the same line says how to give it one.
    with pytest.raises(PayloadKeyError, match="IRIS_PAYLOAD_KEYS"):
        await data_converter().decode([foreign], [CancelRequest])


async def test_an_untyped_value_that_cannot_be_read_comes_back_raw_never_raising() -> None:
    converter = data_converter(Keyring.generate())
    garbage = [
        await sealed({"job_id": "alice/x"}),
        Payload(metadata={"encoding": b"json/plain"}, data=b"{not json"),
        Payload(metadata={"encoding": b"binary/zstd"}, data=b"\x28\xb5\x2f\xfd"),
        Payload(metadata={}, data=b"?"),
    ]
    values = await converter.decode(garbage)
    assert all(isinstance(v, Unreadable) for v in values), values
    # Each as it came, still encrypted for the first.
    assert [v.payload.data for v in values] == [p.data for p in garbage]
    assert values[0].payload.metadata["encoding"] == ENCODING
    assert "which this process lacks" in str(values[0]) and "does not decode" in str(values[1])
    # Readable payloads are untouched: plain JSON as before, and what the ring opens.
    plain = await data_converter().encode([{"a": 1}])
    assert await converter.decode(plain) == [{"a": 1}]
    assert await data_converter(RING).decode([await sealed({"a": 1})]) == [{"a": 1}]
