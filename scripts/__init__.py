"""Operational scripts: the history recorder and the chaos suite (see docs/RELIABILITY.md)."""
