"""GGUF tensor data to float32: vectorised for the types small models ship in (F32, F16, BF16, Q8_0, Q4_0, Q4_1),
the ``gguf`` package's reference code for the k-quants and the rest.

Block layouts (llama.cpp's): Q8_0 is a float16 scale ``d`` and 32 int8 values (``d * q``); Q4_0 is ``d`` and 16
bytes of 4-bit values (``d * (q - 8)``); Q4_1 is ``d``, a float16 minimum ``m`` and 16 bytes (``d * q + m``). In the
4-bit types byte ``j`` holds element ``j`` in its low nibble and element ``j + 16`` in its high one.
"""

from __future__ import annotations

import numpy as np

from pocketllm.errors import CheckpointError
from pocketllm.loaders.gguf_file import GGUFTensor

SUPPORTED_TYPES = frozenset({"F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K"})


def check_type(tensor: GGUFTensor) -> None:
    """Raise CheckpointError for a tensor type we do not dequantise."""
    if tensor.type.name not in SUPPORTED_TYPES:
        raise CheckpointError(f"GGUF tensor {tensor.name!r} has type {tensor.type.name}, which PocketLLM cannot "
                              f"dequantise (supported: {', '.join(sorted(SUPPORTED_TYPES))})")


def _halves(blocks: np.ndarray, start: int) -> np.ndarray:
    """The float16 at byte ``start`` of every block, as a float32 column."""
    return blocks[:, start:start + 2].view(np.float16).astype(np.float32)


def _nibbles(packed: np.ndarray) -> np.ndarray:
    """[blocks, 16] bytes -> [blocks, 32] 4-bit values in element order."""
    values = np.empty((packed.shape[0], 32), dtype=np.uint8)
    np.bitwise_and(packed, 0x0F, out=values[:, :16])
    np.right_shift(packed, 4, out=values[:, 16:])
    return values


def _decode_blocks(tensor: GGUFTensor) -> np.ndarray:
    """Q8_0, Q4_0 and Q4_1 (one pass of numpy each: no thread pool to contend for)."""
    blocks = tensor.data.reshape(-1, tensor.type.block_bytes)
    scale = _halves(blocks, 0)
    kind = tensor.type.name
    if kind == "Q8_0":
        return np.multiply(blocks[:, 2:].view(np.int8), scale, dtype=np.float32)
    if kind == "Q4_0":
        values = np.subtract(_nibbles(blocks[:, 2:]), 8, dtype=np.float32)
        return np.multiply(values, scale, out=values)
    values = np.multiply(_nibbles(blocks[:, 4:]), scale, dtype=np.float32)
    return np.add(values, _halves(blocks, 2), out=values)


def _decode(tensor: GGUFTensor) -> np.ndarray:
    data, kind = tensor.data, tensor.type.name
    if kind == "F32":
        return data.view(np.float32)
    if kind == "F16":
        return data.view(np.float16).astype(np.float32)
    if kind == "BF16":
        return (data.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    if kind in ("Q8_0", "Q4_0", "Q4_1"):
        return _decode_blocks(tensor)
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    return dequantize(data, GGMLQuantizationType(tensor.type.id))


def dequantize(tensor: GGUFTensor) -> np.ndarray:
    """A tensor as a writable, contiguous float32 array in HF layout."""
    check_type(tensor)
    array = _decode(tensor).reshape(tensor.shape)
    if array.dtype != np.float32 or not array.flags.writeable or not array.flags.c_contiguous:
        array = np.array(array, dtype=np.float32)
    return array
