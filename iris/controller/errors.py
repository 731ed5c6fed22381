"""Typed errors of the controller API, shared by the service and its client.

The service raises these; the client maps an error response (or a transport failure) back to the
same class, so callers write ``except AlreadyExists`` on either side of the wire.
"""

from __future__ import annotations

from collections.abc import Callable

from iris.controller.models import ErrorCode


class ControllerError(Exception):
    """An error with a stable code (docs/DESIGN.md, "Errors, retries and parking") and a human
    message."""

    code: ErrorCode = ErrorCode.UNAVAILABLE

    def __init__(self, code: ErrorCode | str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = ErrorCode(code)
        self.message = message

    @property
    def retryable(self) -> bool:
        """Transient errors worth retrying with backoff; refusals are final (docs/DESIGN.md,
        "Errors, retries and parking")."""
        return self.code in (ErrorCode.UNAVAILABLE, ErrorCode.UNAUTHENTICATED)

    @property
    def http_status(self) -> int:
        return self.code.http_status


class PermissionDenied(ControllerError):
    def __init__(self, message: str) -> None:
        super().__init__(ErrorCode.PERMISSION_DENIED, message)


class InvalidArgument(ControllerError):
    def __init__(self, message: str) -> None:
        super().__init__(ErrorCode.INVALID_ARGUMENT, message)


class AlreadyExists(ControllerError):
    def __init__(self, message: str) -> None:
        super().__init__(ErrorCode.ALREADY_EXISTS, message)


class NotFound(ControllerError):
    def __init__(self, message: str) -> None:
        super().__init__(ErrorCode.NOT_FOUND, message)


class Unauthenticated(ControllerError):
    def __init__(self, message: str) -> None:
        super().__init__(ErrorCode.UNAUTHENTICATED, message)


class Unavailable(ControllerError):
    def __init__(self, message: str) -> None:
        super().__init__(ErrorCode.UNAVAILABLE, message)


_BY_CODE: dict[ErrorCode, Callable[[str], ControllerError]] = {
    ErrorCode.PERMISSION_DENIED: PermissionDenied,
    ErrorCode.INVALID_ARGUMENT: InvalidArgument,
    ErrorCode.ALREADY_EXISTS: AlreadyExists,
    ErrorCode.NOT_FOUND: NotFound,
    ErrorCode.UNAUTHENTICATED: Unauthenticated,
    ErrorCode.UNAVAILABLE: Unavailable,
}


def error_for(code: ErrorCode | str, message: str) -> ControllerError:
    """The typed exception for ``code``; an unknown code becomes a plain ControllerError."""
    try:
        cls = _BY_CODE[ErrorCode(code)]
    except ValueError:
        return ControllerError(ErrorCode.UNAVAILABLE, f"{code}: {message}")
    return cls(message)
