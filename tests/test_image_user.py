"""The project image runs as a non-root user (docs/DESIGN.md, "Job → controller"): a job started by
a controller in it cannot be root."""

from __future__ import annotations

from pathlib import Path

PROJECT_ROOT = Path(__file__).resolve().parent.parent


def test_image_runs_as_non_root_user() -> None:
    lines = [line.split() for line in (PROJECT_ROOT / "Dockerfile").read_text().splitlines()]
    users = [words[1] for words in lines if len(words) > 1 and words[0].upper() == "USER"]
    assert users, "the Dockerfile sets no USER: the image runs as root"
    assert users[-1].split(":")[0] not in ("root", "0"), users[-1]
    # The state and key volumes must start out writable by that user.
    text = (PROJECT_ROOT / "Dockerfile").read_text()
    assert f"chown {users[-1]}:{users[-1]} /var/lib/iris /keys" in text
