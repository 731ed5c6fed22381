"""`iris keys ...`: a cluster's signing identity (docs/DESIGN.md, "Where secrets live") and the
payload key ring (docs/SECURITY.md, "Payload encryption")."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from cli import common

keys_app = typer.Typer(
    rich_markup_mode=None,
    help="Create the Ed25519 key pairs clusters sign handoffs with, and the payload key ring.",
    no_args_is_help=True,
)

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
    """Create every missing key pair the federation config names, and the payload key ring
    (DIR/payload/payload.keys: for the worker; never mount it into a controller)."""
    from iris.config import ConfigError
    from iris.controller.identity import default_key_dir, ensure_cluster_keys
    from iris.keydirs import ensure_payload_keys, provision_key_dirs

    key_dir = dir or default_key_dir()
    cfg = common.config()
    try:
        if per_cluster:
            dirs = provision_key_dirs(cfg, key_dir)
            created = dirs.created
            for name, path in dirs.dirs.items():
                typer.echo(f"{name}: {path}")
        else:
            created = ensure_cluster_keys(cfg, key_dir)
        ring, ring_created = ensure_payload_keys(cfg, key_dir)
    except ConfigError as exc:
        common.fail(str(exc), common.EXIT_INVALID)
    typer.echo(f"created keys for: {', '.join(created)}" if created else f"all keys present in {key_dir}")
    typer.echo(f"payload key ring: {ring}{' (created)' if ring_created else ''}")


@keys_app.command("payload")
def payload_command(
    file: Annotated[
        Path | None,
        typer.Option(
            "--file",
            help="The ring (default: DIR/payload/payload.keys with --dir, else $IRIS_PAYLOAD_KEYS, "
            "else your own: payload.keys in the user key directory).",
        ),
    ] = None,
    dir: Annotated[
        Path | None, typer.Option("--dir", help="A key directory, as `iris keys ensure --dir` makes.")
    ] = None,
    rotate: Annotated[
        bool,
        typer.Option("--rotate", help="Add a new current key; the older ones still decrypt."),
    ] = False,
    install: Annotated[
        bool,
        typer.Option(
            "--install",
            help="Also merge the ring into your own, which this CLI reads (its current key current).",
        ),
    ] = False,
) -> None:
    """Create the payload key ring if absent (0600) and list its key ids, never the keys. The
    worker and every client encrypt job payloads in Temporal with its last key and decrypt with
    any of them; each needs the same ring (docs/SECURITY.md, "Payload encryption")."""
    from iris.config import ConfigError
    from iris.keydirs import payload_keyring_file
    from iris.payloadcodec import KEYRING_NAME, ensure_keyring, install_keyring, keyring_path, rotate_keyring
    from iris.userauth import user_key_dir

    if file is not None and dir is not None:
        common.fail("give --file or --dir, not both", common.EXIT_INVALID)
    path = file or (payload_keyring_file(dir) if dir is not None else keyring_path())
    try:
        ring, created = ensure_keyring(path)
        if rotate:
            ring = rotate_keyring(path)
        own = user_key_dir() / KEYRING_NAME
        if install and own.resolve() != path.resolve():
            install_keyring(own, ring)
    except ConfigError as exc:
        common.fail(str(exc), common.EXIT_INVALID)
    except OSError as exc:
        common.fail(f"cannot write {exc.filename}: {exc.strerror}", common.EXIT_INVALID)
    typer.echo(f"{'created' if created else 'existing'} ring: {path}")
    for key_id in ring.ids:
        typer.echo(f"  {key_id}{'  (current: encrypts)' if key_id == ring.current else ''}")
    if rotate:
        typer.echo("rotated: restart the workers, then give every client the new ring")
    if install:
        typer.echo(f"installed in your ring: {own}")


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
