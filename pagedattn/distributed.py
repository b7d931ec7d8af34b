"""Process-level context-parallel layout read by attention implementations.

This is the only global state in ``pagedattn``: which decode-context-parallel (DCP) and
prefill-context-parallel (PCP) group this process belongs to, fixed for its lifetime.
Per-step attention metadata is never stored here; it is passed explicitly to ``build``
and ``forward``.

No communication happens in this module: a group is only a ``(world_size, rank)`` pair
that ``AttentionImpl.__new__`` reads to decide how the KV cache is sharded across ranks.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from pagedattn.checks import require_int

__all__ = [
    "ParallelGroup",
    "ParallelStateNotInitializedError",
    "context_parallel_groups",
    "context_parallel_groups_initialized",
    "destroy_context_parallel_groups",
    "get_dcp_group",
    "get_pcp_group",
    "init_context_parallel_groups",
]


class ParallelStateNotInitializedError(RuntimeError):
    """Raised when a parallel group is read before ``init_context_parallel_groups``."""


@dataclass(frozen=True)
class ParallelGroup:
    """One process's place in a parallel group.

    Attributes:
        world_size: number of ranks in the group (>= 1).
        rank_in_group: this process's rank, in ``[0, world_size)``.
    """

    world_size: int
    rank_in_group: int

    def __post_init__(self) -> None:
        # A non-int is a TypeError; the ranges below raise ValueError.
        require_int("world_size", self.world_size, error=TypeError)
        require_int("rank_in_group", self.rank_in_group, error=TypeError)
        if self.world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {self.world_size}")
        if not 0 <= self.rank_in_group < self.world_size:
            raise ValueError(
                f"rank_in_group must be in [0, {self.world_size}), got {self.rank_in_group}"
            )


_lock = threading.Lock()
_dcp_group: ParallelGroup | None = None
_pcp_group: ParallelGroup | None = None


def init_context_parallel_groups(
    dcp_world_size: int = 1,
    dcp_rank: int = 0,
    pcp_world_size: int = 1,
    pcp_rank: int = 0,
) -> None:
    """Record this process's DCP and PCP groups.

    Calling it again with the same layout is a no-op; a different layout raises
    ``RuntimeError`` (call ``destroy_context_parallel_groups`` first), because impls
    built under the old layout would silently disagree with new ones.

    Raises:
        TypeError / ValueError: a size or rank is not an int or out of range.
        RuntimeError: groups already initialised with a different layout.
    """
    global _dcp_group, _pcp_group
    dcp = ParallelGroup(dcp_world_size, dcp_rank)
    pcp = ParallelGroup(pcp_world_size, pcp_rank)
    with _lock:
        if _dcp_group is not None:
            if (_dcp_group, _pcp_group) == (dcp, pcp):
                return
            raise RuntimeError(
                f"context-parallel groups already initialised as dcp={_dcp_group}, "
                f"pcp={_pcp_group}; got dcp={dcp}, pcp={pcp}. Call "
                "destroy_context_parallel_groups() first."
            )
        _dcp_group, _pcp_group = dcp, pcp


def destroy_context_parallel_groups() -> None:
    """Forget the groups (no-op when none are initialised)."""
    global _dcp_group, _pcp_group
    with _lock:
        _dcp_group = None
        _pcp_group = None


def context_parallel_groups_initialized() -> bool:
    return _dcp_group is not None


def _get(group: ParallelGroup | None, name: str) -> ParallelGroup:
    if group is None:
        raise ParallelStateNotInitializedError(
            f"{name} group is not initialised; call "
            "pagedattn.distributed.init_context_parallel_groups() first"
        )
    return group


def get_dcp_group() -> ParallelGroup:
    """The decode-context-parallel group.

    Raises:
        ParallelStateNotInitializedError: before ``init_context_parallel_groups``.
    """
    return _get(_dcp_group, "decode context parallel (DCP)")


def get_pcp_group() -> ParallelGroup:
    """The prefill-context-parallel group.

    Raises:
        ParallelStateNotInitializedError: before ``init_context_parallel_groups``.
    """
    return _get(_pcp_group, "prefill context parallel (PCP)")


@contextmanager
def context_parallel_groups(
    dcp_world_size: int = 1,
    dcp_rank: int = 0,
    pcp_world_size: int = 1,
    pcp_rank: int = 0,
) -> Iterator[None]:
    """Initialise the groups for the duration of a ``with`` block (handy in tests).

    Groups that were already initialised (with the same layout) are left in place.
    """
    already = context_parallel_groups_initialized()
    init_context_parallel_groups(dcp_world_size, dcp_rank, pcp_world_size, pcp_rank)
    try:
        yield
    finally:
        if not already:
            destroy_context_parallel_groups()
