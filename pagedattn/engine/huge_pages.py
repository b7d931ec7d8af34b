"""The engine's long-lived memory (weights, KV caches) on 2 MiB transparent huge pages.

A decode step streams every weight and every visible KV block once. On 4 KiB pages that
is a TLB miss every 4 KiB and a restart of the hardware prefetcher at every page
boundary; on 2 MiB pages neither. Linux backs anonymous memory with huge pages where the
process asks (``madvise(MADV_HUGEPAGE)``) and the kernel's mode allows it (``always`` or
``madvise`` in ``/sys/kernel/mm/transparent_hugepage/enabled``). torch asks only under
``THP_MEM_ALLOC_ENABLE=1``, and then for every large allocation, a prefill's temporaries
included, whose page faults cost more than the pages save (measured in
docs/performance.md, "Weights and KV cache on huge pages"). So the engine asks for its
own long-lived tensors only: they are copied once, at load, into advised arenas.

Where the kernel has no transparent huge pages, or refuses the advice, the arenas are
plain memory and nothing else changes.
"""

from __future__ import annotations

import ctypes
import sys
from pathlib import Path
from typing import Sequence

import torch
from torch import nn

HUGE_PAGE_BYTES = 2 << 20
_MADV_HUGEPAGE = 14  # asm-generic/mman-common.h
_ALIGN = 64  # every tensor of an arena starts on a cache line
_MIN_BYTES = 4096  # smaller tensors stay where they are (a page or less each)
_THP_MODE_FILE = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def kernel_mode() -> str:
    """The kernel's transparent-huge-page mode: ``always``, ``madvise``, ``never``, or
    ``unavailable`` (not Linux, or no THP support)."""
    try:
        text = _THP_MODE_FILE.read_text()
    except OSError:
        return "unavailable"
    start, end = text.find("["), text.find("]")
    return text[start + 1:end] if 0 <= start < end else "unavailable"


def _madvise():
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


_madvise_fn = _madvise()


def available() -> bool:
    """Whether advised memory can get huge pages here."""
    return _madvise_fn is not None and kernel_mode() in ("always", "madvise")


def allocate(nbytes: int, huge: bool = True) -> tuple[torch.Tensor, int, bool]:
    """An uninitialised uint8 buffer of at least ``nbytes``: ``(buffer, offset of its usable
    part, advised)``. ``advised`` (``huge`` and :func:`available`, and ``madvise`` took
    it): the usable part starts on a 2 MiB boundary and is advised for huge pages; else it
    is plain memory at offset 0."""
    if not isinstance(nbytes, int) or nbytes < 0:
        raise ValueError(f"nbytes must be an int >= 0, got {nbytes!r}")
    if not huge or not available() or nbytes == 0:
        return torch.empty(nbytes, dtype=torch.uint8), 0, False
    span = -(-nbytes // HUGE_PAGE_BYTES) * HUGE_PAGE_BYTES
    # The buffer is not touched before the advice, so its first faults take huge pages.
    raw = torch.empty(span + HUGE_PAGE_BYTES, dtype=torch.uint8)
    offset = -raw.data_ptr() % HUGE_PAGE_BYTES
    advised = _madvise_fn(raw.data_ptr() + offset, span, _MADV_HUGEPAGE) == 0
    return raw, offset, advised


def _aligned(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


def _nbytes(shape: Sequence[int], dtype: torch.dtype) -> int:
    return torch.Size(shape).numel() * dtype.itemsize


def _slices(raw: torch.Tensor, offset: int,
            specs: Sequence[tuple[torch.Size, torch.dtype]]) -> list[torch.Tensor]:
    out = []
    for shape, dtype in specs:
        n = _nbytes(shape, dtype)
        out.append(raw[offset:offset + n].view(dtype).view(shape))
        offset += _aligned(n)
    return out


def zeros(shape: Sequence[int], dtype: torch.dtype, count: int,
          huge: bool = True) -> tuple[list[torch.Tensor], bool]:
    """``count`` zeroed tensors of ``shape`` and ``dtype`` in one arena (the KV caches of
    every layer), and whether it is advised."""
    raw, offset, advised = allocate(count * _aligned(_nbytes(shape, dtype)), huge)
    tensors = _slices(raw, offset, [(torch.Size(shape), dtype)] * count)
    for t in tensors:
        t.zero_()
    return tensors, advised


def _movable(t: torch.Tensor | None) -> bool:
    """Dense CPU tensors that own their whole storage: views and opaque tensors stay."""
    return (isinstance(t, torch.Tensor) and t.device.type == "cpu" and t.layout == torch.strided
            and not t.is_mkldnn and t.is_contiguous() and t.storage_offset() == 0
            and t.nbytes >= _MIN_BYTES and t.untyped_storage().nbytes() == t.nbytes)


def move_module(module: nn.Module, huge: bool = True) -> tuple[int, bool]:
    """Copy ``module``'s parameters and buffers (those :func:`_movable` takes) into one
    arena, in place: parameters keep their objects (tied weights stay tied), buffers are
    replaced. Returns ``(bytes moved, advised)``."""
    seen: dict[int, torch.Tensor] = {}
    slots: list[tuple[dict, str, torch.Tensor]] = []
    for m in module.modules():
        for store in (m._parameters, m._buffers):
            for name, t in store.items():
                if _movable(t):
                    seen.setdefault(id(t), t)
                    slots.append((store, name, t))
    if not seen:
        return 0, False
    old = list(seen.values())
    raw, offset, advised = allocate(sum(_aligned(t.nbytes) for t in old), huge)
    new = _slices(raw, offset, [(t.shape, t.dtype) for t in old])
    with torch.no_grad():
        for src, dst in zip(old, new):
            dst.copy_(src)
    moved = dict(zip(seen, new))  # id -> its copy
    for store, name, t in slots:
        if isinstance(t, nn.Parameter):
            t.data = moved[id(t)]
        else:
            store[name] = moved[id(t)]
    return sum(t.nbytes for t in old), advised


def describe(requested: bool, weights: bool, kv_cache: bool | None) -> str:
    """What the engine's weights and KV cache (``None``: none, an encoder) sit on, and why:
    ``requested`` is :attr:`EngineArgs.huge_pages`, the others what the kernel took."""
    parts = [("weights", weights)] + ([] if kv_cache is None else [("KV cache", kv_cache)])
    huge = [name for name, advised in parts if advised]
    small = [name for name, advised in parts if not advised]
    why = "huge_pages=False" if not requested else f"THP {kernel_mode()}"
    text = [f"{' and '.join(huge)} on 2 MiB pages"] if huge else []
    text += [f"{' and '.join(small)} on 4 KiB pages"] if small else []
    return f"{'; '.join(text)} ({why})"
