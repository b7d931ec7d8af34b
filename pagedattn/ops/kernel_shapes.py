"""Head sizes and block sizes the native CPU kernels accept: the single source of truth.

The backend's ``get_supported_head_sizes`` / ``get_supported_kernel_block_sizes`` /
``validate_configuration``, ``CacheConfig`` and the wrappers' checks read these tuples, and
``csrc/cpu/kernel_shapes_generated.h`` (the C++ checks) is generated from them by
``csrc/cpu/generate_shapes_header.py`` (a test fails when the checked-in header is stale).
Torch-free so the generator can load it by path.

Head sizes: every multiple of 8 from 32 to 512. Multiples of 16 run the full-width
AVX-512 kernels; the others (40, 72, ...) run the 8-lane kernels on AVX-512 machines.

Block sizes: 1 and 8 (the small framework sizes), and every multiple of 16 up to 512. The
kernels score keys in groups of the vector width (16 on AVX-512); a block that is not a
multiple of it has its last group copied into a padded buffer first, so 1 and 8 are
correct but slower, and multiples of 16 take the full-speed path.
"""

from __future__ import annotations

HEAD_SIZE_MULTIPLE = 8
MIN_HEAD_SIZE = 32
MAX_HEAD_SIZE = 512
SUPPORTED_HEAD_SIZES: tuple[int, ...] = tuple(
    range(MIN_HEAD_SIZE, MAX_HEAD_SIZE + 1, HEAD_SIZE_MULTIPLE)
)
FULL_SPEED_HEAD_MULTIPLE = 16

SMALL_BLOCK_SIZES: tuple[int, ...] = (1, 8)
BLOCK_SIZE_MULTIPLE = 16
MAX_BLOCK_SIZE = 512
SUPPORTED_BLOCK_SIZES: tuple[int, ...] = SMALL_BLOCK_SIZES + tuple(
    range(BLOCK_SIZE_MULTIPLE, MAX_BLOCK_SIZE + 1, BLOCK_SIZE_MULTIPLE)
)

HEAD_SIZE_RULE = f"a multiple of {HEAD_SIZE_MULTIPLE} from {MIN_HEAD_SIZE} to {MAX_HEAD_SIZE}"
BLOCK_SIZE_RULE = (
    ", ".join(str(b) for b in SMALL_BLOCK_SIZES)
    + f" or a multiple of {BLOCK_SIZE_MULTIPLE} up to {MAX_BLOCK_SIZE}"
)


def is_supported_head_size(head_size: int) -> bool:
    return head_size in SUPPORTED_HEAD_SIZES


def is_supported_block_size(block_size: int) -> bool:
    return block_size in SUPPORTED_BLOCK_SIZES


def check_head_size(head_size: int) -> int:
    """``head_size`` if the kernels take it, else ValueError with the rule."""
    if isinstance(head_size, bool) or not isinstance(head_size, int) or not is_supported_head_size(head_size):
        raise ValueError(f"head_size {head_size!r} is not supported; expected {HEAD_SIZE_RULE}")
    return head_size


def check_block_size(block_size: int) -> int:
    """``block_size`` if the kernels take it, else ValueError with the rule."""
    if isinstance(block_size, bool) or not isinstance(block_size, int) or not is_supported_block_size(block_size):
        raise ValueError(f"block_size {block_size!r} is not supported; expected {BLOCK_SIZE_RULE}")
    return block_size
