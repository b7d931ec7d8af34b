"""A lean GGUF reader: the metadata and each tensor's bytes, memory-mapped.

``gguf.GGUFReader`` builds a numpy view for every element of every metadata array; a
262,144-token vocabulary (Gemma 3) takes it ~9 s on this machine. This reader decodes the
scalars and numeric arrays it is asked for, steps over string arrays (keeping only their
length and where they start) and leaves the tensors as byte views, which
``gguf.quants.dequantize`` turns into fp32 (the quantisation formats stay the ``gguf``
library's). Layout (GGUF v2/v3, little-endian): magic ``GGUF``, version (u32), tensor
count and metadata count (u64); the metadata (key string, value type u32, value); the
tensor infos (name, dims, type, offset); the data, aligned to ``general.alignment``
(default 32).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any

import numpy as np

# GGUF metadata value types: numeric ones as struct formats; 8 = string, 9 = array.
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
            10: "<Q", 11: "<q", 12: "<d"}
_NUMPY = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?",
          10: "<u8", 11: "<i8", 12: "<f8"}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class StringArray:
    """A metadata array of strings, not decoded: its length and where it starts."""

    length: int
    offset: int

    def __len__(self) -> int:
        return self.length


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    shape: tuple[int, ...]
    """GGUF order: the fastest-varying dimension first (reversed from torch's)."""
    tensor_type: Any  # gguf.GGMLQuantizationType
    data: np.ndarray
    """The raw bytes, ``uint8`` shaped ``[*reversed(shape[1:]), bytes per row]``."""

    def dequantize(self) -> np.ndarray:
        """fp32, torch-ordered shape (``reversed(shape)``)."""
        import gguf

        out = gguf.quants.dequantize(self.data, self.tensor_type)
        return np.asarray(out, dtype=np.float32).reshape(tuple(reversed(self.shape)))


class GGUFFile:
    """``fields``: metadata key -> value (a number, a string, a numpy array of numbers, a
    :class:`StringArray`, or a list for arrays of arrays); ``tensors``: in file order."""

    def __init__(self, path: str) -> None:
        import gguf

        self.path = path
        self._buf = np.memmap(path, dtype=np.uint8, mode="r")
        self._pos = 0
        if bytes(self._buf[:4]) != b"GGUF":
            raise ValueError(f"{path} is not a GGUF file (no GGUF magic)")
        self._pos = 4
        version = self._scalar(4)
        if version not in (2, 3):
            raise ValueError(f"{path}: GGUF version {version} is not supported (2 or 3)")
        n_tensors, n_fields = self._scalar(10), self._scalar(10)
        self.fields: dict[str, Any] = {}
        for _ in range(n_fields):
            key = self._string()
            self.fields[key] = self._value(self._scalar(4))
        infos = []
        for _ in range(n_tensors):
            name = self._string()
            dims = tuple(self._scalar(10) for _ in range(self._scalar(4)))
            infos.append((name, dims, self._scalar(4), self._scalar(10)))
        align = int(self.fields.get("general.alignment", 32))
        start = -(-self._pos // align) * align
        self.tensors: list[GGUFTensor] = []
        for name, dims, raw_type, offset in infos:
            qtype = gguf.GGMLQuantizationType(raw_type)
            block, type_size = gguf.GGML_QUANT_SIZES[qtype]
            if dims[0] % block:
                raise ValueError(f"{path}: tensor {name} has rows of {dims[0]} values, not a "
                                 f"multiple of its {qtype.name} block ({block})")
            row_bytes = dims[0] // block * type_size
            rows = int(np.prod(dims[1:], dtype=np.int64))
            lo = start + offset
            data = self._buf[lo: lo + rows * row_bytes]
            if data.size != rows * row_bytes:
                raise ValueError(f"{path} is truncated: tensor {name} runs past its end")
            self.tensors.append(GGUFTensor(name, dims, qtype,
                                           data.reshape(*reversed(dims[1:]), row_bytes)))

    def get(self, key: str, default: Any = None) -> Any:
        return self.fields.get(key, default)

    # ------------------------------------------------------------------ parsing

    def _scalar(self, kind: int) -> Any:
        fmt = _SCALARS[kind]
        size = struct.calcsize(fmt)
        (value,) = struct.unpack_from(fmt, self._buf, self._pos)
        self._pos += size
        return value

    def _string(self) -> str:
        n = self._scalar(10)
        text = bytes(self._buf[self._pos: self._pos + n]).decode("utf-8")
        self._pos += n
        return text

    def _value(self, kind: int) -> Any:
        if kind in _SCALARS:
            return self._scalar(kind)
        if kind == _STRING:
            return self._string()
        if kind != _ARRAY:
            raise ValueError(f"{self.path}: unknown GGUF metadata type {kind}")
        item, n = self._scalar(4), self._scalar(10)
        if item in _NUMPY:
            dtype = np.dtype(_NUMPY[item])
            values = np.frombuffer(self._buf, dtype=dtype, count=n, offset=self._pos)
            self._pos += n * dtype.itemsize
            return values
        if item == _STRING:
            start = self._pos
            for _ in range(n):  # step over: u64 length, then the bytes
                (length,) = struct.unpack_from("<Q", self._buf, self._pos)
                self._pos += 8 + length
            return StringArray(n, start)
        return [self._value(item) for _ in range(n)]
