#!/usr/bin/env bash
# Debian's `prometheus` package unpacked into .data/prometheus, without a system install (no root
# needed beyond what apt-get download needs): tests/e2e/test_metrics.py runs
# .data/prometheus/usr/bin/prometheus against `iris dev` (docs/DESIGN.md, "Metrics"). .ci/run calls
# this; it does nothing when the binary is already there.
set -euo pipefail
cd "$(dirname "$0")/.."

dest=.data/prometheus
bin="$dest/usr/bin/prometheus"
if [ -x "$bin" ]; then
  exit 0
fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
# apt-get download needs the package lists; refresh them only if the first try fails.
if ! (cd "$work" && apt-get download prometheus >/dev/null 2>&1); then
  apt-get update -qq
  (cd "$work" && apt-get download prometheus >/dev/null)
fi
rm -rf "$dest"
mkdir -p "$dest"
dpkg -x "$work"/prometheus_*.deb "$dest"
"$bin" --version 2>&1 | head -1
