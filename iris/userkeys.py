"""Ed25519 key forms shared by user keys and cluster keys: the text form of a user's public key,
as `iris keys user` prints it and the config's ``[users]`` table holds it (docs/DESIGN.md, "User →
home"), and a PEM private key read. No iris import: the config validates keys with it, and
``iris.userauth`` and ``iris.controller.identity`` build on it."""

from __future__ import annotations

import base64
import binascii

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

KEY_PREFIX = "ed25519:"


def public_key_text(key: Ed25519PublicKey) -> str:
    raw = key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return KEY_PREFIX + base64.b64encode(raw).decode()


def parse_public_key(text: str) -> Ed25519PublicKey:
    """``ed25519:<base64 of 32 bytes>`` → the key; ValueError naming the expected form."""
    if not isinstance(text, str) or not text.startswith(KEY_PREFIX):
        raise ValueError(f"a user public key is '{KEY_PREFIX}<base64>' as `iris keys user` prints it")
    try:
        raw = base64.b64decode(text[len(KEY_PREFIX) :], validate=True)
        return Ed25519PublicKey.from_public_bytes(raw)
    except (binascii.Error, ValueError):
        raise ValueError(f"{text[:24]!r}… is not an Ed25519 public key (32 bytes, base64)") from None


def private_key_from_pem(pem: bytes) -> Ed25519PrivateKey | None:
    """The Ed25519 private key ``pem`` holds; None if it holds none (the caller says so in its own
    words, never quoting the material)."""
    try:
        key = serialization.load_pem_private_key(pem, password=None)
    except (ValueError, TypeError):
        return None
    return key if isinstance(key, Ed25519PrivateKey) else None
