"""Errors the federation store raises (refusals the CAS decides are results, not exceptions)."""

from __future__ import annotations


class StoreError(Exception):
    """The store cannot be used as asked (bad URL, schema newer than this code, ...)."""


class StoreConflict(StoreError):
    """A write contradicts a live handle, e.g. enqueueing a new incarnation over a running one."""
