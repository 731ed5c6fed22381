"""Shared types of the security suite (fixtures live in conftest.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from iris.config import FederationConfig
from iris.controller.identity import load_private_key

RESTRICTED_DOMAIN = "allowed.example"


@dataclass
class Keys:
    """Each cluster's own key directory (iris/keydirs.py): a test plays any cluster, the processes
    under test hold only their own key."""

    key_dirs: dict[str, Path]

    def private(self, config: FederationConfig, cluster: str) -> Ed25519PrivateKey:
        return load_private_key(config.cluster(cluster), self.key_dirs[cluster])


@dataclass
class Responses:
    """Every response body the security tests received, for the secret scan."""

    bodies: list[str] = field(default_factory=list)

    def add(self, text: str) -> str:
        self.bodies.append(text)
        return text


@dataclass
class Restricted:
    config: FederationConfig
    config_file: Path
    url: str
