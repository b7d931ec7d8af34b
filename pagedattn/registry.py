"""Backend registry and selection.

Backends register under a name with the dotted path of their class, imported lazily so
that a backend whose dependencies are missing (no CUDA, no xformers) never breaks the
others. Selection, in order:

1. an explicit ``backend=`` name,
2. the ``PAGEDATTN_BACKEND`` environment variable,
3. the first registered backend, in priority order, whose ``validate_configuration``
   (plus the registry's device and import checks) returns no reasons.

When nothing fits, one :class:`NoUsableBackendError` lists every backend with its reasons.
"""

from __future__ import annotations

import importlib
import os
from dataclasses import dataclass, field
from typing import get_args

import torch

from pagedattn.backend import AttentionBackend, AttentionType
from pagedattn.config import (
    BlockSize,
    CacheDType,
    DeviceCapability,
    current_device_capability,
)

BACKEND_ENV_VAR = "PAGEDATTN_BACKEND"


class NoUsableBackendError(ValueError):
    """No registered backend accepts the requested configuration."""


@dataclass(frozen=True)
class BackendEntry:
    """A registered backend: ``class_path`` is ``"package.module:ClassName"``;
    ``device_types`` are the torch device types its kernels run on."""

    name: str
    class_path: str
    device_types: tuple[str, ...]

    def load(self) -> type[AttentionBackend]:
        module_name, _, qualname = self.class_path.partition(":")
        obj: object = importlib.import_module(module_name)
        for part in qualname.split("."):
            obj = getattr(obj, part)
        if not (isinstance(obj, type) and issubclass(obj, AttentionBackend)):
            raise TypeError(f"{self.class_path} is not an AttentionBackend subclass")
        return obj


@dataclass(frozen=True)
class AttentionSelectorConfig:
    """What selection needs to know about one attention layer."""

    head_size: int
    dtype: torch.dtype
    kv_cache_dtype: CacheDType | str | None = "auto"
    block_size: int | None = 16
    use_mla: bool = False
    has_sink: bool = False
    use_sparse: bool = False
    use_mm_prefix: bool = False
    attn_type: str = AttentionType.DECODER
    device: str = "cpu"
    device_capability: DeviceCapability = field(default=DeviceCapability(0, 0))

    def __post_init__(self) -> None:
        object.__setattr__(self, "attn_type", AttentionType.parse(self.attn_type))
        if self.kv_cache_dtype is not None:
            object.__setattr__(self, "kv_cache_dtype", CacheDType.parse(self.kv_cache_dtype))
        device_type = torch.device(self.device).type
        object.__setattr__(self, "device", device_type)


_REGISTRY: dict[str, BackendEntry] = {}


def register_backend(name: str, class_path: str, device_types: tuple[str, ...]) -> None:
    """Register (or replace) backend ``name``; later registrations have lower priority."""
    if not name or not name.isidentifier() or name.upper() != name:
        raise ValueError(f"backend name must be an UPPER_CASE identifier, got {name!r}")
    if ":" not in class_path:
        raise ValueError(f"class_path must look like 'module:Class', got {class_path!r}")
    if not device_types:
        raise ValueError(f"backend {name} must name at least one device type")
    _REGISTRY[name] = BackendEntry(name, class_path, tuple(device_types))


def unregister_backend(name: str) -> None:
    _entry(name)
    del _REGISTRY[name]


def registered_backends() -> list[str]:
    """Backend names in priority order."""
    return list(_REGISTRY)


def _entry(name: str) -> BackendEntry:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(
            f"unknown attention backend {name!r}; registered: {', '.join(_REGISTRY)}"
        ) from None


def get_backend_cls(name: str) -> type[AttentionBackend]:
    """The class of backend ``name`` (imports it)."""
    return _entry(name).load()


def unsupported_reasons(name: str, config: AttentionSelectorConfig) -> list[str]:
    """Why backend ``name`` cannot run ``config`` (empty list = it can)."""
    entry = _entry(name)
    reasons = []
    if config.device not in entry.device_types:
        reasons.append(f"device type {config.device} not supported (needs "
                       f"{', '.join(entry.device_types)})")
    try:
        cls = entry.load()
    except ImportError as exc:  # an optional dependency missing is a reason, not a crash
        return reasons + [f"not importable: {type(exc).__name__}: {exc}"]
    # The backend's own reasons too (e.g. a missing library), so `pagedattn info` says
    # everything that stands in the way, not only the device.
    own = cls.validate_configuration(
        head_size=config.head_size,
        dtype=config.dtype,
        kv_cache_dtype=config.kv_cache_dtype,
        block_size=config.block_size,
        use_mla=config.use_mla,
        has_sink=config.has_sink,
        use_sparse=config.use_sparse,
        use_mm_prefix=config.use_mm_prefix,
        device_capability=config.device_capability,
        attn_type=config.attn_type,
    )
    return reasons + [_with_values(cls, reason, config) for reason in own]


def _with_values(cls: type[AttentionBackend], reason: str, config: AttentionSelectorConfig
                 ) -> str:
    """The seed's reason string (kept as the first words) plus the rejected value and what
    the backend supports, for the reasons that have both."""
    def listing(values) -> str:
        return ", ".join(str(v) for v in values) or "any"

    if reason == "head_size not supported":
        return f"{reason}: {config.head_size} (supported: {listing(cls.get_supported_head_sizes())})"
    if reason == "dtype not supported":
        return f"{reason}: {config.dtype} (supported: {listing(cls.supported_dtypes)})"
    if reason == "kv_cache_dtype not supported":
        return (f"{reason}: {config.kv_cache_dtype} "
                f"(supported: {listing(cls.supported_kv_cache_dtypes)})")
    if reason == "block_size not supported":
        usable = [b for b in get_args(BlockSize) if cls.supports_block_size(b)]
        return f"{reason}: {config.block_size} (supported: {listing(usable)})"
    return reason


def _describe(reasons: dict[str, list[str]]) -> str:
    return "; ".join(f"{name}: {', '.join(r)}" for name, r in reasons.items())


def select_backend(
    config: AttentionSelectorConfig, backend: str | None = None
) -> type[AttentionBackend]:
    """The backend class to use for ``config`` (see the module docstring for the order)."""
    requested = backend or os.environ.get(BACKEND_ENV_VAR) or None
    if requested is not None:
        reasons = unsupported_reasons(requested, config)
        if reasons:
            source = "backend=" if backend else f"{BACKEND_ENV_VAR}="
            raise NoUsableBackendError(
                f"{source}{requested} cannot run this configuration: {', '.join(reasons)}"
            )
        return get_backend_cls(requested)
    rejected: dict[str, list[str]] = {}
    for name in _REGISTRY:
        reasons = unsupported_reasons(name, config)
        if not reasons:
            return get_backend_cls(name)
        rejected[name] = reasons
    raise NoUsableBackendError(
        f"no attention backend supports head_size={config.head_size}, dtype={config.dtype}, "
        f"kv_cache_dtype={config.kv_cache_dtype}, block_size={config.block_size}, "
        f"attn_type={config.attn_type}, device={config.device}. Rejected: {_describe(rejected)}"
    )


def default_selector_config(head_size: int, dtype: torch.dtype, **kwargs) -> AttentionSelectorConfig:
    """A selector config for the current machine (CUDA if available, else CPU)."""
    device = kwargs.pop("device", "cuda" if torch.cuda.is_available() else "cpu")
    return AttentionSelectorConfig(
        head_size=head_size, dtype=dtype, device=device,
        device_capability=current_device_capability(device), **kwargs,
    )


# Priority order: the native CPU backend first on CPU; GPU backends follow.
register_backend("CPU_ATTN", "pagedattn.backends.cpu_attn:CPUAttentionBackend", ("cpu",))
register_backend("XFORMERS_VLLM_V1", "pagedattn.backends.xformers:XFormersAttentionBackend",
                 ("cuda",))
# CPU tensors too, but only under Triton's interpreter (its validate_configuration says so).
register_backend("TRITON_ATTN", "pagedattn.backends.triton_attn:TritonAttentionBackend",
                 ("cuda", "cpu"))
