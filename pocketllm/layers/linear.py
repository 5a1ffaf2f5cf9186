"""Tensor-parallel linear layers; each parameter carries a ``weight_loader`` that takes its shard."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pocketllm.distributed import all_reduce, max_over_ranks_, tp_rank, tp_size
from pocketllm.errors import UnsupportedFeatureError
from pocketllm.layers.activation import silu_and_mul
from pocketllm.layers.decode_plan import ProductPlan
from pocketllm.layers.float8_weight import Float8Weight
from pocketllm.layers.norm import RMSNorm


def split_over_ranks(total: int, what: str) -> int:
    """This rank's share of ``total`` (heads, features: ``what`` names them, e.g. a config field); a count that
    does not split evenly over the tensor-parallel ranks is refused."""
    size = tp_size()
    if total % size:
        raise UnsupportedFeatureError(f"{what}={total} does not split evenly over {size} tensor-parallel ranks: "
                                      "choose a tensor_parallel_size that divides it")
    return total // size


def _add_bias(out: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return out if bias is None else out + bias


class LinearBase(Float8Weight, nn.Module):
    """A weight (and optional bias) split along ``tp_dim`` (0: output rows, 1: input columns, None: whole)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp_dim: int | None,
                 prologue: str | None = None, epilogue: str | None = None) -> None:
        super().__init__()
        self.prologue = prologue
        self.epilogue = epilogue
        self.tp_dim = tp_dim
        self.tp_rank = tp_rank()
        self.tp_size = tp_size()
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False)
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        if self.tp_dim is not None and self.tp_size > 1 and loaded.dim() > self.tp_dim:
            dim = self.tp_dim if loaded.dim() > 1 else 0
            if param.dim() == 1 and self.tp_dim == 1:
                param.data.copy_(loaded)
                return
            size = param.shape[dim]
            loaded = loaded.narrow(dim, self.tp_rank * size, size)
        param.data.copy_(loaded)

    # CUDA, set by the model runner after timing on this weight's shape: rows up to which the skinny Triton
    # kernel replaces F.linear, and rows up to which the layer's input prologue (``prologue``: "rms_norm" or
    # "silu_mul", what the model computes before this layer) runs fused into that kernel. 0 = never. For one
    # row, the skinny kernel's launch settings timed fastest on this shape, plain and fused (None: untimed).
    skinny_rows = 0
    fused_rows = 0
    one_row = None
    fused_one_row = None
    # Likewise for a [gate; up] projection whose output feeds SiLU·mul (``epilogue="silu_mul"``): the one-row
    # launch settings of the product with the activation computed in the same kernel, when that measured
    # faster (None: not used), and whether the norm before it (if any) runs in that kernel too.
    silu_epilogue = None
    silu_epilogue_norm = False

    def fp8_row_amax(self) -> torch.Tensor | None:
        """A row split across ranks (``tp_dim`` 1) is scaled as a whole: its largest magnitude over the ranks."""
        if self.tp_dim == 1 and self.tp_size > 1:
            return max_over_ranks_(self.weight.data.float().abs().amax(dim=1))
        return None

    def _product(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if x.dim() == 2 and 0 < x.shape[0] <= self.skinny_rows:
            from pocketllm.kernels.gemv import skinny_linear

            return _add_bias(skinny_linear(x, self.weight, self.one_row, scale=self.weight_scale), bias)
        if self.weight_scale is not None:
            from pocketllm.kernels.fp8 import scaled_product

            return scaled_product(x, self.weight, self.weight_scale, bias)
        return F.linear(x, self.weight, bias)

    def _bias(self) -> torch.Tensor | None:
        return self.bias

    def _finish(self, out: torch.Tensor) -> torch.Tensor:
        """What follows the product (a row-parallel layer sums the ranks' partial outputs)."""
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._finish(self._product(x, self._bias()))

    def decode_product(self) -> ProductPlan | None:
        """This layer as a decode step's plain ``F.linear`` (None when split across ranks)."""
        if self.tp_size != 1:
            return None
        weight, bias, scale = self.weight, self.bias, self.weight_scale
        if scale is not None:
            from pocketllm.kernels.fp8 import scaled_product

            dtype = self.compute_dtype
            return ProductPlan(lambda x: scaled_product(x.to(dtype), weight, scale, bias), dtype, bias)
        return ProductPlan(lambda x: F.linear(x, weight, bias), weight.dtype, bias)

    def fuses(self, x: torch.Tensor) -> bool:
        """Whether the input prologue runs fused into this layer's kernel for ``x``."""
        return x.dim() == 2 and 0 < x.shape[0] <= self.fused_rows

    def uses_silu_epilogue(self, x: torch.Tensor) -> bool:
        """Whether ``forward_silu`` runs one kernel for ``x`` (one row, where the model runner measured it)."""
        return self.silu_epilogue is not None and x.dim() == 2 and x.shape[0] == 1

    def forward_silu(self, x: torch.Tensor, residual: torch.Tensor | None = None,
                     norm: RMSNorm | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(silu(gate) * up, residual)`` of this [gate; up] projection of one row: of ``norm(x + residual)``
        with a norm (the residual returned is then ``x + residual``, or ``x``), with the activation computed
        in the product's kernel (and the norm too where ``silu_epilogue_norm``)."""
        from pocketllm.kernels.gemv import one_row_silu_product

        if norm is not None and not self.silu_epilogue_norm:
            x, residual = (norm(x), x) if residual is None else norm(x, residual)
            norm = None
        if norm is None:
            return one_row_silu_product(x, self.weight, self.silu_epilogue, scale=self.weight_scale)[0], residual
        return one_row_silu_product(x, self.weight, self.silu_epilogue, residual, norm.weight, norm.eps,
                                    norm.offset, scale=self.weight_scale)

    def forward_fused_silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        from pocketllm.kernels.gemv import skinny_silu_mul_linear

        out = skinny_silu_mul_linear(gate_up, self.weight, self.fused_one_row, scale=self.weight_scale)
        return self._finish(_add_bias(out, self._bias()))

    def forward_fused_norm(self, x: torch.Tensor, residual: torch.Tensor | None, norm: RMSNorm,
                           normed: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(self(norm(x + residual)), x + residual)`` in one kernel, writing ``norm(x + residual)`` into
        ``normed`` when given."""
        from pocketllm.kernels.gemv import skinny_rms_norm_linear

        out, residual = skinny_rms_norm_linear(x, residual, norm.weight, norm.eps, self.weight, norm.offset,
                                               self.fused_one_row, scale=self.weight_scale, normed=normed)
        return self._finish(_add_bias(out, self._bias())), residual


def uses_silu_epilogue(proj: nn.Module, x: torch.Tensor) -> bool:
    """Whether ``proj`` (a [gate; up] projection) computes SiLU·mul of its output in its own kernel for ``x``
    (``forward_silu``); any other module, such as the CPU's quantised layers, does not."""
    return isinstance(proj, LinearBase) and proj.uses_silu_epilogue(x)


def silu_mul_projection(proj: nn.Module, gate_up: torch.Tensor) -> torch.Tensor:
    """``proj(silu(gate) * up)`` for ``gate_up`` [..., 2 * in_features] holding [gate | up]; one kernel where the
    model runner measured that faster for ``proj``."""
    if isinstance(proj, LinearBase) and proj.fuses(gate_up):
        return proj.forward_fused_silu_mul(gate_up)
    return proj(silu_and_mul(gate_up))


def normed_projection(proj: nn.Module, x: torch.Tensor, residual: torch.Tensor | None,
                      norm: RMSNorm) -> tuple[torch.Tensor, torch.Tensor]:
    """``(proj(norm(x + residual)), x + residual)``; without ``residual`` the norm is of ``x``, which is returned
    as the residual. One kernel where the model runner measured that faster for ``proj``."""
    out, residual, _ = _normed_projection(proj, x, residual, norm, keep_input=False)
    return out, residual


def normed_projection_keeping_input(proj: nn.Module, x: torch.Tensor, residual: torch.Tensor | None,
                                    norm: RMSNorm) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``normed_projection`` for a block that reads the normed input again after ``proj``: ``(proj(h), x +
    residual, h)`` with ``h = norm(x + residual)``; where the norm runs in ``proj``'s kernel, that kernel writes
    ``h`` too."""
    out, residual, normed = _normed_projection(proj, x, residual, norm, keep_input=True)
    assert normed is not None   # (always written when asked for)
    return out, residual, normed


def _normed_projection(proj: nn.Module, x: torch.Tensor, residual: torch.Tensor | None, norm: RMSNorm,
                       keep_input: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``(proj(h), x + residual, h or None)`` with ``h = norm(x + residual)``: ``h`` is returned with
    ``keep_input``, which on the fused path has the kernel write it."""
    if isinstance(proj, LinearBase) and proj.fuses(x):
        normed = torch.empty(x.shape, dtype=x.dtype, device=x.device) if keep_input else None
        out, residual = proj.forward_fused_norm(x, residual, norm, normed)
        return out, residual, normed
    normed, residual = (norm(x), x) if residual is None else norm(x, residual)
    return proj(normed), residual, normed


class ReplicatedLinear(LinearBase):
    """The same full weight on every rank."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__(in_features, out_features, bias, tp_dim=None)


class ColumnParallelLinear(LinearBase):
    """Output features split across ranks; the output stays sharded."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, prologue: str | None = None,
                 epilogue: str | None = None) -> None:
        local = split_over_ranks(out_features, "a column-parallel layer's out_features")
        super().__init__(in_features, local, bias, tp_dim=0, prologue=prologue,
                         epilogue=epilogue)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of one input stored as one weight (e.g. gate and up)."""

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool = False,
                 prologue: str | None = None, epilogue: str | None = None) -> None:
        self.output_sizes = output_sizes
        super().__init__(in_features, sum(output_sizes), bias, prologue, epilogue)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int) -> None:
        offset = sum(self.output_sizes[:shard_id]) // self.tp_size
        size = self.output_sizes[shard_id] // self.tp_size
        target = param.data.narrow(0, offset, size)
        target.copy_(loaded.narrow(0, self.tp_rank * size, size))


class QKVParallelLinear(ColumnParallelLinear):
    """The query, key and value projections as one weight; KV heads are replicated when fewer than ranks."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int,
                 bias: bool = False, prologue: str | None = None) -> None:
        size = tp_size()
        self.head_dim = head_dim
        self.num_heads = split_over_ranks(num_heads, "num_attention_heads")
        if num_kv_heads % size and size % num_kv_heads:
            raise UnsupportedFeatureError(
                f"num_key_value_heads={num_kv_heads} neither splits evenly over {size} tensor-parallel ranks nor "
                "replicates evenly on them: choose a tensor_parallel_size that divides it or that it divides")
        self.num_kv_heads = max(1, num_kv_heads // size)
        self.kv_replicas = max(1, size // num_kv_heads)
        out_features = (self.num_heads + 2 * self.num_kv_heads) * head_dim * size
        super().__init__(hidden_size, out_features, bias, prologue)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str) -> None:
        q_size = self.num_heads * self.head_dim
        kv_size = self.num_kv_heads * self.head_dim
        if shard_id == "q":
            offset, size, rank = 0, q_size, self.tp_rank
        else:
            offset = q_size if shard_id == "k" else q_size + kv_size
            size, rank = kv_size, self.tp_rank // self.kv_replicas
        param.data.narrow(0, offset, size).copy_(loaded.narrow(0, rank * size, size))


class RowParallelLinear(LinearBase):
    """Input features split across ranks; partial outputs are summed (bias added once)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, prologue: str | None = None) -> None:
        local = split_over_ranks(in_features, "a row-parallel layer's in_features")
        super().__init__(local, out_features, bias, tp_dim=1, prologue=prologue)

    def _bias(self) -> torch.Tensor | None:
        return self.bias if self.tp_rank == 0 else None

    def _finish(self, out: torch.Tensor) -> torch.Tensor:
        return all_reduce(out)
