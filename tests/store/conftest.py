"""Every store test runs on SQLite (a temporary file) and on PostgreSQL (a fresh schema each).

PostgreSQL comes from ``IRIS_TEST_POSTGRES_URL`` (CI sets it), else the local default; when no
server answers, the PostgreSQL variants skip and say why.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import Engine, create_engine
from store_factories import Stores

from iris.store import FederationStore

DEFAULT_POSTGRES_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/test"


@pytest.fixture(scope="session")
def postgres_admin() -> Iterator[Engine]:
    """An engine on the test database, or a skip naming the URL and the error."""
    url = os.environ.get("IRIS_TEST_POSTGRES_URL") or DEFAULT_POSTGRES_URL
    engine = create_engine(url, connect_args={"connect_timeout": 3}, pool_size=1)
    try:
        with engine.connect() as conn:
            conn.exec_driver_sql("SELECT 1")
    except Exception as exc:
        engine.dispose()
        pytest.skip(f"PostgreSQL not reachable at {url}: {type(exc).__name__}: {exc}".splitlines()[0])
    yield engine
    engine.dispose()


@pytest.fixture(params=["sqlite", "postgresql"])
def stores(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Stores]:
    if request.param == "sqlite":
        factory = Stores("sqlite", f"sqlite:///{tmp_path / 'federation.db'}")
        try:
            yield factory
        finally:
            factory.close_all()
        return
    admin: Engine = request.getfixturevalue("postgres_admin")
    schema = f"iris_store_test_{uuid.uuid4().hex[:12]}"
    factory = Stores("postgresql", admin.url.render_as_string(hide_password=False), schema)
    try:
        yield factory
    finally:
        factory.close_all()
        with admin.begin() as conn:
            conn.exec_driver_sql(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')


@pytest.fixture
def store(stores: Stores) -> FederationStore:
    return stores.open()
