"""Identity tokens for tests that talk to controllers with plain HTTP clients.

A controller accepts a token only for the exact request it was signed for (docs/DESIGN.md,
"Identity tokens"): ``aud`` its cluster id, ``htm`` the method, ``htp`` the path and query as sent,
``bsh`` the SHA-256 of the body. These helpers sign at send time, from the request the client
actually sends:

- ``SignerAuth``: an ``httpx.Auth`` minting a fresh token per request with a real ``TokenSigner``;
- ``Token``: hand-made claims (to forge, expire, misaddress...), bound to the request unless a test
  overrides a binding claim. One ``Token`` sent twice with the same request is the same JWT, byte
  for byte (EdDSA is deterministic): a verbatim replay;
- ``RequestsSignerAuth``: the ``requests`` twin of ``SignerAuth`` (schemathesis sends with requests).
"""

from __future__ import annotations

import copy
import time
import uuid
from collections.abc import Generator
from typing import Any

import httpx
import jwt
import requests
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from iris.controller.identity import BODY_CLAIM, METHOD_CLAIM, TARGET_CLAIM, TokenSigner, body_sha256


class _Bind:
    def __repr__(self) -> str:
        return "<bound to the request>"


BIND: Any = _Bind()  # a claim value filled in from the request being sent


def target_of(request: httpx.Request) -> str:
    return request.url.raw_path.decode("ascii")


def claims(iss: str, aud: Any = BIND, **overrides: Any) -> dict[str, Any]:
    """Well-formed claims of ``iss``; an override of None drops the claim."""
    now = int(time.time())
    base: dict[str, Any] = {
        "iss": iss,
        "sub": iss,
        "aud": aud,
        "iat": now,
        "nbf": now,
        "exp": now + 60,
        "jti": uuid.uuid4().hex,
        METHOD_CLAIM: BIND,
        TARGET_CLAIM: BIND,
        BODY_CLAIM: BIND,
    }
    base.update(overrides)
    return {k: v for k, v in base.items() if v is not None}


class Token(httpx.Auth):
    """``claims(iss, **overrides)`` signed with ``key``; ``aud`` defaults to ``audience`` (with
    None: set by ``addressed`` before sending)."""

    def __init__(
        self,
        key: Ed25519PrivateKey | None,
        *,
        iss: str,
        audience: str | None,
        algorithm: str = "EdDSA",
        **overrides: Any,
    ) -> None:
        self.key = key
        self.algorithm = algorithm
        self.claims = claims(iss, **overrides)
        if audience is not None:
            self.claims = self.addressed(audience).claims

    def addressed(self, audience: str) -> Token:
        """This token with ``aud`` = ``audience`` unless a test set it (same jti: a replay)."""
        token = copy.copy(self)
        token.claims = {k: (audience if k == "aud" and v is BIND else v) for k, v in self.claims.items()}
        return token

    def bound(self, request: httpx.Request) -> dict[str, Any]:
        actual = {
            METHOD_CLAIM: request.method,
            TARGET_CLAIM: target_of(request),
            BODY_CLAIM: body_sha256(request.content),
        }
        return {k: (actual[k] if v is BIND else v) for k, v in self.claims.items()}

    def encode(self, request: httpx.Request) -> str:
        return jwt.encode(self.bound(request), self.key, algorithm=self.algorithm)  # type: ignore[arg-type]

    def auth_flow(self, request: httpx.Request) -> Generator[httpx.Request, httpx.Response, None]:
        request.headers["Authorization"] = f"Bearer {self.encode(request)}"
        yield request


class SignerAuth(httpx.Auth):
    """A fresh token per request from ``signer``, addressed to ``audience``; tokens are kept in
    ``issued`` if given (to replay one, or to look for it where it must not appear)."""

    def __init__(self, signer: TokenSigner, audience: str, issued: list[str] | None = None) -> None:
        self.signer = signer
        self.audience = audience
        self.issued = issued

    def auth_flow(self, request: httpx.Request) -> Generator[httpx.Request, httpx.Response, None]:
        token = self.signer.token(self.audience, request.method, target_of(request), request.content)
        if self.issued is not None:
            self.issued.append(token)
        request.headers["Authorization"] = f"Bearer {token}"
        yield request


class RequestsSignerAuth(requests.auth.AuthBase):
    def __init__(self, signer: TokenSigner, audience: str) -> None:
        self.signer = signer
        self.audience = audience

    def __call__(self, r: requests.PreparedRequest) -> requests.PreparedRequest:
        body = r.body or b""
        data = body.encode() if isinstance(body, str) else body
        r.headers["Authorization"] = self.signer.authorization(
            self.audience, r.method or "GET", r.path_url, data
        )
        return r
