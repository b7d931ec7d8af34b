"""Instruction-set names for the native CPU kernels: the single source of truth.

Two kinds of names live here:

* :class:`CpuIsa` -- the instruction set the native kernels run with (chosen at run time,
  best first: ``avx512bf16`` -> ``avx512`` -> ``avx2`` -> ``scalar`` on x86, ``neon`` on Arm).
* :class:`IsaHint` -- the kernel-variant hint strings of vLLM's CPU attention ops
  (``vec``, ``vec16``, ``neon``, ``amx``), each with the block-size multiple it requires.

The C++ enums and dispatch switch (``csrc/cpu/isa_generated.h``) are generated from these
lists by ``csrc/cpu/generate_isa_header.py``; this module must stay importable without torch
so the generator can load it by path.
"""

from __future__ import annotations

import enum

# Order is the C++ code (int64) of each name; never reorder, only append.
CPU_ISA_NAMES: tuple[str, ...] = ("scalar", "avx2", "avx512", "avx512bf16", "neon")
# Preprocessor macro guarding each ISA's translation unit (None: every architecture).
CPU_ISA_ARCH_MACRO: dict[str, "str | None"] = {
    "scalar": None, "avx2": "__x86_64__", "avx512": "__x86_64__", "avx512bf16": "__x86_64__",
    "neon": "__aarch64__",
}
# x86 preference, best first; Arm has only neon (and scalar).
X86_PREFERENCE: tuple[str, ...] = ("avx512bf16", "avx512", "avx2", "scalar")
ARM_PREFERENCE: tuple[str, ...] = ("neon", "scalar")

# hint name -> block-size multiple the variant needs.
ISA_HINTS: tuple[tuple[str, int], ...] = (("vec", 32), ("vec16", 16), ("neon", 16), ("amx", 16))

# Layout of the opaque scheduler-metadata tensor (int32): a fixed header, then
# METADATA_FIELDS_PER_REQ ints per request, then the work partition the planner computed
# (num_jobs jobs, num_merges merges, num_groups shared-prefix groups and their num_members
# member requests; their layout is private to attention_ops.cpp). Its
# length depends on the batch's query lengths, so the fake implementation gives it a
# dynamic size of at least metadata_numel(num_reqs).
METADATA_HEADER: tuple[str, ...] = (
    "magic", "version", "num_reqs", "num_heads", "num_kv_heads", "head_dim", "num_threads",
    "hint", "causal", "enable_kv_split", "q_tile_tokens", "num_jobs", "num_merges",
    "num_slots", "slot_rows", "max_rows", "batch_invariant", "num_groups", "num_members",
    "prefix_rows", "checksum",
)
# prefix_keys: the leading keys a request's own jobs skip, read by its shared-prefix group.
METADATA_FIELDS_PER_REQ: tuple[str, ...] = ("num_kv_splits", "prefix_keys")
METADATA_MAGIC = 0x50414D44  # "PAMD"
METADATA_VERSION = 4  # 3: batch_invariant; 4: shared-prefix groups
# The planner's rule for shared prefixes (requests whose block tables begin with the same
# blocks), measured (docs/performance.md, "Shared prefixes"): a group shares at least
# SHARED_PREFIX_MIN_KEYS keys, and pays where its members share SHARED_PREFIX_LONG_KEYS
# or more, or together read SHARED_PREFIX_MIN_SAVED_KEYS fewer keys ((members - 1) x
# shared keys). CPU_ATTN's use_cascade_attention applies the same rule.
SHARED_PREFIX_MIN_KEYS = 64
SHARED_PREFIX_LONG_KEYS = 512
SHARED_PREFIX_MIN_SAVED_KEYS = 2048


def _parse(enum_cls, value):
    if isinstance(value, enum_cls):
        return value
    if isinstance(value, str):
        try:
            return enum_cls(value.lower())
        except ValueError:
            pass
    valid = ", ".join(repr(m.value) for m in enum_cls)
    raise ValueError(f"unknown {enum_cls.__name__} {value!r}; expected one of {valid}")


class CpuIsa(str, enum.Enum):
    """Instruction set of the native kernels; ``.code`` is the int the C++ side receives."""

    SCALAR = "scalar"
    AVX2 = "avx2"
    AVX512 = "avx512"
    AVX512BF16 = "avx512bf16"
    NEON = "neon"

    @property
    def code(self) -> int:
        return CPU_ISA_NAMES.index(self.value)

    @classmethod
    def parse(cls, value: "str | CpuIsa") -> "CpuIsa":
        """Parse a name (case-insensitive); ValueError names the valid ones."""
        return _parse(cls, value)

    @classmethod
    def from_code(cls, code: int) -> "CpuIsa":
        return cls(CPU_ISA_NAMES[code])


_HINT_CODES = {name: i for i, (name, _) in enumerate(ISA_HINTS)}


class IsaHint(str, enum.Enum):
    """vLLM's kernel-variant hint strings; ``.block_multiple`` is the block size they need."""

    VEC = "vec"
    VEC16 = "vec16"
    NEON = "neon"
    AMX = "amx"

    @property
    def code(self) -> int:
        return _HINT_CODES[self.value]

    @property
    def block_multiple(self) -> int:
        return dict(ISA_HINTS)[self.value]

    @classmethod
    def parse(cls, value: "str | IsaHint") -> "IsaHint":
        """Parse a hint (case-insensitive); ValueError names the valid ones."""
        return _parse(cls, value)


if [m.value for m in CpuIsa] != list(CPU_ISA_NAMES) or [m.value for m in IsaHint] != [
    n for n, _ in ISA_HINTS
]:  # pragma: no cover - guards edits that forget one of the two lists
    raise ImportError("pagedattn.ops.isa: enum members out of sync with the name tables")
