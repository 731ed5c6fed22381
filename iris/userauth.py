"""Authenticated submitters (docs/DESIGN.md, "User → home").

The CLI and the SDK sign each submission, cancel and replay with the user's Ed25519 key: a
short-lived EdDSA JWT whose claims bind the principal (``sub``), the federation (``aud``), the
action (``act``), the job id (``job``) and the SHA-256 of the canonical request (``req``: the
JobSpec's JSON for a submit, the CancelRequest's or ReplayRequest's for a cancel or replay, each
without its ``signature`` field). The statement travels with the workflow input, signal or update;
it is a signature, not a secret: the private key never leaves the user's machine.

The worker checks it in an activity (activities/auth.py) through a ``Verifier``: ``UserKeyVerifier``
reads the config's ``[users]`` table; an OIDC/JWKS verifier can take its place behind the same
interface. ``authorize`` then applies the roles: the owner or an admin may cancel and replay; only
an admin may use the ``production`` band.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import time
import uuid
from collections.abc import Callable, Mapping
from enum import StrEnum
from pathlib import Path
from typing import Any, Protocol

import jwt
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from pydantic import BaseModel

from iris.config import FederationConfig, UserConfig
from iris.userkeys import parse_public_key, private_key_from_pem, public_key_text

ALGORITHM = "EdDSA"
# A statement lives this long by default; the verifier refuses any that claims to live longer
# than MAX_LIFETIME_S, and judges expiry at the moment Temporal received the request.
DEFAULT_TTL_S = 120
MAX_LIFETIME_S = 300
CLOCK_LEEWAY_S = 30
MAX_STATEMENT_CHARS = 4096
USER_KEY_ENV = "IRIS_USER_KEY"
USER_KEY_DIR_ENV = "IRIS_USER_KEY_DIR"
ADMIN = "admin"
USER = "user"
_SAFE = re.compile(r"[^A-Za-z0-9._@+-]")


class Action(StrEnum):
    """What a statement asks for (its ``act`` claim)."""

    SUBMIT = "job.submit"
    CANCEL = "job.cancel"
    REPLAY = "job.replay"

    @property
    def label(self) -> str:
        return self.name.lower()


class AuthError(Exception):
    """A request is not authenticated or not allowed; ``str(err)`` is one line for a human."""


class Principal(BaseModel):
    """Who a verified statement speaks for, and what they may do."""

    name: str
    roles: tuple[str, ...] = ()

    @property
    def admin(self) -> bool:
        return ADMIN in self.roles


class Expectation(BaseModel):
    """What a statement must bind to be accepted for one request."""

    action: Action
    job_id: str
    digest: str
    audience: str
    # When Temporal received the request (the workflow's start, or the signal's workflow task).
    received_ms: int


class Verifier(Protocol):
    """Turns a signed statement into a verified principal, or raises AuthError.

    The seam for another identity provider (docs/DESIGN.md, "User → home"): an OIDC verifier would
    check an ID token against the issuer's JWKS and map its groups to roles, under the same contract.
    """

    def verify(self, statement: str, expect: Expectation) -> Principal: ...


# ---- the canonical request ----------------------------------------------------------------------


def request_digest(model: BaseModel) -> str:
    """SHA-256 (hex) of the request's canonical JSON: its fields without ``signature``, sorted keys.

    Computed after one JSON round trip, so the client (before sending) and the worker (after
    Temporal's converter decoded it) hash the same values.
    """
    again = type(model).model_validate_json(model.model_dump_json())
    data = again.model_dump(mode="json", exclude={"signature"})
    text = json.dumps(data, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def audience(home: str) -> str:
    """The ``aud`` of every statement for the federation whose home cluster is ``home``."""
    return f"iris:{home}"


# ---- keys ---------------------------------------------------------------------------------------


def _config_home() -> Path:
    xdg = os.environ.get("XDG_CONFIG_HOME")
    return Path(xdg) if xdg else Path.home() / ".config"


def user_key_dir() -> Path:
    """``$IRIS_USER_KEY_DIR``, else ``~/.config/iris/users`` (``$XDG_CONFIG_HOME`` honoured)."""
    env = os.environ.get(USER_KEY_DIR_ENV)
    return Path(env) if env else _config_home() / "iris" / "users"


def user_key_path(user: str) -> Path:
    """Where ``user``'s private key is: ``$IRIS_USER_KEY`` if set, else ``<key dir>/<user>.key``."""
    env = os.environ.get(USER_KEY_ENV)
    if env:
        return Path(env)
    name = _SAFE.sub("_", user).lstrip(".") or "user"
    return user_key_dir() / f"{name}.key"


def create_user_key(path: Path) -> str:
    """Write a new Ed25519 private key at ``path`` (0600, in a 0700 directory; never overwritten)
    and return its public key as ``ed25519:<base64>``. FileExistsError if one is there."""
    key = Ed25519PrivateKey.generate()
    pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(pem)
    return public_key_text(key.public_key())


def load_user_key(path: Path) -> Ed25519PrivateKey:
    """The private key at ``path``; AuthError (one line, never the material) if it is unusable."""
    try:
        pem = path.read_bytes()
    except FileNotFoundError:
        raise AuthError(f"no user key at {path}: create one with `iris keys user`") from None
    except OSError as exc:
        raise AuthError(f"cannot read the user key {path}: {exc.strerror}") from None
    key = private_key_from_pem(pem)
    if key is None:
        raise AuthError(f"the user key {path} is not a PEM Ed25519 private key")
    return key


def ensure_user_key(path: Path) -> tuple[str, bool]:
    """The public key of the key at ``path``, creating the key if absent; (public, created)."""
    try:
        return create_user_key(path), True
    except FileExistsError:
        return public_key_text(load_user_key(path).public_key()), False


# ---- signing ------------------------------------------------------------------------------------


def sign_request(
    key: Ed25519PrivateKey,
    *,
    principal: str,
    action: Action,
    job_id: str,
    digest: str,
    aud: str,
    ttl_s: int = DEFAULT_TTL_S,
    now: float | None = None,
) -> str:
    """A signed statement: ``principal`` asks for ``action`` on ``job_id`` with this request."""
    iat = int(time.time() if now is None else now)
    claims = {
        "sub": principal,
        "aud": aud,
        "act": action.value,
        "job": job_id,
        "req": digest,
        "iat": iat,
        "exp": iat + ttl_s,
        "jti": str(uuid.uuid4()),
    }
    return jwt.encode(claims, key, algorithm=ALGORITHM)


class Signer:
    """Signs requests as one principal with a key file (the CLI's and the SDK's default)."""

    def __init__(self, principal: str, key_path: Path | None = None, *, ttl_s: int = DEFAULT_TTL_S) -> None:
        self.principal = principal
        self.key_path = key_path or user_key_path(principal)
        self._ttl = ttl_s
        self._key: Ed25519PrivateKey | None = None

    def sign(self, action: Action, job_id: str, request: BaseModel, aud: str) -> str:
        if self._key is None:
            self._key = load_user_key(self.key_path)
        return sign_request(
            self._key,
            principal=self.principal,
            action=action,
            job_id=job_id,
            digest=request_digest(request),
            aud=aud,
            ttl_s=self._ttl,
        )


# ---- verifying ----------------------------------------------------------------------------------


class UserKeyVerifier:
    """Verifies statements against the public keys of the config's ``[users]`` (read at each call,
    so a table updated in place, as ``iris dev`` and the test stack do, is seen at once)."""

    def __init__(self, users: Callable[[], Mapping[str, UserConfig]]) -> None:
        self._users = users

    def verify(self, statement: str, expect: Expectation) -> Principal:
        action = expect.action.label
        if not statement:
            raise AuthError(f"unsigned {action}: sign it with your user key (`iris keys user`)")
        if not isinstance(statement, str) or len(statement) > MAX_STATEMENT_CHARS:
            raise AuthError(f"malformed {action} signature")
        try:
            header = jwt.get_unverified_header(statement)
            unverified = jwt.decode(statement, options={"verify_signature": False})
        except jwt.PyJWTError:
            raise AuthError(f"malformed {action} signature") from None
        if header.get("alg") != ALGORITHM:
            raise AuthError(f"{action} signature uses {str(header.get('alg'))[:16]!r}, not {ALGORITHM}")
        sub = unverified.get("sub")
        user = self._users().get(sub) if isinstance(sub, str) else None
        if user is None:
            raise AuthError(f"{action} signed as {str(sub)[:64]!r}, who is not a registered user")
        claims = self._check_signature(statement, user.public_keys, expect)
        self._check_claims(claims, expect)
        return Principal(name=sub, roles=tuple(user.roles))

    @staticmethod
    def _check_signature(statement: str, keys: list[str], expect: Expectation) -> dict[str, Any]:
        for text in keys:
            try:
                claims: dict[str, Any] = jwt.decode(
                    statement,
                    parse_public_key(text),
                    algorithms=[ALGORITHM],
                    audience=expect.audience,
                    # Expiry is judged below at the moment Temporal received the request.
                    options={"verify_exp": False, "verify_iat": False, "verify_nbf": False},
                )
                return claims
            except jwt.InvalidAudienceError:
                raise AuthError(f"{expect.action.label} signed for another federation") from None
            except jwt.InvalidSignatureError:
                continue
            except jwt.PyJWTError:
                raise AuthError(f"malformed {expect.action.label} signature") from None
        raise AuthError(f"{expect.action.label} signature does not match the user's registered keys")

    @staticmethod
    def _check_claims(claims: dict[str, Any], expect: Expectation) -> None:
        action = expect.action.label
        if claims.get("act") != expect.action.value:
            raise AuthError(f"signature is for a {str(claims.get('act'))[:16]!r}, not a {action}")
        if claims.get("job") != expect.job_id:
            raise AuthError(f"{action} signature is for another job")
        if claims.get("req") != expect.digest:
            raise AuthError(f"{action} signature does not match the request (it was altered)")
        iat, exp = claims.get("iat"), claims.get("exp")
        if not isinstance(iat, int) or not isinstance(exp, int) or isinstance(iat | exp, bool):
            raise AuthError(f"{action} signature has no valid iat/exp")
        if exp - iat > MAX_LIFETIME_S or exp <= iat:
            raise AuthError(f"{action} signature lives longer than {MAX_LIFETIME_S}s")
        received_s = expect.received_ms / 1000
        if received_s > exp + CLOCK_LEEWAY_S:
            raise AuthError(f"{action} signature had expired when the request arrived")
        if iat > received_s + CLOCK_LEEWAY_S:
            raise AuthError(f"{action} signature is issued in the future")


def authorize(principal: Principal, action: Action, *, owner: str, production: bool = False) -> None:
    """Roles (docs/DESIGN.md, "User → home"): a user submits as themself; the owner or an admin
    cancels and replays; only an admin uses the ``production`` band. AuthError otherwise."""
    if not ({ADMIN, USER} & set(principal.roles)):
        raise AuthError(f"{principal.name} has no role that may {action.label} jobs")
    if action is Action.SUBMIT:
        if principal.name != owner:
            raise AuthError(f"signed by {principal.name}, but the job is submitted as {owner[:64]}")
        if production and not principal.admin:
            raise AuthError(f"the production band is for admins; {principal.name} is not one")
        return
    if principal.name != owner and not principal.admin:
        raise AuthError(f"{principal.name} may not {action.label} {owner[:64]}'s job (owner or admin only)")


def register_user(
    config: FederationConfig, principal: str, roles: list[str], key_path: Path | None = None
) -> tuple[Path, str, bool]:
    """Make sure ``principal`` has a key (created if absent) and is in ``config.users`` (in place)
    with that key: what ``iris dev`` does for its user at start, and the test stack for its users.
    Returns (key path, public key, whether the key was created)."""
    path = key_path or user_key_path(principal)
    public, created = ensure_user_key(path)
    entry = config.users.get(principal)
    if entry is None:
        config.users[principal] = UserConfig(public_keys=[public], roles=roles)
    elif public not in entry.public_keys:
        entry.public_keys.append(public)
    return path, public, created
