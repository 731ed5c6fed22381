"""`iris keys ...`: a cluster's signing identity (docs/DESIGN.md, "Where secrets live")."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from cli import common

keys_app = typer.Typer(help="Create the Ed25519 key pairs clusters sign handoffs with.", no_args_is_help=True)

KeyDir = Annotated[
    Path | None,
    typer.Option("--dir", help="Key directory (default: $IRIS_KEY_DIR, else the current directory)."),
]


@keys_app.command("generate")
def generate_command(
    cluster: Annotated[str, typer.Argument(help="The cluster's name.")], dir: KeyDir = None
) -> None:
    """Write DIR/CLUSTER.key (private, mode 0600) and DIR/CLUSTER.pub; never overwrites a key."""
    from iris.controller.identity import default_key_dir, generate_keypair

    key_dir = dir or default_key_dir()
    key_dir.mkdir(parents=True, exist_ok=True)
    try:
        private, public = generate_keypair(key_dir, cluster)
    except FileExistsError:
        common.fail(
            f"{key_dir / (cluster + '.key')} already exists; not overwriting a key", common.EXIT_INVALID
        )
    typer.echo(f"private key: {private}  (keep it on {cluster}'s own machines)")
    typer.echo(f"public key:  {public}  (pin it in every cluster that trusts {cluster})")


@keys_app.command("ensure")
def ensure_command(
    dir: KeyDir = None,
    per_cluster: Annotated[
        bool,
        typer.Option(
            "--per-cluster",
            help="One directory per cluster, DIR/CLUSTER: its own private key and every cluster's "
            "public key (what `iris dev` does). Point each cluster's processes at their own.",
        ),
    ] = False,
) -> None:
    """Create every missing key pair the federation config names."""
    from iris.controller.identity import default_key_dir, ensure_cluster_keys
    from iris.keydirs import provision_key_dirs

    key_dir = dir or default_key_dir()
    if per_cluster:
        dirs = provision_key_dirs(common.config(), key_dir)
        created = dirs.created
        for name, path in dirs.dirs.items():
            typer.echo(f"{name}: {path}")
    else:
        created = ensure_cluster_keys(common.config(), key_dir)
    typer.echo(f"created keys for: {', '.join(created)}" if created else f"all keys present in {key_dir}")


@keys_app.command("user")
def user_command(
    user: Annotated[
        str | None, typer.Argument(help="The principal (default: $IRIS_USER, else the OS user).")
    ] = None,
    key: Annotated[
        Path | None,
        typer.Option(
            "--key",
            help="Key file (default: $IRIS_USER_KEY, else ~/.config/iris/users/USER.key; "
            "$IRIS_USER_KEY_DIR moves the directory).",
        ),
    ] = None,
) -> None:
    """Create USER's Ed25519 key (mode 0600, never overwritten) and print the public key to
    register in the federation config's [users] table; the CLI and SDK sign with it."""
    from iris.client import current_user
    from iris.userauth import AuthError, ensure_user_key, user_key_path

    principal = user or current_user()
    path = key or user_key_path(principal)
    try:
        public, created = ensure_user_key(path)
    except (AuthError, OSError) as exc:
        why = str(exc) if isinstance(exc, AuthError) else f"cannot write {path}: {exc.strerror}"
        common.fail(why, common.EXIT_INVALID)
    typer.echo(f"{'created' if created else 'existing'} key: {path}  (private: keep it on your machine)")
    typer.echo("register it in the federation config (roles: user, admin):")
    typer.echo(f'[users."{principal}"]\npublic_keys = ["{public}"]\nroles = ["user"]')


@keys_app.command("tls")
def tls_command(
    dir: Annotated[Path, typer.Option("--dir", help="Where to write ca/, server/ and client/.")],
    server_name: Annotated[
        list[str],
        typer.Option(
            "--server-name", help="A name (or IP) the Temporal server certificate carries; repeatable."
        ),
    ],
    client: Annotated[
        list[str] | None,
        typer.Option(
            "--client", help="A client certificate to make, in DIR/NAME (default: client); repeatable."
        ),
    ] = None,
) -> None:
    """Create, once, a CA and from it Temporal's server certificate and client certificates for
    mutual TLS (what docker-compose.yml's keys service runs); never overwrites."""
    from iris.tlscerts import ensure_tls

    created = ensure_tls(dir, server_name, tuple(client or ["client"]))
    typer.echo(f"created: {', '.join(created)}" if created else f"all certificates present in {dir}")
