"""Payloads encrypted at rest: the Temporal payload codec and its key ring (docs/SECURITY.md,
"Payload encryption"; docs/DESIGN.md, "Payload encryption").

Every payload a client or the worker hands Temporal (workflow and activity inputs and results,
signals, updates, queries, memos, the static summary and details, failure details) passes
through ``EncryptionCodec``: AES-256-GCM with a fresh 96-bit nonce per payload, the whole
serialized payload (its metadata and data) as the plaintext, and the key's id in the new
payload's metadata. Search attributes are not payloads of the codec (the SDK encodes them with
the payload converter alone), so the Web UI still filters on them.

A key ring holds one or more 256-bit keys; the last one encrypts, every one decrypts, so keys
rotate by adding a new current key (``iris keys payload --rotate``) while histories written
under the old ones stay readable. A payload without the codec's encoding (a history recorded
before encryption, or by a process without keys) is passed through as it is.

The ring is a text file, 0600: a comment, then one ``<key id> <base64 key>`` line per key, the
current key last. A key's id is derived from the key (a truncated SHA-256), so a damaged line
is refused rather than used.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import fcntl
import hashlib
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from temporalio.api.common.v1 import Payload
from temporalio.converter import PayloadCodec

from iris.config import ConfigError

# The encoding and metadata key of Temporal's encryption samples, so a codec server written for
# them recognises these payloads.
ENCODING = b"binary/encrypted"
KEY_ID_METADATA = "encryption-key-id"
# Beside a payload a lenient codec could not decrypt: why (``EncryptionCodec(keep_undecryptable=True)``).
UNDECRYPTABLE_METADATA = "iris-undecryptable"
# Bound into every tag (associated data) with the key id: a payload cannot be relabelled.
_AAD_PREFIX = b"iris-payload-v1:"
_NONCE_BYTES = 12
KEY_BYTES = 32

# Where a process finds its ring: $IRIS_PAYLOAD_KEYS, else the user's own copy in the user key
# directory (iris/userauth.py), which `iris dev` fills for its user.
PAYLOAD_KEYS_ENV = "IRIS_PAYLOAD_KEYS"
KEYRING_NAME = "payload.keys"
_HEADER = (
    "# Iris payload keys (docs/SECURITY.md, \"Payload encryption\"): one '<key id> <base64 key>' per\n"
    "# line; the last key encrypts, every key decrypts. Keep this file 0600.\n"
)


class PayloadKeyError(ValueError):
    """A payload this process cannot decrypt: its key is not in the ring, or it was altered."""


def key_id_of(key: bytes) -> str:
    """A key's id: derived from the key, so ids never collide and a damaged key is detected."""
    return "k" + hashlib.sha256(b"iris payload key id:" + key).hexdigest()[:16]


@dataclass(frozen=True)
class Keyring:
    """Payload keys by id, oldest first; the last one (``current``) encrypts."""

    keys: tuple[tuple[str, bytes], ...]

    def __post_init__(self) -> None:
        if not self.keys:
            raise ValueError("a key ring holds at least one key")

    @classmethod
    def generate(cls) -> Keyring:
        """A ring of one new random key."""
        key = AESGCM.generate_key(bit_length=8 * KEY_BYTES)
        return cls(((key_id_of(key), key),))

    @property
    def current(self) -> str:
        return self.keys[-1][0]

    @property
    def ids(self) -> list[str]:
        return [key_id for key_id, _ in self.keys]

    def get(self, key_id: str) -> bytes | None:
        return dict(self.keys).get(key_id)

    def rotated(self) -> Keyring:
        """This ring with a new random key, now current; the old keys still decrypt."""
        return Keyring(self.keys + Keyring.generate().keys)

    def merged(self, other: Keyring) -> Keyring:
        """Every key of both; ``other``'s current key is current."""
        mine = [(k, v) for k, v in self.keys if other.get(k) is None]
        return Keyring((*mine, *other.keys))

    def dumps(self) -> str:
        return _HEADER + "".join(f"{k} {base64.b64encode(v).decode()}\n" for k, v in self.keys)

    @classmethod
    def loads(cls, text: str, source: str = "payload key ring") -> Keyring:
        keys: list[tuple[str, bytes]] = []
        for number, line in enumerate(text.splitlines(), 1):
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            parts = line.split()
            try:
                key = base64.b64decode(parts[1], validate=True) if len(parts) == 2 else b""
            except binascii.Error:
                key = b""
            if len(key) != KEY_BYTES or key_id_of(key) != parts[0]:
                # Never echo the line: it holds key material.
                raise ConfigError(f"{source}: line {number} is not '<key id> <base64 256-bit key>'")
            if all(k != parts[0] for k, _ in keys):
                keys.append((parts[0], key))
        if not keys:
            raise ConfigError(f"{source}: holds no key")
        return cls(tuple(keys))

    def __repr__(self) -> str:  # never show the keys
        return f"Keyring(ids={self.ids}, current={self.current})"


# ---- the ring on disk ---------------------------------------------------------------------------


def read_keyring(path: Path) -> Keyring:
    """The ring at ``path``; ConfigError (one line, never the material) if it is missing or bad."""
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"cannot read the payload key ring {path}: {exc.strerror}") from None
    return Keyring.loads(text, str(path))


def _write_new(path: Path, keyring: Keyring) -> Path:
    """``keyring`` in a new 0600 file beside ``path`` (in a 0700 directory); returns its name."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{os.urandom(4).hex()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(keyring.dumps())
        f.flush()
        os.fsync(f.fileno())
    return tmp


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """Changes to one ring are serialized (two rotations must not lose a key)."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    lock = os.open(path.with_name(f".{path.name}.lock"), os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield
    finally:
        os.close(lock)


def write_keyring(path: Path, keyring: Keyring) -> None:
    """Replace the ring at ``path`` atomically (0600, in a 0700 directory)."""
    os.replace(_write_new(path, keyring), path)


def ensure_keyring(path: Path) -> tuple[Keyring, bool]:
    """The ring at ``path``, created with one new key if there is none; and whether it was
    created. Concurrent callers all end with the same ring."""
    with _locked(path):
        if path.exists():
            return read_keyring(path), False
        keyring = Keyring.generate()
        write_keyring(path, keyring)
        return keyring, True


def rotate_keyring(path: Path) -> Keyring:
    """Add a new current key to the ring at ``path`` (which must exist); the old keys stay."""
    with _locked(path):
        keyring = read_keyring(path).rotated()
        write_keyring(path, keyring)
        return keyring


def install_keyring(path: Path, keyring: Keyring) -> Keyring:
    """Merge ``keyring`` into the ring at ``path`` (created if absent), its current key current:
    how a client is given a stack's keys without losing those of another."""
    with _locked(path):
        existing = read_keyring(path) if path.exists() else None
        merged = existing.merged(keyring) if existing is not None else keyring
        if merged != existing:
            write_keyring(path, merged)
        return merged


def keyring_path() -> Path:
    """Where this process's ring is: ``$IRIS_PAYLOAD_KEYS``, else ``payload.keys`` in the user
    key directory (``$IRIS_USER_KEY_DIR``, else ``~/.config/iris/users``)."""
    from iris.userauth import user_key_dir

    env = os.environ.get(PAYLOAD_KEYS_ENV, "").strip()
    return Path(env).expanduser() if env else user_key_dir() / KEYRING_NAME


def load_keyring() -> Keyring | None:
    """This process's ring (``keyring_path``), or None when it has none: then payloads it writes
    are not encrypted. A ring named by ``$IRIS_PAYLOAD_KEYS`` must exist (ConfigError)."""
    path = keyring_path()
    if not os.environ.get(PAYLOAD_KEYS_ENV, "").strip() and not path.exists():
        return None
    return read_keyring(path)


# ---- the codec ----------------------------------------------------------------------------------


class EncryptionCodec(PayloadCodec):
    """AES-256-GCM over whole payloads with the ring's current key; decodes with any key of the
    ring and passes through payloads it did not encode. Without a ring it encrypts nothing and
    refuses (``PayloadKeyError``) to decode an encrypted payload, saying why.

    ``keep_undecryptable`` (the SDK's converter, ``iris.temporal.data_converter``): a payload it
    cannot decrypt is left as it is, still encrypted, with the reason in its metadata
    (``UNDECRYPTABLE_METADATA``), instead of failing the whole batch. A worker then never fails a
    workflow task for ever on one payload someone sent it encrypted under a foreign key (a signal
    is dropped, a start ends REJECTED: docs/SECURITY.md, "Names and inputs"); the payload
    converter (iris/payloadconverter.py) raises the reason where a value of it is wanted."""

    def __init__(self, keyring: Keyring | None, *, keep_undecryptable: bool = False) -> None:
        super().__init__()
        self.keyring = keyring
        self._ciphers = {key_id: AESGCM(key) for key_id, key in keyring.keys} if keyring else {}
        self._keep = keep_undecryptable

    def encrypt(self, payload: Payload) -> Payload:
        if self.keyring is None:
            return payload
        key_id = self.keyring.current
        nonce = os.urandom(_NONCE_BYTES)
        sealed = self._ciphers[key_id].encrypt(
            nonce, payload.SerializeToString(), _AAD_PREFIX + key_id.encode()
        )
        return Payload(metadata={"encoding": ENCODING, KEY_ID_METADATA: key_id.encode()}, data=nonce + sealed)

    def decrypt(self, payload: Payload) -> Payload:
        if payload.metadata.get("encoding") != ENCODING:
            return payload  # not ours: recorded before encryption, or by a process without keys
        key_id = payload.metadata.get(KEY_ID_METADATA, b"").decode(errors="replace")
        cipher = self._ciphers.get(key_id)
        if cipher is None:
            held = ", ".join(self._ciphers) or f"none: set ${PAYLOAD_KEYS_ENV} to the federation's key ring"
            raise PayloadKeyError(
                f"a payload is encrypted with key {key_id!r}, which this process lacks (keys: {held})"
            )
        nonce, sealed = payload.data[:_NONCE_BYTES], payload.data[_NONCE_BYTES:]
        try:
            plain = cipher.decrypt(nonce, sealed, _AAD_PREFIX + key_id.encode())
        except InvalidTag:
            raise PayloadKeyError(
                f"a payload under key {key_id!r} fails authentication: altered or corrupt"
            ) from None
        return Payload.FromString(plain)

    async def encode(self, payloads: Sequence[Payload]) -> list[Payload]:
        return [self.encrypt(p) for p in payloads]

    def _opened(self, payload: Payload) -> Payload:
        try:
            return self.decrypt(payload)
        except PayloadKeyError as exc:
            if not self._keep:
                raise
            kept = Payload()
            kept.CopyFrom(payload)
            kept.metadata[UNDECRYPTABLE_METADATA] = str(exc).encode()
            return kept

    async def decode(self, payloads: Sequence[Payload]) -> list[Payload]:
        return [self._opened(p) for p in payloads]
