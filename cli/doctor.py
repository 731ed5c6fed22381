"""`iris doctor`: what the full test suite needs on this machine, one line each; `--install`
installs or starts what is missing (README, "Prerequisites").

Each check is what the tests themselves look for, so a machine the doctor passes runs `uv run
pytest` with no skip but the opt-in chaos suite (docs/DESIGN.md, "The test suite's layout").
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import typer

from iris.defaults import PROJECT_ROOT

# Where tests/e2e/test_metrics.py looks first (scripts/install-prometheus.sh unpacks it there).
PROMETHEUS = PROJECT_ROOT / ".data" / "prometheus" / "usr" / "bin" / "prometheus"
# The store tests' PostgreSQL (tests/store/conftest.py), unless IRIS_TEST_POSTGRES_URL names another.
DEFAULT_POSTGRES_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/test"
POSTGRES_URL_ENV = "IRIS_TEST_POSTGRES_URL"


@dataclass
class Check:
    name: str
    ok: bool
    detail: str
    # How to fix it, as the line says; None when nothing can be installed (e.g. root).
    fix: str | None = None
    install: Callable[[], None] | None = None


def _run(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, timeout=600, check=False)


def _apt_install(*packages: str) -> Callable[[], None]:
    def install() -> None:
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        for argv in (["apt-get", "update", "-qq"], ["apt-get", "install", "-y", "-qq", *packages]):
            subprocess.run(argv, check=True, env=env, capture_output=True, timeout=900)

    return install


def check_uv() -> Check:
    found = shutil.which("uv")
    return Check("uv", found is not None, found or "not on PATH", "pip install uv")


def check_root() -> Check:
    root = os.geteuid() == 0 and shutil.which("setpriv") is not None
    detail = "yes" if root else "no: the tests that run jobs as other users (sandbox pool uids) skip"
    return Check("root", root, detail, "run the suite as root")


def check_bwrap() -> Check:
    found = shutil.which("bwrap")
    if found is None:
        fix = "apt-get install bubblewrap"
        return Check("bubblewrap", False, "bwrap not installed", fix, _apt_install("bubblewrap"))
    works = _run(found, "--ro-bind", "/", "/", "--unshare-pid", "true")
    if works.returncode != 0:
        why = (works.stderr.strip().splitlines() or ["no output"])[0]
        return Check("bubblewrap", False, f"{found} cannot make a sandbox here: {why}", None)
    return Check("bubblewrap", True, found)


def check_slurm() -> Check:
    """Debian's Slurm and munge: the Slurm backend's tests start a single-node Slurm of their own
    (iris/slurmdev.py)."""
    from iris import slurmdev

    missing = slurmdev.missing_packages()
    if missing:
        detail = f"missing {', '.join(missing)} (the Slurm backend's tests)"
        return Check("slurm", False, detail, slurmdev.INSTALL_HINT, _apt_install(*missing))
    if os.geteuid() != 0:
        return Check("slurm", False, "installed; its daemons run as root (the Slurm tests skip)", None)
    return Check("slurm", True, str(slurmdev.command("slurmctld")))


def check_chromium() -> Check:
    found = shutil.which("chromium") or ("/usr/bin/chromium" if Path("/usr/bin/chromium").exists() else None)
    if found is None:
        fix = "apt-get install chromium"
        return Check("chromium", False, "not installed (the Web UI test)", fix, _apt_install("chromium"))
    return Check("chromium", True, found)


def check_prometheus() -> Check:
    found = PROMETHEUS if PROMETHEUS.exists() else shutil.which("prometheus")
    if found is None:
        script = PROJECT_ROOT / "scripts" / "install-prometheus.sh"

        def install() -> None:
            subprocess.run([str(script)], check=True, capture_output=True, timeout=900)

        return Check(
            "prometheus", False, f"not at {PROMETHEUS} nor on PATH (the metrics test)", str(script), install
        )
    return Check("prometheus", True, str(found))


def _postgres_error(url: str) -> str | None:
    from sqlalchemy import create_engine

    engine = create_engine(url, connect_args={"connect_timeout": 3}, pool_size=1)
    try:
        with engine.connect() as conn:
            conn.exec_driver_sql("SELECT 1")
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}".splitlines()[0]
    finally:
        engine.dispose()
    return None


def _start_postgres(url: str) -> None:
    """Install PostgreSQL if absent, start its cluster, and create the test database (trust auth
    for local connections is the package's default for the `postgres` user on this machine)."""
    from sqlalchemy import create_engine, text
    from sqlalchemy.engine import make_url

    if shutil.which("pg_ctlcluster") is None:
        _apt_install("postgresql")()
    clusters = sorted(os.listdir("/etc/postgresql")) if Path("/etc/postgresql").is_dir() else []
    for version in clusters:
        _run("pg_ctlcluster", "--skip-systemctl-redirect", version, "main", "start")
    target = make_url(url)
    if target.database and _postgres_error(url) is not None:
        admin = create_engine(target.set(database="postgres"), isolation_level="AUTOCOMMIT")
        try:
            with admin.connect() as conn:
                exists = conn.execute(
                    text("SELECT 1 FROM pg_database WHERE datname = :d"), {"d": target.database}
                ).first()
                if exists is None:
                    conn.exec_driver_sql(f'CREATE DATABASE "{target.database}"')
        finally:
            admin.dispose()


def check_postgres() -> Check:
    url = os.environ.get(POSTGRES_URL_ENV) or DEFAULT_POSTGRES_URL
    error = _postgres_error(url)
    if error is None:
        return Check("postgresql", True, url)
    return Check(
        "postgresql",
        False,
        f"not reachable at {url}: {error} (the store tests)",
        f"start it, or set {POSTGRES_URL_ENV}",
        lambda: _start_postgres(url),
    )


CHECKS: list[Callable[[], Check]] = [
    check_uv,
    check_root,
    check_bwrap,
    check_chromium,
    check_slurm,
    check_prometheus,
    check_postgres,
]


def doctor_command(
    install: Annotated[
        bool,
        typer.Option(
            "--install",
            help="Install or start what is missing: Debian's bubblewrap, chromium, Slurm and postgresql "
            "(apt-get), Prometheus (scripts/install-prometheus.sh), the PostgreSQL test database.",
        ),
    ] = False,
) -> None:
    """Check what the full test suite needs here (uv, root, bubblewrap, chromium, Slurm, Prometheus,
    PostgreSQL), one line each; exit 1 if anything is missing. With --install, fix what it can."""
    missing = 0
    for make in CHECKS:
        check = make()
        if not check.ok and install and check.install is not None:
            try:
                check.install()
            except Exception as exc:  # apt-get, the script or the database refused: say so, go on
                why = f"{type(exc).__name__}: {exc}".splitlines()[0]
                typer.echo(f"{'':<8} {check.name}: install failed: {why}")
            check = make()
        if check.ok:
            typer.echo(f"{'ok':<8} {check.name:<11} {check.detail}")
            continue
        missing += 1
        fix = f" — fix: {check.fix}" if check.fix else ""
        typer.echo(f"{'MISSING':<8} {check.name:<11} {check.detail}{fix}")
    if missing:
        hint = "" if install else " (iris doctor --install fixes what it can)"
        typer.echo(f"{missing} missing: the tests needing them skip{hint}")
    raise typer.Exit(1 if missing else 0)
