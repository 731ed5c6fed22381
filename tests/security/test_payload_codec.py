"""The payload codec and its key ring, service-free (docs/SECURITY.md, "Payload encryption"):
round trips, refuses altered ciphertext, decrypts under a rotated-out key, passes plain payloads
through, and the ring's file is owner-only."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest
from pydantic import BaseModel
from temporalio.api.common.v1 import Payload
from temporalio.api.failure.v1 import Failure
from temporalio.exceptions import ApplicationError

from iris.config import ConfigError
from iris.payloadcodec import (
    ENCODING,
    KEY_ID_METADATA,
    KEYRING_NAME,
    PAYLOAD_KEYS_ENV,
    EncryptionCodec,
    Keyring,
    PayloadKeyError,
    ensure_keyring,
    install_keyring,
    load_keyring,
    read_keyring,
    rotate_keyring,
)
from iris.temporal import data_converter
from iris.userauth import USER_KEY_DIR_ENV

SECRET = "hunter2-alice"


class Spec(BaseModel):
    command: list[str]
    env: dict[str, str]


SPEC = Spec(command=["python", "train.py"], env={"SECRET_TOKEN_ALICE": SECRET})


def plain(value: object) -> Payload:
    (payload,) = data_converter().payload_converter.to_payloads([value])
    return payload


async def test_a_payload_round_trips_and_its_ciphertext_hides_the_value() -> None:
    ring = Keyring.generate()
    codec = EncryptionCodec(ring)
    original = plain(SPEC)
    (sealed,) = await codec.encode([original])
    assert sealed.metadata["encoding"] == ENCODING
    assert sealed.metadata[KEY_ID_METADATA] == ring.current.encode()
    assert SECRET.encode() not in sealed.SerializeToString()
    assert b"SECRET_TOKEN_ALICE" not in sealed.SerializeToString()
    (opened,) = await codec.decode([sealed])
    assert opened == original
    # A fresh nonce each time: the same value never gives the same ciphertext.
    (again,) = await codec.encode([original])
    assert again.data != sealed.data


async def test_the_converter_encrypts_what_a_client_sends_and_reads_it_back() -> None:
    converter = data_converter(Keyring.generate())
    payloads = await converter.encode([SPEC, "details: " + SECRET])
    assert all(SECRET.encode() not in p.SerializeToString() for p in payloads)
    assert await converter.decode(payloads, [Spec, str]) == [SPEC, "details: " + SECRET]


async def test_altered_ciphertext_or_relabelled_key_is_refused() -> None:
    ring = Keyring.generate().rotated()
    codec = EncryptionCodec(ring)
    (sealed,) = await codec.encode([plain(SPEC)])
    flipped = Payload()
    flipped.CopyFrom(sealed)
    data = bytearray(flipped.data)
    data[-1] ^= 0x01  # the GCM tag
    flipped.data = bytes(data)
    with pytest.raises(PayloadKeyError, match="fails authentication"):
        await codec.decode([flipped])
    body = Payload()
    body.CopyFrom(sealed)
    data = bytearray(body.data)
    data[20] ^= 0x01  # the ciphertext itself
    body.data = bytes(data)
    with pytest.raises(PayloadKeyError, match="fails authentication"):
        await codec.decode([body])
    # The other key of the ring, named in the metadata: the key id is bound into the tag.
    relabelled = Payload()
    relabelled.CopyFrom(sealed)
    relabelled.metadata[KEY_ID_METADATA] = ring.ids[0].encode()
    with pytest.raises(PayloadKeyError, match="fails authentication"):
        await codec.decode([relabelled])


async def test_a_rotated_out_key_still_decrypts_and_the_new_one_encrypts() -> None:
    old = Keyring.generate()
    (before,) = await EncryptionCodec(old).encode([plain(SPEC)])
    rotated = old.rotated()
    assert rotated.current != old.current and rotated.ids == [old.current, rotated.current]
    codec = EncryptionCodec(rotated)
    (after,) = await codec.encode([plain(SPEC)])
    assert after.metadata[KEY_ID_METADATA] == rotated.current.encode()
    assert await codec.decode([before, after]) == [plain(SPEC), plain(SPEC)]
    # A ring without the old key cannot read what it wrote, and says which key is missing.
    only_new = Keyring(rotated.keys[1:])
    with pytest.raises(PayloadKeyError, match=old.current):
        await EncryptionCodec(only_new).decode([before])


async def test_plain_payloads_pass_through_with_or_without_keys() -> None:
    recorded = [plain(SPEC), plain("a string"), plain(7), Payload(metadata={"encoding": b"binary/null"})]
    assert await EncryptionCodec(Keyring.generate()).decode(recorded) == recorded
    keyless = EncryptionCodec(None)
    assert await keyless.decode(recorded) == recorded
    assert await keyless.encode(recorded) == recorded  # no ring: nothing is encrypted
    # ...and it refuses what it cannot read, saying how to give it the keys.
    (sealed,) = await EncryptionCodec(Keyring.generate()).encode([plain(SPEC)])
    with pytest.raises(PayloadKeyError, match=PAYLOAD_KEYS_ENV):
        await keyless.decode([sealed])


async def test_with_keys_a_failure_message_is_encrypted_too() -> None:
    converter = data_converter(Keyring.generate())
    failure = Failure()
    await converter.encode_failure(ApplicationError(f"launch refused: env {SECRET}"), failure)
    assert SECRET.encode() not in failure.SerializeToString()
    error = await converter.decode_failure(failure)
    assert SECRET in str(error)


def test_the_ring_file_is_owner_only_created_once_rotated_and_merged(tmp_path: Path) -> None:
    path = tmp_path / "keys" / "payload" / KEYRING_NAME
    ring, created = ensure_keyring(path)
    assert created
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert ensure_keyring(path) == (ring, False)
    rotated = rotate_keyring(path)
    assert rotated.ids[:-1] == ring.ids and read_keyring(path) == rotated
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    # A client's ring gains a stack's keys and keeps its own; the stack's current key is current.
    mine = tmp_path / "user" / KEYRING_NAME
    own, _ = ensure_keyring(mine)
    merged = install_keyring(mine, rotated)
    assert merged.ids == [*own.ids, *rotated.ids] and merged.current == rotated.current
    assert read_keyring(mine) == merged
    assert install_keyring(tmp_path / "fresh" / KEYRING_NAME, ring) == ring


def test_a_damaged_ring_is_refused_without_echoing_it(tmp_path: Path) -> None:
    path = tmp_path / KEYRING_NAME
    ensure_keyring(path)
    key_id, key = path.read_text().splitlines()[-1].split()
    damaged = key[:-4] + ("AAA=" if not key.endswith("AAA=") else "BBB=")
    path.write_text(f"{key_id} {damaged}\n")
    with pytest.raises(ConfigError) as refused:
        read_keyring(path)
    assert "line 1" in str(refused.value) and damaged not in str(refused.value)
    path.write_text("# nothing\n")
    with pytest.raises(ConfigError, match="no key"):
        read_keyring(path)
    # Nor does a ring show its keys when printed.
    other = tmp_path / "other" / KEYRING_NAME
    ring, _ = ensure_keyring(other)
    material = other.read_text().splitlines()[-1].split()[1]
    assert ring.current in repr(ring) and material not in repr(ring)


def test_a_process_finds_its_ring_by_env_else_in_the_user_key_dir(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(PAYLOAD_KEYS_ENV, raising=False)
    monkeypatch.setenv(USER_KEY_DIR_ENV, str(tmp_path / "users"))
    assert load_keyring() is None  # no ring anywhere: payloads are not encrypted
    user_ring, _ = ensure_keyring(tmp_path / "users" / KEYRING_NAME)
    assert load_keyring() == user_ring
    named, _ = ensure_keyring(tmp_path / "worker" / KEYRING_NAME)
    monkeypatch.setenv(PAYLOAD_KEYS_ENV, str(tmp_path / "worker" / KEYRING_NAME))
    assert load_keyring() == named
    # A ring named explicitly must be there: never a silent fall back to plain text.
    monkeypatch.setenv(PAYLOAD_KEYS_ENV, str(tmp_path / "missing" / KEYRING_NAME))
    with pytest.raises(ConfigError, match="cannot read the payload key ring"):
        load_keyring()
