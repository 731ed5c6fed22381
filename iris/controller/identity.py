"""Signed cluster identity and admission (docs/DESIGN.md, "Identity tokens", "Admission order").

A requester cluster signs every request with a fresh short-lived EdDSA (Ed25519) JWT bound to it:
``aud=<target cluster>``, ``iss=sub=<requester cluster>``, a unique ``jti``, ``exp - iat <= 300 s``,
and the request itself: ``htm`` (method), ``htp`` (path and query string, as sent) and ``bsh`` (hex
SHA-256 of the exact body bytes, of ``b""`` when there is none). A controller verifies it against
the requester's pinned public key, its own cluster id and the actual request, and refuses replays of
a ``jti`` within its lifetime (remembered in SQLite, so a restart does not reopen the window).

Key files: ``generate_keypair(dir, cluster)`` writes ``<cluster>.key`` (PKCS#8 PEM, mode 0600)
and ``<cluster>.pub``; ``ensure_cluster_keys(config, key_dir)`` creates every missing key pair
the config names, which is how ``iris dev`` bootstraps the demo without a manual step.
"""

from __future__ import annotations

import asyncio
import fcntl
import hashlib
import hmac
import os
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jwt
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from iris.config import AuthConfig, ClusterConfig, ConfigError, FederationConfig
from iris.controller.errors import Unauthenticated
from iris.userkeys import private_key_from_pem

ALGORITHM = "EdDSA"
MAX_TOKEN_LIFETIME_S = 300
CLOCK_LEEWAY_S = 10
LOCAL_ADMIN = "local_admin"
KEY_DIR_ENV = "IRIS_KEY_DIR"
PRIVATE_SUFFIX = ".key"
PUBLIC_SUFFIX = ".pub"
_MAX_TOKEN_CHARS = 4096
# The request-binding claims (docs/DESIGN.md, "Identity tokens").
METHOD_CLAIM = "htm"
TARGET_CLAIM = "htp"
BODY_CLAIM = "bsh"
_REQUIRED_CLAIMS = ["exp", "iat", "iss", "sub", "aud", "jti", METHOD_CLAIM, TARGET_CLAIM, BODY_CLAIM]


def body_sha256(body: bytes | bytearray) -> str:
    """The ``bsh`` claim of a request body: hex SHA-256 of its exact bytes (of ``b""`` if none)."""
    return hashlib.sha256(body).hexdigest()


# ---- keys --------------------------------------------------------------------------------------


def default_key_dir(fallback: Path | None = None) -> Path:
    """``$IRIS_KEY_DIR`` if set, else ``fallback``, else the working directory."""
    env = os.environ.get(KEY_DIR_ENV)
    if env:
        return Path(env)
    return fallback if fallback is not None else Path.cwd()


def write_keypair(private_path: Path, public_path: Path) -> None:
    """Write a new Ed25519 key pair; the private key file is created 0600 and never overwritten."""
    key = Ed25519PrivateKey.generate()
    private_pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    public_pem = key.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    private_path.parent.mkdir(parents=True, exist_ok=True)
    public_path.parent.mkdir(parents=True, exist_ok=True)
    # O_EXCL: two processes bootstrapping at once must not clobber each other's key.
    fd = os.open(private_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(private_pem)
    tmp = public_path.with_name(public_path.name + ".tmp")
    tmp.write_bytes(public_pem)
    tmp.replace(public_path)


def generate_keypair(dir: Path, cluster: str) -> tuple[Path, Path]:
    """Create ``dir/<cluster>.key`` and ``dir/<cluster>.pub``; FileExistsError if the key exists."""
    private_path = Path(dir) / f"{cluster}{PRIVATE_SUFFIX}"
    public_path = Path(dir) / f"{cluster}{PUBLIC_SUFFIX}"
    write_keypair(private_path, public_path)
    return private_path, public_path


def _resolve(path: str, key_dir: Path) -> Path:
    p = Path(path).expanduser()
    return p if p.is_absolute() else key_dir / p


def ensure_cluster_keys(config: FederationConfig, key_dir: Path) -> list[str]:
    """Create the key pair of every cluster whose configured key files are both absent.

    Returns the names of the clusters that got new keys. A cluster with only one of the two files
    is left alone (that is an operator's mistake to fix, not to paper over); keys named by env
    variables are never generated.
    """
    created: list[str] = []
    key_dir.mkdir(parents=True, exist_ok=True)
    # Serialize concurrent bootstraps so nobody reads a half-written pair.
    with (key_dir / ".keygen.lock").open("a") as lock:
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
        _ensure_locked(config, key_dir, created)
    return created


def _ensure_locked(config: FederationConfig, key_dir: Path, created: list[str]) -> None:
    for cluster in config.clusters:
        auth = cluster.auth
        if auth is None or not auth.private_key_file or not auth.public_key_file:
            continue
        private_path = _resolve(auth.private_key_file, key_dir)
        public_path = _resolve(auth.public_key_file, key_dir)
        if private_path.exists() or public_path.exists():
            continue
        write_keypair(private_path, public_path)
        created.append(cluster.name)


def _read_source(kind: str, cluster: str, file: str, env: str, key_dir: Path) -> bytes:
    if file:
        path = _resolve(file, key_dir)
        try:
            return path.read_bytes()
        except OSError as exc:
            raise ConfigError(
                f"cluster {cluster}: cannot read {kind} key file {path}: {exc.strerror}"
            ) from None
    if env:
        value = os.environ.get(env)
        if not value:
            raise ConfigError(f"cluster {cluster}: environment variable {env} ({kind} key) is not set")
        return value.encode()
    raise ConfigError(f"cluster {cluster}: auth names no {kind} key")


def load_private_key(cluster: ClusterConfig, key_dir: Path) -> Ed25519PrivateKey:
    auth = _auth_of(cluster)
    pem = _read_source("private", cluster.name, auth.private_key_file, auth.private_key_env, key_dir)
    key = private_key_from_pem(pem)
    if key is None:
        # The message must not quote the material.
        raise ConfigError(f"cluster {cluster.name}: the private key is not a PEM Ed25519 key")
    return key


def load_public_key(cluster: ClusterConfig, key_dir: Path) -> Ed25519PublicKey:
    auth = _auth_of(cluster)
    if auth.public_key:
        pem = auth.public_key.encode()
    else:
        pem = _read_source("public", cluster.name, auth.public_key_file, auth.public_key_env, key_dir)
    try:
        key = serialization.load_pem_public_key(pem)
    except (ValueError, TypeError):
        raise ConfigError(f"cluster {cluster.name}: the public key is not a PEM Ed25519 key") from None
    if not isinstance(key, Ed25519PublicKey):
        raise ConfigError(f"cluster {cluster.name}: the public key is not an Ed25519 key")
    return key


def _auth_of(cluster: ClusterConfig) -> AuthConfig:
    if cluster.auth is None:
        raise ConfigError(f"cluster {cluster.name} has no [auth] section")
    return cluster.auth


# ---- tokens ------------------------------------------------------------------------------------


class TokenSigner:
    """Mints a fresh identity token per request, so a retried request never replays a ``jti``."""

    def __init__(self, cluster_name: str, private_key: Ed25519PrivateKey, *, ttl_s: int = 120) -> None:
        if not 1 <= ttl_s <= MAX_TOKEN_LIFETIME_S:
            raise ValueError(f"token ttl must be 1..{MAX_TOKEN_LIFETIME_S} s")
        self.cluster_name = cluster_name
        self._key = private_key
        self.ttl_s = ttl_s

    @classmethod
    def from_config(
        cls, config: FederationConfig, cluster_name: str, key_dir: Path | None = None
    ) -> TokenSigner:
        """The signer of ``cluster_name``, its key read as the config says (ConfigError if not)."""
        try:
            cluster = config.cluster(cluster_name)
        except KeyError:
            raise ConfigError(f"unknown cluster {cluster_name!r}") from None
        auth = _auth_of(cluster)
        key = load_private_key(cluster, key_dir or default_key_dir())
        return cls(cluster_name, key, ttl_s=auth.token_ttl_s)

    def token(self, audience: str, method: str, target: str, body: bytes = b"") -> str:
        """A token for one request: to cluster ``audience``, ``method`` on ``target`` (the path
        with its query string, exactly as sent), carrying exactly ``body``."""
        now = int(time.time())
        claims = {
            "iss": self.cluster_name,
            "sub": self.cluster_name,
            "aud": audience,
            "iat": now,
            "nbf": now,
            "exp": now + self.ttl_s,
            "jti": uuid.uuid4().hex,
            METHOD_CLAIM: method.upper(),
            TARGET_CLAIM: target,
            BODY_CLAIM: body_sha256(body),
        }
        return jwt.encode(claims, self._key, algorithm=ALGORITHM)

    def authorization(self, audience: str, method: str, target: str, body: bytes = b"") -> str:
        return f"Bearer {self.token(audience, method, target, body)}"

    def __repr__(self) -> str:  # never show the key
        return f"TokenSigner(cluster_name={self.cluster_name!r}, ttl_s={self.ttl_s})"


@dataclass(frozen=True)
class VerifiedToken:
    """A token whose signature, times, audience, method and target were checked: the body and the
    ``jti`` are checked next (``Admission.authenticate``)."""

    issuer: str
    replay_key: str
    expires_ms: int
    body_sha256: str


class TokenVerifier:
    """Verifies identity tokens addressed to ``audience`` (this cluster's id) against pinned public
    keys; the replay store (``remember(key, expires_ms)``, False when ``key`` was already seen)
    refuses replayed ``jti``s."""

    def __init__(
        self,
        audience: str,
        keys: dict[str, Ed25519PublicKey],
        remember: Callable[[str, int], bool] | None = None,
        *,
        leeway_s: int = CLOCK_LEEWAY_S,
    ) -> None:
        self.audience = audience
        self._keys = dict(keys)
        self._remember = remember
        self._leeway = leeway_s

    def set_replay_store(self, remember: Callable[[str, int], bool]) -> None:
        self._remember = remember

    def verify(self, token: str, *, method: str, target: str) -> VerifiedToken:
        """Check everything but the body and the ``jti``; raise Unauthenticated with the reason."""
        if not token or len(token) > _MAX_TOKEN_CHARS:
            raise Unauthenticated("malformed identity token")
        try:
            header = jwt.get_unverified_header(token)
            unverified: dict[str, Any] = jwt.decode(token, options={"verify_signature": False})
        except jwt.PyJWTError:
            raise Unauthenticated("malformed identity token") from None
        if header.get("alg") != ALGORITHM:
            raise Unauthenticated(f"identity token must be signed with {ALGORITHM}")
        issuer = unverified.get("iss")
        if not isinstance(issuer, str) or issuer not in self._keys:
            raise Unauthenticated(f"token issuer {str(issuer)[:64]!r} is not a trusted cluster")
        try:
            claims: dict[str, Any] = jwt.decode(
                token,
                self._keys[issuer],
                algorithms=[ALGORITHM],
                audience=self.audience,
                issuer=issuer,
                leeway=self._leeway,
                options={"require": _REQUIRED_CLAIMS, "strict_aud": True},
            )
        except jwt.ExpiredSignatureError:
            raise Unauthenticated("identity token expired") from None
        except jwt.InvalidAudienceError:
            raise Unauthenticated(
                f"identity token rejected: InvalidAudienceError (not addressed to cluster {self.audience})"
            ) from None
        except jwt.PyJWTError as exc:
            raise Unauthenticated(f"identity token rejected: {type(exc).__name__}") from None
        if claims.get("sub") != issuer:
            raise Unauthenticated("identity token subject must equal its issuer")
        exp, iat, jti = claims["exp"], claims["iat"], claims["jti"]
        if not isinstance(exp, int | float) or not isinstance(iat, int | float):
            raise Unauthenticated("identity token times must be numbers")
        if exp - iat > MAX_TOKEN_LIFETIME_S:
            raise Unauthenticated(f"identity token lifetime exceeds {MAX_TOKEN_LIFETIME_S} s")
        if not isinstance(jti, str) or not 8 <= len(jti) <= 128:
            raise Unauthenticated("identity token needs a unique jti")
        if claims[METHOD_CLAIM] != method.upper():
            raise Unauthenticated(f"identity token was signed for another method (this is {method.upper()})")
        if claims[TARGET_CLAIM] != target:
            raise Unauthenticated("identity token was signed for another path or query")
        bsh = claims[BODY_CLAIM]
        if not isinstance(bsh, str):
            raise Unauthenticated("identity token body hash must be a string")
        return VerifiedToken(issuer, f"{issuer}:{jti}", int((exp + self._leeway) * 1000), bsh)

    def check_body(self, verified: VerifiedToken, digest: str) -> None:
        if not hmac.compare_digest(verified.body_sha256, digest):
            raise Unauthenticated("identity token was signed for another request body")

    async def remember(self, verified: VerifiedToken) -> None:
        """Record the ``jti`` (off the event loop: SQLite); Unauthenticated if it was already used."""
        if self._remember is None:
            raise RuntimeError("token verifier has no replay store")
        if not await asyncio.to_thread(self._remember, verified.replay_key, verified.expires_ms):
            raise Unauthenticated("identity token replayed (jti already used)")


# ---- admission ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Caller:
    """Who is calling: a verified cluster, or ``None`` when the controller runs without auth."""

    cluster: str | None
    admin: bool = False
    # The body hash the token signed, when the route reads the body after authentication.
    body_sha256: str | None = None

    def may_access(self, requester: str) -> bool:
        return self.admin or self.cluster is None or self.cluster == requester


def submitter_matches(patterns: list[str], user: str) -> bool:
    """``*`` anyone; ``*@domain`` that domain, case-insensitive; otherwise an exact identity.

    Patterns match whole labels (docs/DESIGN.md, "Admission order"): ``*`` stands for one whole
    local part, never for an ``@`` or a domain label, so ``*@a.io`` admits ``x@a.io`` but neither
    ``x@b.io@a.io`` nor ``x@sub.a.io``. A principal with more than one ``@`` matches nothing.
    """
    if user.count("@") > 1:
        return False
    local, at, domain = user.partition("@")
    for pattern in patterns:
        if pattern == "*":
            return True
        if pattern.startswith("*@"):
            if at and local and domain.lower() == pattern[2:].lower():
                return True
        elif user == pattern:
            return True
    return False


class Admission:
    """The controller's gate: who is calling (token) and whom it lets submit (config)."""

    def __init__(self, cluster: str, auth: AuthConfig | None, verifier: TokenVerifier | None) -> None:
        self.cluster = cluster
        self._auth = auth
        self._verifier = verifier

    @classmethod
    def from_config(cls, config: FederationConfig, cluster: ClusterConfig, key_dir: Path) -> Admission:
        """Load the pinned keys of every trusted cluster; ConfigError if any is unusable."""
        auth = cluster.auth
        if auth is None:
            return cls(cluster.name, None, None)
        keys: dict[str, Ed25519PublicKey] = {}
        for name in dict.fromkeys([*auth.trusted_requesters, *auth.admins]):
            try:
                peer = config.cluster(name)
            except KeyError:
                raise ConfigError(
                    f"cluster {cluster.name}: trusted cluster {name!r} is not in the federation config"
                ) from None
            if peer.auth is None or not peer.auth.has_public_key:
                raise ConfigError(
                    f"cluster {cluster.name}: trusted cluster {name!r} has no public key configured"
                )
            keys[name] = load_public_key(peer, key_dir)
        return cls(cluster.name, auth, TokenVerifier(cluster.name, keys))

    @property
    def enabled(self) -> bool:
        return self._auth is not None

    def attach_store(self, store: Any) -> None:
        if self._verifier is not None:
            self._verifier.set_replay_store(store.remember_token)

    async def authenticate(
        self,
        authorization: str | None,
        *,
        method: str,
        target: str,
        read_body: Callable[[], Awaitable[bytes]] | None,
    ) -> Caller:
        """Who sends this request: its token must be addressed to this cluster and bound to
        ``method``, ``target`` (path and query as received) and the body ``read_body`` returns
        (called only once the signature and those claims are good). With ``read_body=None`` (a
        streamed upload) the caller carries the signed body hash and the route checks the bytes
        with ``check_body`` once read, before acting on them; the ``jti`` is spent before that."""
        if self._auth is None or self._verifier is None:
            return Caller(cluster=None, admin=True)
        if not authorization:
            raise Unauthenticated("missing identity token (Authorization: Bearer <jwt>)")
        scheme, _, token = authorization.partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise Unauthenticated("the Authorization header must be 'Bearer <jwt>'")
        verified = self._verifier.verify(token.strip(), method=method, target=target)
        if read_body is not None:
            self._verifier.check_body(verified, body_sha256(await read_body()))
        await self._verifier.remember(verified)
        return Caller(
            cluster=verified.issuer,
            admin=verified.issuer in self._auth.admins,
            body_sha256=None if read_body is not None else verified.body_sha256,
        )

    def check_body(self, caller: Caller, digest: str) -> None:
        """For a streamed body: Unauthenticated unless its SHA-256 is the one the token signed."""
        if caller.body_sha256 is not None and not hmac.compare_digest(caller.body_sha256, digest):
            raise Unauthenticated("identity token was signed for another request body")

    def may_submit(self, caller: Caller) -> bool:
        """Only trusted requesters hand jobs in (admins may be trusted to look, not to launch)."""
        return self._auth is None or caller.cluster in self._auth.trusted_requesters

    def submitter_allowed(self, user: str) -> bool:
        if self._auth is None:
            return True
        return submitter_matches(self._auth.allowed_submitters, user)
