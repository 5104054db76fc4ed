"""kvrouter: KV-cache-aware LLM request routing, over libkvrouter's C ABI (kvrouter.h 0.2).

    import kvrouter
    with kvrouter.Router(block_size=16) as router:
        router.add_worker(1)
        result = router.find_best_match(tokens, request_id="req-1")   # books the request
        router.mark_prefill_completed("req-1")                       # first token
        router.free_request("req-1")                                 # request ended

Errors raise :class:`KvRouterError` subclasses carrying the C status; handles close with
``with`` blocks; calls that can block release the GIL. ``kvrouter.dynamo`` has a surface
compatible with Dynamo's (``compute_block_hash_for_seq``, ``RadixTree``).

This release accepts libkvrouter 0.2.x only (the wheel carries its own copy); importing it
with a library of another major.minor raises ImportError.
"""

from __future__ import annotations

import atexit
from typing import Any, Dict, List, Optional, Sequence

from . import _abi
from ._abi import (
    ABI_VERSION,
    CostFunction,
    DisaggPolicy,
    Engine,
    EventKind,
    EventOutcome,
    IngestReject,
    Phase,
    PrefillReason,
    QueuePolicy,
    SessionMode,
    Status,
    Tier,
)

try:
    from . import _native
except ImportError as exc:  # the extension or libkvrouter.so.0.2 could not be loaded
    raise ImportError(
        f"kvrouter: the native extension could not be loaded ({exc}); this package needs "
        f"libkvrouter {ABI_VERSION[0]}.{ABI_VERSION[1]}.x"
    ) from exc


def _check_abi(library_version: int, compiled: Dict[str, Any]) -> None:
    """Refuses a library or an extension of another ABI than the one _abi.py was generated for."""
    want = f"{ABI_VERSION[0]}.{ABI_VERSION[1]}"
    major, minor = library_version // 10000, library_version // 100 % 100
    if (major, minor) != ABI_VERSION[:2]:
        raise ImportError(
            f"kvrouter: the loaded libkvrouter is {major}.{minor}.{library_version % 100}, this "
            f"package accepts {want}.x only (at 0.x a minor release may change the ABI)"
        )
    if tuple(compiled["version"][:2]) != ABI_VERSION[:2]:
        raise ImportError(f"kvrouter: the extension was compiled against kvrouter.h {compiled['version']}, not {want}")
    enums = {typedef: {v.name: int(v) for v in cls} for typedef, cls in _abi.ENUMERATIONS}
    if compiled["enumerations"] != enums or compiled["constants"] != _abi.CONSTANTS:
        raise ImportError(
            "kvrouter: the extension and kvrouter/_abi.py were made from different kvrouter.h "
            "headers (their enumerations or constants differ): rebuild the package"
        )


_check_abi(_native.version(), _native.abi())

from ._errors import (  # noqa: E402
    AlreadyExistsError,
    ClosedError,
    DeadlineExceededError,
    ERROR_CLASSES,
    FailedPreconditionError,
    InternalError,
    InvalidArgumentError,
    KvRouterError,
    NotFoundError,
    RequestCancelledError,
    ResourceExhaustedError,
    UnavailableError,
    UnimplementedError,
)

from ._prompt import HashedPrompt, Prompt  # noqa: E402

_native.setup(
    KvRouterError,
    {int(k): v for k, v in ERROR_CLASSES.items()},
    ClosedError,
    {typedef: cls for typedef, cls in _abi.ENUMERATIONS},
    HashedPrompt,
)

# Registered at import, so run after the exit handlers registered later (they run last first):
# from then on, a replica publisher called on another thread drops its change rather than ask
# for the GIL of an interpreter that is finalizing (which ends that thread inside the library).
atexit.register(_native.close_publishers_at_exit)

from ._native import (  # noqa: E402
    Candidate,
    IngestStats,
    Match,
    Metrics,
    Overlap,
    PotentialLoad,
    PrefillResult,
    RouteResult,
    RouteSignals,
)
from ._options import (  # noqa: E402
    DisaggOptions,
    EngineWorker,
    IngestOptions,
    Ints,
    RemovedEvent,
    RequestOptions,
    RouterOptions,
    RoutingHints,
    StoredEvent,
    WorkerConfig,
    _flatten_mm,
)
from ._router import Disagg, Router  # noqa: E402
from ._ingest import EventBatch, Ingest, Listener, Publisher  # noqa: E402

#: The package's version: the library version it was built with and carries.
__version__ = _native.version_string()


def version() -> int:
    """The loaded library's ``kvr_version()`` (major*10000 + minor*100 + patch)."""
    return _native.version()


def version_string() -> str:
    """The loaded library's version as "MAJOR.MINOR.PATCH"."""
    return _native.version_string()


def status_str(status: int) -> str:
    """A status's C name ("KVR_NOT_FOUND"; "KVR_UNKNOWN" for a code the library does not know)."""
    return _native.status_str(status)


def tier_from_medium(medium: Optional[str]) -> Tier:
    """An engine's "medium" string (GPU, CPU_PINNED, DISK, ...) as a tier (unknown: device)."""
    return Tier(_native.tier_from_medium(medium))


def compute_block_hashes(
    tokens: Ints,
    block_size: int,
    *,
    lora_name: Optional[str] = None,
    cache_namespace: Optional[str] = None,
    mm_hashes: Optional[Sequence[Optional[Sequence[int]]]] = None,
    eagle: bool = False,
) -> List[int]:
    """Dynamo's local block hashes (XXH3-64, seed 1337) of every complete block of ``tokens``.
    ``mm_hashes`` has one sequence of multimodal hashes per block; ``eagle`` uses windows of
    block_size + 1 tokens with stride block_size."""
    flat, counts = _flatten_mm(mm_hashes)
    return _native.compute_block_hashes(
        tokens, block_size, _abi.HASH_EAGLE if eagle else 0, lora_name, cache_namespace, flat, counts
    )


def compute_sequence_hashes(local_hashes: Ints) -> List[int]:
    """Dynamo's chained sequence hashes of local block hashes (one per input)."""
    return _native.compute_sequence_hashes(local_hashes)


__all__ = [
    "ABI_VERSION",
    "AlreadyExistsError",
    "Candidate",
    "ClosedError",
    "DeadlineExceededError",
    "Disagg",
    "DisaggOptions",
    "CostFunction",
    "DisaggPolicy",
    "Engine",
    "EngineWorker",
    "EventBatch",
    "EventKind",
    "EventOutcome",
    "FailedPreconditionError",
    "HashedPrompt",
    "Ingest",
    "IngestOptions",
    "IngestReject",
    "IngestStats",
    "InternalError",
    "InvalidArgumentError",
    "KvRouterError",
    "Listener",
    "Match",
    "Metrics",
    "NotFoundError",
    "Overlap",
    "Phase",
    "PotentialLoad",
    "PrefillReason",
    "PrefillResult",
    "Prompt",
    "Publisher",
    "QueuePolicy",
    "RemovedEvent",
    "RequestCancelledError",
    "RequestOptions",
    "ResourceExhaustedError",
    "RouteResult",
    "RouteSignals",
    "Router",
    "RouterOptions",
    "RoutingHints",
    "SessionMode",
    "Status",
    "StoredEvent",
    "Tier",
    "UnavailableError",
    "UnimplementedError",
    "WorkerConfig",
    "compute_block_hashes",
    "compute_sequence_hashes",
    "status_str",
    "tier_from_medium",
    "version",
    "version_string",
]
