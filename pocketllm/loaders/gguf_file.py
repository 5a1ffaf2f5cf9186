"""A GGUF file read straight from a memory map: its metadata as Python values, its tensors as numpy views.

The layout (GGUF versions 2 and 3, little-endian): the magic ``GGUF``, a uint32 version, uint64 tensor and
metadata counts; each metadata entry is a string key, a uint32 value type and the value (arrays carry an element
type and a uint64 count); each tensor description is a string name, a uint32 dimension count, uint64 dimensions
(fastest first), a uint32 GGML type and a uint64 offset into the data section, which starts at the next multiple
of ``general.alignment`` (32 when absent) after the descriptions. Strings are a uint64 byte length and UTF-8.

The metadata of a small model is mostly its tokenizer (tens of thousands of strings): one pass of
``struct.unpack_from`` over the map reads it in a fraction of the time a general-purpose reader takes.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np

from pocketllm.errors import CheckpointError

_MAGIC = b"GGUF"
_DEFAULT_ALIGNMENT = 32

# GGUF metadata value types: id -> (struct format, numpy dtype) for the fixed-size ones.
_SCALARS: dict[int, tuple[str, str]] = {
    0: ("<B", "<u1"), 1: ("<b", "<i1"), 2: ("<H", "<u2"), 3: ("<h", "<i2"), 4: ("<I", "<u4"), 5: ("<i", "<i4"),
    6: ("<f", "<f4"), 7: ("<?", "<u1"), 10: ("<Q", "<u8"), 11: ("<q", "<i8"), 12: ("<d", "<f8"),
}
_BOOL, _STRING, _ARRAY = 7, 8, 9


@dataclass(frozen=True)
class GGMLType:
    """A tensor data type: its name as llama.cpp spells it, and how many elements a block of how many bytes holds."""

    id: int
    name: str
    block_elements: int
    block_bytes: int


GGML_TYPES: dict[int, GGMLType] = {t.id: t for t in (
    GGMLType(0, "F32", 1, 4), GGMLType(1, "F16", 1, 2), GGMLType(2, "Q4_0", 32, 18), GGMLType(3, "Q4_1", 32, 20),
    GGMLType(6, "Q5_0", 32, 22), GGMLType(7, "Q5_1", 32, 24), GGMLType(8, "Q8_0", 32, 34),
    GGMLType(9, "Q8_1", 32, 36), GGMLType(10, "Q2_K", 256, 84), GGMLType(11, "Q3_K", 256, 110),
    GGMLType(12, "Q4_K", 256, 144), GGMLType(13, "Q5_K", 256, 176), GGMLType(14, "Q6_K", 256, 210),
    GGMLType(15, "Q8_K", 256, 292), GGMLType(24, "I8", 1, 1), GGMLType(25, "I16", 1, 2),
    GGMLType(26, "I32", 1, 4), GGMLType(27, "I64", 1, 8), GGMLType(28, "F64", 1, 8), GGMLType(30, "BF16", 1, 2),
)}
# Types PocketLLM does not read, named for error messages (their data is not mapped).
_UNREAD_TYPES = {16: "IQ2_XXS", 17: "IQ2_XS", 18: "IQ3_XXS", 19: "IQ1_S", 20: "IQ4_NL", 21: "IQ3_S", 22: "IQ2_S",
                 23: "IQ4_XS", 29: "IQ1_M", 34: "TQ1_0", 35: "TQ2_0", 39: "MXFP4"}


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor: ``shape`` in numpy/HF order (GGUF's dimensions reversed); ``data`` its raw bytes, one row of
    the fastest dimension per row of the array (``[rows, row_bytes]`` uint8, a view of the map)."""

    name: str
    shape: tuple[int, ...]
    type: GGMLType
    data: np.ndarray

    @property
    def n_elements(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))


class GGUFFile:
    """``metadata`` (key -> str, int, float, bool or list) and ``tensors`` (in file order) of a GGUF file."""

    def __init__(self, path: str) -> None:
        self.path = path
        try:
            with open(path, "rb") as handle:
                self._map = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
        except (OSError, ValueError) as exc:
            raise CheckpointError(f"cannot read GGUF file {path!r}: {exc}") from exc
        self._pos = 0
        try:
            self.metadata, self.tensors = self._parse()
        except (struct.error, UnicodeDecodeError, ValueError, OverflowError) as exc:
            raise CheckpointError(f"{path!r} is not a readable GGUF file: {exc}") from exc

    # -- primitive reads -------------------------------------------------------------------------------------

    def _unpack(self, fmt: str) -> Any:
        value = struct.unpack_from(fmt, self._map, self._pos)[0]
        self._pos += struct.calcsize(fmt)
        return value

    def _string(self) -> str:
        length = struct.unpack_from("<Q", self._map, self._pos)[0]
        start = self._pos + 8
        self._pos = start + length
        if self._pos > len(self._map):
            raise ValueError("a string runs past the end of the file")
        return self._map[start:self._pos].decode("utf-8")

    def _value(self, kind: int) -> Any:
        if kind == _STRING:
            return self._string()
        if kind == _ARRAY:
            item_kind, count = self._unpack("<I"), self._unpack("<Q")
            if item_kind in _SCALARS:
                dtype = np.dtype(_SCALARS[item_kind][1])
                end = self._pos + count * dtype.itemsize
                if end > len(self._map):
                    raise ValueError("an array runs past the end of the file")
                items = np.frombuffer(self._map, dtype=dtype, count=count, offset=self._pos)
                self._pos = end
                return [bool(v) for v in items] if item_kind == _BOOL else items.tolist()
            return [self._value(item_kind) for _ in range(count)]
        if kind not in _SCALARS:
            raise ValueError(f"unknown metadata value type {kind}")
        value = self._unpack(_SCALARS[kind][0])
        return bool(value) if kind == _BOOL else value

    # -- the file --------------------------------------------------------------------------------------------

    def _parse(self) -> tuple[dict[str, Any], list[GGUFTensor]]:
        if self._map[:4] != _MAGIC:
            raise ValueError("no GGUF magic at the start")
        self._pos = 4
        version = self._unpack("<I")
        if version not in (2, 3):
            raise ValueError(f"GGUF version {version} (readable: 2, 3)")
        tensor_count, kv_count = self._unpack("<Q"), self._unpack("<Q")
        metadata: dict[str, Any] = {}
        for _ in range(kv_count):
            key = self._string()
            metadata[key] = self._value(self._unpack("<I"))
        described = []
        for _ in range(tensor_count):
            name = self._string()
            dims = [self._unpack("<Q") for _ in range(self._unpack("<I"))]
            described.append((name, dims, self._unpack("<I"), self._unpack("<Q")))
        alignment = int(metadata.get("general.alignment", _DEFAULT_ALIGNMENT))
        if alignment <= 0:
            raise ValueError(f"general.alignment is {alignment}")
        data_start = -(-self._pos // alignment) * alignment
        return metadata, [self._tensor(name, dims, kind, data_start + offset)
                          for name, dims, kind, offset in described]

    def _tensor(self, name: str, dims: list[int], kind: int, start: int) -> GGUFTensor:
        ggml_type = GGML_TYPES.get(kind) or GGMLType(kind, _UNREAD_TYPES.get(kind, f"type {kind}"), 1, 0)
        row = dims[0] if dims else 1
        rows = int(np.prod(dims[1:], dtype=np.int64)) if len(dims) > 1 else 1
        if ggml_type.block_bytes and row % ggml_type.block_elements:
            raise ValueError(f"tensor {name!r}: a row of {row} is not whole {ggml_type.name} blocks")
        row_bytes = row // ggml_type.block_elements * ggml_type.block_bytes
        if start + rows * row_bytes > len(self._map):
            raise ValueError(f"tensor {name!r} runs past the end of the file")
        data = np.frombuffer(self._map, dtype=np.uint8, count=rows * row_bytes, offset=start).reshape(rows, row_bytes)
        return GGUFTensor(name, tuple(int(d) for d in reversed(dims)), ggml_type, data)
