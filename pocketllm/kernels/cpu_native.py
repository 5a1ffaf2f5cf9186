"""PocketLLM's own CPU kernels (``pocketllm/kernels/cpu/*.cpp``), compiled once and loaded at first use.

``q4_linear``: a 4-bit x 8-bit product (``pocketllm/layers/q4_linear.py``); ``decode_attention``: a few query rows
over their cached K/V; ``decode_layers``: every layer of a Llama-family decode step with q4 weights in one call
(``pocketllm/runner/cpu_decode.py``); ``rescore_top``: the LM head's exact rescoring of its top logits
(``RescoredLMHead``). They need AVX-512 (F, BW, VL) with VNNI, and a C++ compiler the first time.
Where either is missing, ``available()`` is False and callers keep torch's kernels.

The library is built (torch's extension builder, about a minute on two cores) into a directory of the user's
cache named by the hash of everything it is built from (sources, flags, torch and Python versions):
``$POCKETLLM_CACHE_DIR``, else ``$XDG_CACHE_HOME/pocketllm``, else ``~/.cache/pocketllm``, then
``cpu_kernels/<hash>``. A process finds a finished build there and loads it directly (a few milliseconds); two
checkouts with different sources keep two builds instead of rebuilding over each other. ``make install`` builds it
ahead of the first request:

    python -m pocketllm.kernels.cpu_native --build
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import logging
import os
import platform
import shutil
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import torch

from pocketllm.cache_dir import cache_root

logger = logging.getLogger("pocketllm.kernels")

_FLAGS = ("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni")
_DIR = Path(__file__).resolve().parent / "cpu"
_SOURCES = [_DIR / name for name in ("q4_linear.cpp", "decode_attention.cpp", "decode_step.cpp",
                                     "lm_head_rescore.cpp")]
_HEADER = _DIR / "cpu_kernels.h"
_NAME = "pocketllm_cpu_kernels"
_CFLAGS = ("-O3", "-fopenmp", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512vnni", "-mfma",
           "-mf16c")
_LDFLAGS = ("-fopenmp",)
_DONE = "built"   # written into the build directory once the library there is complete

_lock = threading.Lock()
# "ok": whether the kernels run (tests set it False to run torch's kernels); "loaded": the library is loaded and
# its fakes registered, which may happen once per process.
_state: dict[str, bool] = {}


@contextlib.contextmanager
def switched_off() -> Iterator[None]:
    """Layers and decode steps built inside use torch's kernels (to compare with them); later ones ours again."""
    with _lock:
        before = _state.get("ok")
        _state["ok"] = False
    try:
        yield
    finally:
        with _lock:
            if before is None:
                _state.pop("ok", None)
            else:
                _state["ok"] = before


def _cpu_has_flags() -> bool:
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as handle:
            flags = set(handle.read().split())
    except OSError:
        return False
    return all(flag in flags for flag in _FLAGS)


def build_dir() -> Path:
    """Where the library built from these sources, flags, torch and Python lives."""
    digest = hashlib.sha256()
    for path in [*_SOURCES, _HEADER]:
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    digest.update(" ".join([*_CFLAGS, *_LDFLAGS, torch.__version__, sys.version, platform.machine()]).encode())
    return cache_root() / "cpu_kernels" / digest.hexdigest()[:20]


def library_path() -> Path:
    """The built library's path (it exists once ``build()`` or ``available()`` has built it)."""
    return build_dir() / f"{_NAME}.so"


def is_built() -> bool:
    """Whether a complete library for these sources is in the cache."""
    directory = build_dir()
    return (directory / _DONE).is_file() and (directory / f"{_NAME}.so").is_file()


def _build() -> None:
    """Load the library (compiling it first when the cache lacks it), and register the shapes of its results
    for torch.compile."""
    directory = build_dir()
    if is_built():
        torch.ops.load_library(str(directory / f"{_NAME}.so"))
    else:
        from torch.utils import cpp_extension

        if shutil.which("ninja") is None:   # the ninja wheel's binary sits next to this interpreter
            os.environ["PATH"] = os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")
        directory.mkdir(parents=True, exist_ok=True)
        logger.warning("compiling PocketLLM's CPU kernels into %s (once; about a minute)", directory)
        started = time.perf_counter()
        # The header's hash in the flags makes a change to the shared header rebuild the objects.
        header = hashlib.sha256(_HEADER.read_bytes()).hexdigest()[:16]
        # OpenMP: without it ``at::parallel_for`` compiles to a plain loop (one thread); the library then shares the
        # OpenMP runtime torch has loaded (same soname), so its threads are torch's intra-op threads. The builder
        # holds a lock in the directory, so processes building at once build once.
        cpp_extension.load(
            name=_NAME, sources=[str(s) for s in _SOURCES], is_python_module=False, verbose=False,
            build_directory=str(directory), extra_cflags=[*_CFLAGS, f"-DPOCKETLLM_HEADER={header}"],
            extra_ldflags=list(_LDFLAGS))   # lists of their own: the builder appends to them
        (directory / _DONE).write_text(torch.__version__ + "\n", encoding="ascii")
        logger.info("CPU kernels built in %.1f s", time.perf_counter() - started)

    @torch.library.register_fake("pocketllm_cpu::q4_linear")
    def _(x: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        return x.new_empty((x.shape[0], weights.shape[0] * 16))   # 16 output channels per record

    @torch.library.register_fake("pocketllm_cpu::rescore_top")
    def _(logits: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, count: int) -> torch.Tensor:
        return logits

    @torch.library.register_fake("pocketllm_cpu::decode_attention")
    def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: torch.Tensor, scale: float,
          starts: torch.Tensor | None = None) -> torch.Tensor:
        return torch.empty_like(q, memory_format=torch.contiguous_format)


def available() -> bool:
    """Whether the kernels run here (built and loaded on the first call; False where they cannot be)."""
    with _lock:
        if "ok" not in _state:
            ok = False
            if _state.get("loaded"):
                ok = True
            elif _cpu_has_flags():
                try:
                    _build()
                    _state["loaded"] = ok = True
                except Exception as exc:  # no compiler, no ninja, a failed build: torch's kernels instead
                    logger.warning("PocketLLM's CPU kernels are unavailable (%s); torch's kernels run instead", exc)
            _state["ok"] = ok
        return _state["ok"]


def rescore_top(logits: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, count: int) -> torch.Tensor:
    """``logits`` [R, V] (float32, contiguous; changed in place and returned) with each row's ``count`` highest
    replaced by the exact float32 dot products of ``x`` [R, H] (float32) with those rows of ``weight``
    [>= V, H] (float32 or bfloat16)."""
    return torch.ops.pocketllm_cpu.rescore_top(logits, x, weight, count)


ATTENTION_DTYPES = (torch.bfloat16, torch.float32)   # the K/V dtypes ``decode_attention`` reads


def attention_supported(head_dim: int, group: int) -> bool:
    """Whether ``decode_attention`` takes heads of this size, ``group`` query heads per KV head (and runs here)."""
    return head_dim in (16, 32, 64, 128) and 1 <= group <= 8 and available()


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: torch.Tensor,
                     scale: float, starts: torch.Tensor | None = None) -> torch.Tensor:
    """``q`` [R, KVH, G, D] float32 over ``k``/``v`` [R, L, KVH, D]: row r attends to its positions ``starts[r]``
    (0 without ``starts``) to ``lengths[r] - 1``; [R, KVH, G, D] float32."""
    return torch.ops.pocketllm_cpu.decode_attention(q, k, v, lengths, scale, starts)


def decode_layers(hidden: torch.Tensor, weights: list[torch.Tensor], qkv_bias: list[torch.Tensor],
                  caches: list[torch.Tensor], slots: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  rows: list[torch.Tensor], row_index: torch.Tensor | None, span_start: int, lengths: torch.Tensor,
                  heads: int, kv_heads: int, eps: float, scale: float, final_norm: torch.Tensor,
                  final_eps: float, windows: list[int] | None = None, row_seq: torch.Tensor | None = None
                  ) -> torch.Tensor:
    """Every layer of a decode step (``decode_step.cpp``): ``hidden`` [R, H] float32 embeddings in, the final
    norm's output out. Stores each row's new K/V at ``slots`` of the per-layer ``caches`` (K, V, ... as
    ``[slots, KV heads, D]``) and, with dense ``rows`` (K, V, ... as ``[rows, tokens, KV heads, D]``), at
    ``row_index`` of those; row r attends to its first ``lengths[r]`` positions of its dense row, or of the cache
    from slot ``span_start`` (rows over a span are positions of one sequence); a layer whose ``windows`` entry
    ``w`` is not 0 attends to the last ``w`` of those only. ``row_seq`` (dense rows): row r's dense row, where
    several rows are positions of one sequence (a speculative verify step); default: row r's own."""
    return torch.ops.pocketllm_cpu.decode_layers(hidden, weights, qkv_bias, caches, slots, cos, sin, rows, row_index,
                                                 span_start, lengths, heads, kv_heads, eps, scale, final_norm,
                                                 final_eps, windows or [], row_seq)


def reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: torch.Tensor,
                        scale: float, starts: torch.Tensor | None = None) -> torch.Tensor:
    """``decode_attention`` in float64 torch ops (tests)."""
    keys, values = k.double().transpose(1, 2), v.double().transpose(1, 2)    # [R, KVH, L, D]
    scores = q.double() @ keys.transpose(-1, -2) * scale                     # [R, KVH, G, L]
    hidden = torch.arange(k.shape[1])[None, :] >= lengths[:, None]
    if starts is not None:
        hidden = hidden | (torch.arange(k.shape[1])[None, :] < starts[:, None])
    scores = scores.masked_fill(hidden[:, None, None, :], float("-inf"))
    return (scores.softmax(-1) @ values).float()


def main(argv: list[str] | None = None) -> int:
    """``python -m pocketllm.kernels.cpu_native --build``: build (or find) and load the kernels now. Exits 0 where
    they cannot run (a CPU without AVX-512 VNNI: torch's kernels run there), 1 when the build fails."""
    parser = argparse.ArgumentParser(prog="python -m pocketllm.kernels.cpu_native",
                                     description="PocketLLM's CPU kernels: build them ahead of the first request.")
    parser.add_argument("--build", action="store_true", help="Build (when not cached) and load the kernels.")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if not _cpu_has_flags():
        print(f"not built: this CPU lacks {', '.join(_FLAGS)}; the CPU path runs torch's kernels")
        return 0
    if not args.build:
        print(f"{'built' if is_built() else 'not built'}: {library_path()}")
        return 0
    started = time.perf_counter()
    if not available():
        print("the build failed (see the warning above); the CPU path runs torch's kernels", file=sys.stderr)
        return 1
    print(f"CPU kernels ready in {time.perf_counter() - started:.1f} s: {library_path()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
