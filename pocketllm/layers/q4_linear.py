"""The weights of a 4-bit CPU product with 8-bit activations (``pocketllm/kernels/cpu/q4_linear.cpp``).

Weights are GGUF's Q4_1 blocks (a code 0..15, an fp16 scale ``d`` and minimum ``m`` per 32 inputs of a row,
``w = d * q + m``); the activations are quantised per row and block of 32 inputs to 8 bits (llama.cpp's Q8
activations), and the dot products run in AVX-512 VNNI. Each weight block is unpacked once for all the rows of a
call (up to eight at a time), where torch's int4 kernel unpacks every weight for every row in bfloat16.

Where the kernel is unavailable (``pocketllm.kernels.cpu_native``: no AVX-512 VNNI, no compiler), the int4 layers
keep torch's int4 kernel.
"""

from __future__ import annotations

import torch

BLOCK = 32    # inputs per weight block and per activation scale
TILE = 16     # output channels per record (the 16 lanes of a vector of int32 sums)
RECORD = 320  # bytes per record: 16 channels x 32 codes, then 16 fp16 scales and 16 fp16 minimums


def quantize_q4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Codes ``[N, K]`` (uint8, 0..15), scales ``d`` and minimums ``m`` ``[N, K / 32]`` (fp16) of ``weight``.

    A GGUF Q4_1 block's smallest weight is its ``m`` and its largest ``m + 15 d`` (the quantiser maps them to
    codes 0 and 15), so quantising the dequantised block gives back its codes, ``d`` and ``m`` exactly."""
    rows, cols = weight.shape
    groups = weight.float().reshape(rows, cols // BLOCK, BLOCK)
    low, high = groups.amin(-1), groups.amax(-1)
    scale = ((high - low) / 15).half()
    minimum = low.half()
    step = torch.where(scale > 0, scale.float(), torch.ones_like(low))
    codes = torch.round((groups - minimum.float()[..., None]) / step[..., None]).clamp_(0, 15)
    return codes.reshape(rows, cols).to(torch.uint8), scale, minimum


def dequantize_q4(codes: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor) -> torch.Tensor:
    """The float32 weight ``[N, K]`` the records hold."""
    rows, cols = codes.shape
    groups = codes.float().reshape(rows, cols // BLOCK, BLOCK)
    return (groups * scale.float()[..., None] + minimum.float()[..., None]).reshape(rows, cols)


def pack_q4(codes: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor) -> torch.Tensor:
    """The kernel's records ``[N / 16, K / 32, 320]`` (uint8) from ``quantize_q4``'s output (layout: the C++
    source's header)."""
    rows, cols = codes.shape
    tiles, blocks = rows // TILE, cols // BLOCK
    # input k = 32 * block + 8 * chunk + 4 * half + i; a byte holds half 0 in its low nibble, half 1 in its high.
    c = codes.reshape(tiles, TILE, blocks, 4, 2, 4).permute(0, 2, 3, 1, 5, 4)   # [tile, block, chunk, lane, i, half]
    nibbles = (c[..., 0] | (c[..., 1] << 4)).reshape(tiles, blocks, 256)
    def per_lane(values: torch.Tensor) -> torch.Tensor:
        return values.reshape(tiles, TILE, blocks).permute(0, 2, 1).contiguous().view(torch.uint8)
    return torch.cat([nibbles, per_lane(scale), per_lane(minimum)], dim=-1).contiguous()


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """What the kernel multiplies by: ``x`` [M, K] as int8 codes (float32) per block of 32, and their scales
    ``[M, K / 32, 1]`` (the reference for tests)."""
    rows, cols = x.shape
    blocks = x.float().reshape(rows, cols // BLOCK, BLOCK)
    amax = blocks.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, 127 / amax, torch.zeros_like(amax))
    return torch.round(blocks * inv).clamp_(-127, 127), amax / 127


def reference(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor) -> torch.Tensor:
    """The kernel's result computed with torch ops in float64 (tests): quantised activations times the weights."""
    q, d = quantize_activations(x)
    xq = (q * d).reshape(x.shape).double()
    return (xq @ dequantize_q4(codes, scale, minimum).double().T).float()


def matmul(x: torch.Tensor, records: torch.Tensor) -> torch.Tensor:
    """``x`` [M, K] (any float dtype) @ W.T for the weights ``records`` hold: [M, N] float32."""
    return torch.ops.pocketllm_cpu.q4_linear(x.float(), records)


class Q4Weights:
    """One weight matrix as the kernel's records: ``self(x)`` is ``x @ W.T`` in float32."""

    def __init__(self, weight: torch.Tensor) -> None:
        self.records = pack_q4(*quantize_q4(weight))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return matmul(x, self.records)


def unpack_q4(records: torch.Tensor) -> torch.Tensor:
    """The float32 weight ``[N, K]`` that ``records`` hold (``pack_q4`` inverted)."""
    tiles, blocks, _ = records.shape
    nibbles = records[..., :256].reshape(tiles, blocks, 4, TILE, 4)
    c = torch.stack([nibbles & 0x0F, nibbles >> 4], dim=-1)                      # [tile, block, chunk, lane, i, half]
    codes = c.permute(0, 3, 1, 2, 5, 4).reshape(tiles * TILE, blocks * BLOCK)
    def per_lane(part: torch.Tensor) -> torch.Tensor:
        return part.contiguous().view(torch.float16).permute(0, 2, 1).reshape(tiles * TILE, blocks)
    return dequantize_q4(codes, per_lane(records[..., 256:288]), per_lane(records[..., 288:]))
