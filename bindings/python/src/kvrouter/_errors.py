"""Exceptions: every failure of a libkvrouter call raises a KvRouterError carrying its status."""

from __future__ import annotations

from typing import Dict, Tuple, Type, Union

from ._abi import Status


class KvRouterError(Exception):
    """A libkvrouter call failed: ``status`` is the C status (a :class:`Status`, or the plain
    int of a status this package does not know), ``message`` the library's message.

    Each status has a subclass (:class:`NotFoundError`, :class:`AlreadyExistsError`, ...), so
    ``except kvrouter.NotFoundError`` and ``err.status == Status.NOT_FOUND`` both work; several
    also derive from the matching built-in exception (``ValueError``, ``LookupError``,
    ``TimeoutError``, ``NotImplementedError``).
    """

    status: Union[Status, int]
    message: str

    def __init__(self, status: int, message: str = "") -> None:
        try:
            self.status = Status(status)
        except ValueError:
            self.status = status
        self.message = message
        name = self.status.name if isinstance(self.status, Status) else f"status {status}"
        super().__init__(f"{name}: {message}" if message else name)

    def __reduce__(self) -> Tuple[type, Tuple[int, str]]:  # keeps the status through pickling
        return (type(self), (int(self.status), self.message))


class RequestCancelledError(KvRouterError):
    """KVR_CANCELLED: the request was freed while it waited in the admission queue, or the
    queue was closed (:meth:`Router.close_queue`, :meth:`Router.close`)."""


class InvalidArgumentError(KvRouterError, ValueError):
    """KVR_INVALID_ARGUMENT: an argument or an option is invalid; the message names it."""


class DeadlineExceededError(KvRouterError, TimeoutError):
    """KVR_DEADLINE_EXCEEDED: the request's queue timeout passed."""


class NotFoundError(KvRouterError, LookupError):
    """KVR_NOT_FOUND: an unknown worker, rank, request, plan, session, source or block."""


class AlreadyExistsError(KvRouterError):
    """KVR_ALREADY_EXISTS: a worker, request id, subscription or booking that exists already."""


class ResourceExhaustedError(KvRouterError):
    """KVR_RESOURCE_EXHAUSTED: a limit of the library was reached."""


class FailedPreconditionError(KvRouterError):
    """KVR_FAILED_PRECONDITION: the call does not fit the object's state or mode."""


class UnimplementedError(KvRouterError, NotImplementedError):
    """KVR_UNIMPLEMENTED: a feature this build of the library does not have."""


class InternalError(KvRouterError):
    """KVR_INTERNAL: a bug or an unexpected failure inside the library."""


class UnavailableError(KvRouterError):
    """KVR_UNAVAILABLE: no eligible worker, or a server or endpoint that cannot be reached."""


class ClosedError(ValueError):
    """A call on a Router, Disagg, Ingest, EventBatch or Publisher after its ``close()``."""


#: The exception class raised for each status.
ERROR_CLASSES: Dict[int, Type[KvRouterError]] = {
    Status.CANCELLED: RequestCancelledError,
    Status.INVALID_ARGUMENT: InvalidArgumentError,
    Status.DEADLINE_EXCEEDED: DeadlineExceededError,
    Status.NOT_FOUND: NotFoundError,
    Status.ALREADY_EXISTS: AlreadyExistsError,
    Status.RESOURCE_EXHAUSTED: ResourceExhaustedError,
    Status.FAILED_PRECONDITION: FailedPreconditionError,
    Status.UNIMPLEMENTED: UnimplementedError,
    Status.INTERNAL: InternalError,
    Status.UNAVAILABLE: UnavailableError,
}
