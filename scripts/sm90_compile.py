"""A Triton kernel compiled for sm_90 on a machine without a GPU, and the CUDA tools bundled with Triton (for
``decode_kernel_registers.py`` and ``one_row_instructions.py``; compile with the GPU machine's Triton release)."""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource


def compile_sm90(kernel: Any, types: dict[str, str], constants: dict[str, Any], aligned: Iterable[str],
                 warps: int, stages: int) -> Any:
    """``kernel`` with argument ``types`` (the others constexprs, given in ``constants``), the ``aligned``
    arguments divisible by 16 as the launcher specialises them."""
    names = kernel.arg_names
    source = ASTSource(fn=kernel, signature={name: types.get(name, "constexpr") for name in names},
                       attrs={(names.index(n),): [["tt.divisibility", 16]] for n in aligned},
                       constexprs={(names.index(n),): v for n, v in constants.items()})
    return triton.compile(source, target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": warps, "num_stages": stages})


def triton_tool(name: str) -> str:
    """The path of one of the CUDA tools Triton bundles (ptxas, cuobjdump, nvdisasm)."""
    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)
