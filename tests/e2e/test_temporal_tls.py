"""Mutual TLS to Temporal's frontend (issue 16, "Compose, secure by default"; docs/DESIGN.md, "Where
secrets live").

docker-compose.yml runs Temporal's frontend with mTLS, certificates from `iris keys tls`, and every
client connects with the config's ``[temporal.tls]``. The dev server has no TLS of its own, so here a
TLS terminator that requires a client certificate from the same CA (as Temporal's
``requireClientAuth``) stands in front of a real dev server: the worker's connection
(``iris.temporal.connect``) gets through with the certificates `iris keys tls` made; a plaintext
client, a client without a certificate and one with a certificate from another CA do not.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from collections.abc import AsyncIterator
from datetime import timedelta
from pathlib import Path

import pytest
from temporalio.client import Client
from temporalio.service import TLSConfig
from temporalio.testing import WorkflowEnvironment

from iris import devstack
from iris.config import ConfigError, FederationConfig, TemporalTLSConfig, load_config
from iris.temporal import connect
from iris.tlscerts import ensure_tls


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    except (ConnectionError, ssl.SSLError):
        pass
    finally:
        with contextlib.suppress(Exception):
            writer.close()


# A dev server start that fails is tried again this often (as tests/conftest.py's stacks are).
START_TRIES = 3


@pytest.fixture(scope="module")
async def tls_frontend(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[tuple[str, Path]]:
    """A real dev server behind a TLS terminator requiring a client certificate: (address, certs)."""
    certs = tmp_path_factory.mktemp("tls")
    ensure_tls(certs, ["temporal", "127.0.0.1"])
    # Tried again on failure, as the stacks are (tests/conftest.py, STACK_START_TRIES): the SDK
    # picks a free port, which another test process may take before the server binds it (CI run M:
    # "did not start within 60s", connection refused throughout).
    for attempt in range(1, START_TRIES + 1):
        try:
            env = await WorkflowEnvironment.start_local(
                dev_server_existing_path=str(devstack.venv_bin("temporal")),
                dev_server_startup_timeout=timedelta(seconds=60),
            )
            break
        except RuntimeError:
            if attempt == START_TRIES:
                raise
    backend = env.client.service_client.config.target_host
    host, _, port = backend.rpartition(":")
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(certs / "server" / "server.pem", certs / "server" / "server.key")
    ctx.load_verify_locations(certs / "server" / "ca.pem")
    ctx.verify_mode = ssl.CERT_REQUIRED
    ctx.set_alpn_protocols(["h2"])

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection(host, int(port))
        await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer))

    server = await asyncio.start_server(handle, "127.0.0.1", 0, ssl=ctx)
    address = f"127.0.0.1:{server.sockets[0].getsockname()[1]}"
    try:
        yield address, certs
    finally:
        server.close()
        await env.shutdown()


def _config(address: str, tls: TemporalTLSConfig | None) -> FederationConfig:
    cfg = load_config()
    cfg.temporal.address = address
    cfg.temporal.tls = tls
    return cfg


async def _reachable(client: Client) -> bool:
    return await client.service_client.check_health(timeout=timedelta(seconds=5))


async def test_the_worker_connects_with_the_certificates_the_keys_service_makes(
    tls_frontend: tuple[str, Path],
) -> None:
    address, certs = tls_frontend
    tls = TemporalTLSConfig(
        server_ca=str(certs / "client" / "ca.pem"),
        client_cert=str(certs / "client" / "client.pem"),
        client_key=str(certs / "client" / "client.key"),
        server_name="temporal",
    )
    client = await asyncio.wait_for(connect(_config(address, tls)), 30)
    assert await _reachable(client)


async def test_a_client_without_a_certificate_from_the_ca_is_refused(
    tls_frontend: tuple[str, Path], tmp_path: Path
) -> None:
    address, certs = tls_frontend
    ca = (certs / "client" / "ca.pem").read_bytes()
    ensure_tls(tmp_path / "other", ["temporal"])  # another CA, same names
    attempts = {
        "plaintext": None,
        "no client certificate": TLSConfig(server_root_ca_cert=ca, domain="temporal"),
        "a certificate from another CA": TLSConfig(
            server_root_ca_cert=ca,
            domain="temporal",
            client_cert=(tmp_path / "other" / "client" / "client.pem").read_bytes(),
            client_private_key=(tmp_path / "other" / "client" / "client.key").read_bytes(),
        ),
    }
    for what, tls in attempts.items():
        with pytest.raises(Exception) as refused:
            client = await asyncio.wait_for(Client.connect(address, tls=tls or False), 30)
            await client.service_client.check_health(timeout=timedelta(seconds=5))
        assert not isinstance(refused.value, TimeoutError), what


def test_unreadable_certificate_files_are_one_line_config_errors(tmp_path: Path) -> None:
    from iris.temporal import connect_args

    cfg = _config("127.0.0.1:1", TemporalTLSConfig(server_ca=str(tmp_path / "missing.pem")))
    with pytest.raises(ConfigError, match="cannot read the server CA"):
        connect_args(cfg)
    with pytest.raises(ValueError, match="client_cert and client_key go together"):
        TemporalTLSConfig(client_cert="a.pem")
