"""A 4-bit CPU product with 8-bit activations: ``pocketllm/kernels/cpu/q4_linear.cpp``, built at first use.

Weights are GGUF's Q4_1 blocks (a code 0..15, an fp16 scale ``d`` and minimum ``m`` per 32 inputs of a row,
``w = d * q + m``); the activations are quantised per row and block of 32 inputs to 8 bits (llama.cpp's Q8
activations), and the dot products run in AVX-512 VNNI. Each weight block is unpacked once for all the rows of a
call (up to eight at a time), where torch's int4 kernel unpacks every weight for every row in bfloat16.

The kernel needs AVX-512 (F, BW, VL) with VNNI, and a C++ compiler the first time (torch's extension builder,
cached across processes, as inductor's code is). Where either is missing, ``available()`` is False and the int4
layers keep torch's int4 kernel.
"""

from __future__ import annotations

import logging
import os
import shutil
import sys
import threading
from pathlib import Path

import torch

logger = logging.getLogger("pocketllm.layers")

BLOCK = 32    # inputs per weight block and per activation scale
TILE = 16     # output channels per record (the 16 lanes of a vector of int32 sums)
RECORD = 320  # bytes per record: 16 channels x 32 codes, then 16 fp16 scales and 16 fp16 minimums
_FLAGS = ("avx512f", "avx512bw", "avx512vl", "avx512_vnni")
_SOURCE = Path(__file__).resolve().parent.parent / "kernels" / "cpu" / "q4_linear.cpp"

_lock = threading.Lock()
_state: dict[str, bool] = {}


def _cpu_has_flags() -> bool:
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as handle:
            flags = set(handle.read().split())
    except OSError:
        return False
    return all(flag in flags for flag in _FLAGS)


def _build() -> None:
    """Compile and load the kernel (torch's extension builder caches the library by the source's hash)."""
    from torch.utils import cpp_extension

    if shutil.which("ninja") is None:   # the ninja wheel's binary sits next to this interpreter
        os.environ["PATH"] = os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")
    cpp_extension.load(
        name="pocketllm_q4_linear", sources=[str(_SOURCE)], is_python_module=False, verbose=False,
        extra_cflags=["-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512vnni", "-mfma",
                      "-mf16c"])

    @torch.library.register_fake("pocketllm_cpu::q4_linear")
    def _(x: torch.Tensor, weights: torch.Tensor, out_features: int) -> torch.Tensor:
        return x.new_empty((x.shape[0], out_features))


def available() -> bool:
    """Whether the kernel runs here (built and loaded on the first call; False where it cannot be)."""
    with _lock:
        if "ok" not in _state:
            ok = False
            if os.environ.get("POCKETLLM_Q4_KERNEL", "1") != "0" and _cpu_has_flags():
                try:
                    _build()
                    ok = True
                except Exception as exc:  # no compiler, no ninja, a failed build: torch's int4 kernel instead
                    logger.warning("the 4-bit x 8-bit CPU kernel is unavailable (%s); int4 layers use torch's "
                                   "int4 kernel", exc)
            _state["ok"] = ok
        return _state["ok"]


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


class Q4Weights:
    """One linear layer's weights as the kernel's records: ``self(x)`` is ``x @ W.T`` in float32."""

    def __init__(self, weight: torch.Tensor) -> None:
        codes, scale, minimum = quantize_q4(weight)
        self.records = pack_q4(codes, scale, minimum)
        self.out_features = weight.shape[0]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.pocketllm_cpu.q4_linear(x.float(), self.records, self.out_features)


def unpack_q4(records: torch.Tensor) -> torch.Tensor:
    """The float32 weight ``[N, K]`` that ``records`` hold (``pack_q4`` inverted)."""
    tiles, blocks, _ = records.shape
    nibbles = records[..., :256].reshape(tiles, blocks, 4, TILE, 4)
    c = torch.stack([nibbles & 0x0F, nibbles >> 4], dim=-1)                      # [tile, block, chunk, lane, i, half]
    codes = c.permute(0, 3, 1, 2, 5, 4).reshape(tiles * TILE, blocks * BLOCK)
    def per_lane(part: torch.Tensor) -> torch.Tensor:
        return part.contiguous().view(torch.float16).permute(0, 2, 1).reshape(tiles * TILE, blocks)
    return dequantize_q4(codes, per_lane(records[..., 256:288]), per_lane(records[..., 288:]))
