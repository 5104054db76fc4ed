"""A prompt given hashed (``KVR_REQUEST_PREHASHED``): what every routing call takes instead of
token ids. Apart from the option types (``_options``) since the extension is told of the class
(``_native.setup``) before those are imported."""

from __future__ import annotations

import operator
from collections.abc import Mapping, Set
from dataclasses import dataclass
from typing import Any, Sequence, Union


@dataclass(frozen=True)
class HashedPrompt:
    """A prompt given as its local block hashes, one per complete block, and its length in
    tokens: pass it wherever a routing call takes ``tokens`` (``find_best_match``,
    ``find_best_match_with_candidates``, ``preview_route``, ``plan_route``, ``add_request``,
    ``overlap_scores``, ``potential_loads``, and ``Disagg.route_prefill``, ``route_decode``,
    ``prefill_worker_busy``). No token is hashed in the call, and the decision, the booking and
    the prices are those of the tokens.

    Hash with :func:`kvrouter.compute_block_hashes` (or take an engine's local hashes) with the
    router's block size and the prompt's ``lora_name``, ``cache_namespace``, ``mm_hashes`` and
    ``eagle``: those are in the hashes, so the call's :class:`RequestOptions` no longer apply
    them. A call raises :class:`InvalidArgumentError` unless ``local_hashes`` holds exactly the
    complete blocks of ``num_tokens`` tokens.

    ``local_hashes`` is read by each call as tokens are: in place from a C-contiguous buffer of
    8-byte unsigned integers (``array.array('Q')``, numpy ``uint64``), held for that call only,
    or converted from any other integer buffer or sequence (an iterator is made a tuple here, so
    that the prompt can be used again). Frozen: one prompt can go to any number of calls and
    routers.
    """

    local_hashes: Sequence[int]
    num_tokens: int

    def __post_init__(self) -> None:
        num_tokens = operator.index(self.num_tokens)
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, not {num_tokens}")
        object.__setattr__(self, "num_tokens", num_tokens)
        hashes: Any = self.local_hashes
        if isinstance(hashes, (str, bytes, bytearray)):
            raise TypeError(f"local_hashes must be integers, not {type(hashes).__name__}")
        if isinstance(hashes, (Set, Mapping)):  # no order: the blocks would be shuffled
            raise TypeError(f"local_hashes must be in block order, not a {type(hashes).__name__}")
        if not isinstance(hashes, (list, tuple)):
            try:
                memoryview(hashes).release()  # a buffer: read by each call
            except TypeError:
                object.__setattr__(self, "local_hashes", tuple(hashes))


Prompt = Union[Sequence[int], HashedPrompt]
"""What a routing call takes as its prompt: token ids (as ``Ints``), or a :class:`HashedPrompt`."""
