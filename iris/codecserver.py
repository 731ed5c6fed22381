"""A codec server: Temporal's Web UI and ``temporal`` CLI decode (and encode) job payloads through
it, with the payload key ring (docs/SECURITY.md, "Payload encryption").

    uv run python -m iris.codecserver            # 127.0.0.1:8081, this process's ring

Temporal's codec server protocol: ``POST .../encode`` and ``POST .../decode``, each taking and
answering ``{"payloads": [...]}`` (the ``Payloads`` message in protobuf JSON); only the last
segment of the path names the operation, so the server may sit under any prefix.

Whoever reaches it can read every history, so every request must carry its token: either as
``Authorization: Bearer <token>`` (the CLI's ``--codec-auth``) or as a path segment before the
operation, ``http://127.0.0.1:8081/<token>``, for the Web UI, which cannot add a header of its
own. The token is kept in a 0600 file beside the ring and printed at start. CORS admits the Web
UI's origins only (``--ui-origin``; default: the config's UI port on localhost and 127.0.0.1). It
listens on loopback unless told otherwise; anywhere else it belongs behind TLS.
"""

from __future__ import annotations

import argparse
import os
import secrets
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response
from google.protobuf import json_format
from temporalio.api.common.v1 import Payloads

from iris.config import ConfigError
from iris.payloadcodec import EncryptionCodec, Keyring, PayloadKeyError, keyring_path, read_keyring

DEFAULT_PORT = 8081
OPERATIONS = ("encode", "decode")


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse(status_code=status, content={"error": message})


def create_app(keyring: Keyring, token: str, ui_origins: list[str]) -> FastAPI:
    """The codec server's app: ``keyring``'s codec behind ``token``, CORS for ``ui_origins``."""
    if len(token) < 16:
        raise ValueError("the codec server's token must be at least 16 characters")
    codec = EncryptionCodec(keyring)
    app = FastAPI(title="Iris codec server", docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(
        CORSMiddleware,
        allow_origins=ui_origins,
        allow_methods=["POST"],
        allow_headers=["Content-Type", "X-Namespace", "Authorization"],
        allow_credentials=True,
    )

    def authorized(request: Request, prefix: list[str]) -> bool:
        given = [s for s in prefix if s]
        header = request.headers.get("authorization", "")
        if header.lower().startswith("bearer "):
            given.append(header[7:].strip())
        # Every candidate is compared, in constant time each: no early exit tells which one was close.
        matches = [secrets.compare_digest(c.encode(), token.encode()) for c in given]
        return any(matches)

    @app.post("/{path:path}")
    async def operate(path: str, request: Request) -> Response:
        *prefix, operation = path.rstrip("/").split("/")
        if operation not in OPERATIONS:
            return _error(404, "not found: POST …/encode or …/decode")
        if not authorized(request, prefix):
            return _error(
                401, "a token is required (Authorization: Bearer <token>, or /<token>/" + operation + ")"
            )
        payloads = Payloads()
        try:
            json_format.Parse(await request.body(), payloads)
        except (json_format.ParseError, UnicodeDecodeError) as exc:
            return _error(400, f"not a Payloads message in protobuf JSON: {exc}")
        try:
            out = await (codec.encode if operation == "encode" else codec.decode)(payloads.payloads)
        except PayloadKeyError as exc:
            return _error(400, str(exc))
        return Response(json_format.MessageToJson(Payloads(payloads=out)), media_type="application/json")

    return app


def ensure_token(path: Path) -> str:
    """The token in ``path``, created (random, 0600) if absent."""
    try:
        return path.read_text().strip()
    except FileNotFoundError:
        pass
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    token = secrets.token_urlsafe(32)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:  # made meanwhile by another start
        return path.read_text().strip()
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")
    return token


def default_origins() -> list[str]:
    from iris.config import load_config

    try:
        port = load_config().temporal.ui_port
    except ConfigError:
        port = 8233
    return [f"http://localhost:{port}", f"http://127.0.0.1:{port}"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m iris.codecserver", description=__doc__.split("\n\n")[0])
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: loopback only)")
    p.add_argument("--port", type=int, default=DEFAULT_PORT)
    p.add_argument("--keys", type=Path, help="the payload key ring (default: $IRIS_PAYLOAD_KEYS, else yours)")
    p.add_argument("--token-file", type=Path, help="default: codec-server.token beside the ring")
    p.add_argument("--ui-origin", action="append", help="the Web UI's origin, e.g. http://localhost:8233")
    args = p.parse_args(argv)
    ring_file = args.keys or keyring_path()
    try:
        keyring = read_keyring(ring_file)
    except ConfigError as exc:
        print(f"error: {exc}")
        return 2
    token = ensure_token(args.token_file or ring_file.with_name("codec-server.token"))
    origins = args.ui_origin or default_origins()
    url = f"http://{args.host}:{args.port}"
    print(f"codec server on {url} with the ring {ring_file} (current key {keyring.current})")
    print(f"  Web UI (its codec server setting): {url}/{token}")
    print(f"  temporal CLI: --codec-endpoint {url} --codec-auth 'Bearer {token}'")
    print(f"  CORS origins: {', '.join(origins)}")
    import uvicorn

    uvicorn.run(create_app(keyring, token, origins), host=args.host, port=args.port, log_level="warning")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
