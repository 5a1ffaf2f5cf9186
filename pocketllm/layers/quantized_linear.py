"""CPU weight formats for the linear layers and the LM head: dense bfloat16, int4 weight-only, or int8.

int4 holds each group of 32 input weights of a row as 4-bit codes with a scale and an offset: GGUF's Q4_1 block,
so quantising the dequantised GGUF weights recovers their codes. Where the CPU has AVX-512 VNNI, the product is
PocketLLM's own kernel (``q4_linear.py``: fp16 scale and minimum, exactly the GGUF's; activations quantised to
8 bits per row and block of 32, as llama.cpp does; float32 out). Elsewhere it is torch's packed kernel
(``_weight_int4pack_mm_for_cpu``: bfloat16 activations, the scale and offset rounded to bfloat16).

That kernel is fast for a few rows (decode) and slow for many (prefill), so each layer also keeps the same
int4 weights dequantised to dense bfloat16 and uses them above ``INT4_MAX_ROWS`` rows.

int8 holds each layer's weights in 8 bits per output channel and quantises the activations to 8 bits per
call (fbgemm's dynamic product): slower than int4 at one row, faster at several (the int4 kernel unpacks every
weight for every row), at a small cost in quality (docs/benchmarks.md). Above ``INT4_MAX_ROWS`` rows it uses
the same dense bfloat16 copy. With int4 and int8 the LM head is ``RescoredLMHead``.
"""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F
from torch import nn

from pocketllm.kernels import cpu_native
from pocketllm.layers import q4_linear
from pocketllm.layers.decode_plan import ProductPlan

GROUP_SIZE = 32
INT4_MAX_ROWS = 8  # measured (2-core Xeon, all 30 layers in turn: weights not cache-hot): faster up to ~10 rows


def quantize_int4(weight: torch.Tensor, group_size: int = GROUP_SIZE) -> tuple[torch.Tensor, torch.Tensor]:
    """Asymmetric 4-bit codes ``[N, K]`` (int32, 0..15) and ``[K / group, N, 2]`` bfloat16 (scale, zero)."""
    rows, cols = weight.shape
    groups = weight.float().reshape(rows, cols // group_size, group_size)
    low, high = groups.amin(-1), groups.amax(-1)
    scale = ((high - low) / 15).to(torch.bfloat16).float()
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    zero = (low + 8 * scale).to(torch.bfloat16).float()
    codes = torch.round((groups - zero[..., None]) / scale[..., None] + 8).clamp_(0, 15)
    scales_zeros = torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous().to(torch.bfloat16)
    return codes.reshape(rows, cols).to(torch.int32), scales_zeros


def dequantize_int4(codes: torch.Tensor, scales_zeros: torch.Tensor, group_size: int = GROUP_SIZE) -> torch.Tensor:
    """The float32 weight ``[N, K]`` the int4 kernel multiplies by (the reference for tests)."""
    rows, cols = codes.shape
    sz = scales_zeros.float().transpose(0, 1)  # [N, K / group, 2]
    groups = codes.float().reshape(rows, cols // group_size, group_size)
    return ((groups - 8) * sz[..., :1] + sz[..., 1:]).reshape(rows, cols)


def int4_supported(in_features: int, out_features: int) -> bool:
    """Whether the packed kernel takes this shape (K a whole number of groups, N a multiple of 16)."""
    return in_features % GROUP_SIZE == 0 and in_features >= GROUP_SIZE and out_features % 16 == 0


def _vnni() -> bool:
    """Whether the CPU has 8-bit dot products (VNNI): without them fbgemm's 8-bit product may saturate its
    16-bit intermediate sums, and activations must keep to 7 bits (``reduce_range``)."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as handle:
            flags = handle.read()
    except OSError:
        return False
    return "avx512_vnni" in flags or "avx_vnni" in flags


class Int8Product:
    """``x @ W.T`` with ``W`` in 8 bits per output channel (symmetric) and ``x`` in 8 bits per row (fbgemm's
    dynamic int8 product, VNNI dot products): float32 in and out.

    fbgemm quantises a call's activations with one range for all its rows, which would make a row's result
    depend on the other rows of the batch. So each row is divided by its largest magnitude and two more columns,
    +1 and -1 (zero weights), fix the range at [-1, 1] whatever the batch; the results are scaled back per row.
    A row's output is then the same alone or in any batch, and each row uses the whole 8-bit range.

    At a few rows torch's packed int4 kernel is compute-bound (it unpacks every weight for every row); this
    product reads twice the bytes but runs the dot products in 8-bit integers (measured on the LM head,
    49,152 x 576: 0.9 ms at 1 row, 1.4 ms at 8, against 1.2 and 4.4 ms in int4).
    """

    # the range columns, padded to a multiple of 8 columns
    extra = 8

    def __init__(self, weight: torch.Tensor) -> None:
        w = weight.detach().float()
        self.in_features = w.shape[1]
        w = torch.cat([w, w.new_zeros(w.shape[0], self.extra)], dim=1)
        scale = w.abs().amax(dim=1).clamp_min(torch.finfo(torch.float32).tiny) / 127
        zeros = torch.zeros(w.shape[0], dtype=torch.long)
        with warnings.catch_warnings():  # quantised tensors are deprecated; the packed product is all we keep
            warnings.simplefilter("ignore")
            codes = torch.quantize_per_channel(w, scale.double(), zeros, 0, torch.qint8)
            self.packed = torch.ops.quantized.linear_prepack(codes, None)
        self.reduce_range = not _VNNI
        self.nbytes = w.numel() + 4 * w.shape[0]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x = x.float().reshape(-1, self.in_features)
        magnitude = x.abs().amax(dim=1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)
        rows = x.new_zeros(x.shape[0], self.in_features + self.extra)
        torch.div(x, magnitude, out=rows[:, :self.in_features])
        rows[:, self.in_features] = 1.0
        rows[:, self.in_features + 1] = -1.0
        out = torch.ops.quantized.linear_dynamic(rows, self.packed, self.reduce_range) * magnitude
        return out.reshape(*lead, out.shape[-1])


_VNNI = _vnni()


def int8_available() -> bool:
    """Whether this torch build has fbgemm's 8-bit CPU product (x86 builds do)."""
    return "fbgemm" in torch.backends.quantized.supported_engines


class CpuLinear(nn.Module):
    """``x @ W.T (+ b)`` with ``W`` held as bfloat16 or int4; returns bfloat16 (``act_dtype``) outputs.

    ``out_features`` past ``keep`` (padded LM-head rows) are dropped from the result.
    """

    act_dtype = torch.bfloat16

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, weight_format: str,
                 keep: int | None = None, dense: bool = True) -> None:
        super().__init__()
        self.weight_format = weight_format
        self.out_features, self.in_features = weight.shape
        self.keep = keep if keep is not None and keep < self.out_features else None
        self.bias = None if bias is None else bias.detach().to(torch.bfloat16)
        # Buffers, not plain attributes: module state that a compiled decode step (``cpu_compile``) takes as
        # the module's, not as constants of the traced function.
        self.register_buffer("packed", None)
        self.register_buffer("scales_zeros", None)
        self.register_buffer("records", None)   # the 4-bit x 8-bit kernel's weights (q4_linear.py)
        self.int8: Int8Product | None = None
        if weight_format == "int4" and cpu_native.available():
            held = q4_linear.quantize_q4(weight)
            self.records = q4_linear.pack_q4(*held)
            full = q4_linear.dequantize_q4(*held) if dense else None
        elif weight_format == "int4":
            codes, self.scales_zeros = quantize_int4(weight)
            self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
            full = dequantize_int4(codes, self.scales_zeros) if dense else None
        elif weight_format == "int8":
            self.int8 = Int8Product(weight)
            full = weight.detach() if dense else None
        elif weight_format == "bfloat16":
            full = weight.detach()
        else:
            raise ValueError(f"CpuLinear holds bfloat16, int4 or int8 weights, not {weight_format!r}")
        # The same weights dense, for many rows (prefill); None: the caller never passes many rows.
        self.dense = None if full is None else full.to(torch.bfloat16).contiguous()

    @property
    def few_rows_dtype(self) -> torch.dtype:
        """The dtype of a few rows' result: float32 from the 8-bit products, else ``act_dtype``."""
        return torch.float32 if self.int8 is not None or self.records is not None else self.act_dtype

    def q4_records(self) -> torch.Tensor | None:
        """The 4-bit kernel's records when a few rows' result is exactly their product plus ``bias`` (else None:
        another weight format, torch's int4 kernel, or padded rows dropped by ``keep``)."""
        return self.records if self.keep is None else None

    def decode_product(self) -> ProductPlan:
        """This layer as a decode step's product of a few rows (``few_rows_dtype`` out)."""
        return ProductPlan(self.few_rows, self.few_rows_dtype, self.bias, self.q4_records())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` [..., K] of any float dtype → [..., N] bfloat16: the dense weights whatever the row count, so a
        prompt's last tokens give the same result whether they run alone (after a prefix-cache hit, or as a
        chunk's tail) or inside a whole prompt. A layer without dense weights takes ``few_rows``."""
        return self._product(x, few=self.dense is None)

    def few_rows(self, x: torch.Tensor) -> torch.Tensor:
        """A decode step's rows: up to ``INT4_MAX_ROWS`` through the 4- or 8-bit kernel (float32 out from the
        8-bit-activation products), more through the dense weights."""
        return self._product(x, few=self.dense is None or x.dim() == 2 and x.shape[0] <= INT4_MAX_ROWS)

    def _product(self, x: torch.Tensor, few: bool) -> torch.Tensor:
        if few and (self.int8 is not None or self.records is not None):
            if self.int8 is not None:
                out = self.int8(x)
            else:
                out = q4_linear.matmul(x, self.records)
            if self.bias is not None:
                out = out + self.bias
            return out if self.keep is None else out[..., : self.keep]
        if x.dtype != torch.bfloat16:
            x = x.to(torch.bfloat16)
        if self.packed is not None and few:
            out = torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.packed, GROUP_SIZE, self.scales_zeros)
            if self.bias is not None:
                out = out + self.bias
        else:
            out = F.linear(x, self.dense, self.bias)
        return out if self.keep is None else out[..., : self.keep]

    def weight_bytes(self) -> int:
        """Bytes one decode step (a few rows) reads from this layer's weights."""
        if self.records is not None:
            return self.records.numel()
        if self.packed is not None:
            return self.packed.numel() * self.packed.element_size() + self.scales_zeros.numel() * 2
        if self.int8 is not None:
            return self.int8.nbytes
        return self.dense.numel() * 2


class RescoredLMHead(nn.Module):
    """LM head in 8 bits (``Int8Product``; int4 where fbgemm is missing) whose ``rescore`` highest logits per
    row are recomputed from the float weight.

    The quantised weights and activations lose precision that decides close calls; recomputing the top candidates
    exactly keeps the argmax, and so greedy output, that of the float head whenever the true best token is
    among them. Logits outside the top ``rescore`` keep their 8-bit value (float32 out). More than
    ``INT4_MAX_ROWS`` rows use the float weight rounded to bfloat16 throughout.
    """

    rescore = 64

    def __init__(self, weight: torch.Tensor, vocab_size: int) -> None:
        super().__init__()
        self.exact = weight.detach()  # the tied embedding table itself: no copy
        self.vocab_size = vocab_size
        if int8_available():
            self.inner = Int8Product(self.exact[:vocab_size])
        else:
            self.inner = CpuLinear(self.exact, None, "int4", keep=vocab_size, dense=False)
        self.dense = self.exact.to(torch.bfloat16)
        # PocketLLM's rescoring kernel where it runs and takes these weights: float32 products (of bfloat16
        # weights too, where torch's bmm in ``forward`` rounds to them).
        self.native = (cpu_native.available() and self.exact.dtype in (torch.float32, torch.bfloat16)
                       and self.exact.shape[-1] % 16 == 0 and self.exact.stride(-1) == 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2 or x.shape[0] > INT4_MAX_ROWS:
            return F.linear(x.to(torch.bfloat16), self.dense)[..., : self.vocab_size].float()
        logits = self.inner(x).float()
        count = min(self.rescore, self.vocab_size)
        if self.native:
            return cpu_native.rescore_top(logits.contiguous(), x.float().contiguous(), self.exact, count)
        top = logits.topk(count, dim=-1).indices
        rows = self.exact.index_select(0, top.reshape(-1)).view(*top.shape, -1)
        exact = torch.bmm(rows, x.to(rows.dtype).unsqueeze(-1)).squeeze(-1)
        return logits.scatter_(1, top, exact.float())

    def weight_bytes(self) -> int:
        """Bytes one decode step (a few rows) reads from the quantised head (the 64 rescored rows ignored)."""
        inner = self.inner
        return inner.weight_bytes() if isinstance(inner, CpuLinear) else inner.nbytes


class FloatOutput(nn.Module):
    """Wraps a CpuLinear so that the model's float32 residual stream gets its own dtype back."""

    def __init__(self, inner: CpuLinear) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x).to(x.dtype)

    def decode_product(self) -> ProductPlan:
        """The wrapped layer's product (its own output dtype: a decode step casts where it needs to)."""
        return self.inner.decode_product()


def convert_model(model: nn.Module, weight_format: str) -> int:
    """Replace every linear layer and the LM head of ``model`` by CpuLinear in ``weight_format``; the count."""
    from pocketllm.layers.embedding import ParallelLMHead
    from pocketllm.layers.linear import LinearBase

    replaced = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, LinearBase):
                weight, bias, keep = child.weight.data, child.bias, None
                if weight_format == "int4" and not int4_supported(weight.shape[1], weight.shape[0]):
                    keep, pad = weight.shape[0], -weight.shape[0] % 16
                    if not int4_supported(weight.shape[1], keep + pad):
                        continue
                    # rows padded with zeros to the kernel's multiple of 16, dropped from the result (``keep``)
                    weight = torch.cat([weight, weight.new_zeros(pad, weight.shape[1])])
                    bias = None if bias is None else torch.cat([bias, bias.new_zeros(pad)])
                setattr(parent, name, FloatOutput(CpuLinear(weight, bias, weight_format, keep=keep)))
                replaced += 1
            elif isinstance(child, ParallelLMHead):
                if weight_format == "int8" or (weight_format == "int4" and (
                        int8_available() or int4_supported(child.weight.shape[1], child.weight.shape[0]))):
                    setattr(parent, name, RescoredLMHead(child.weight.data, child.vocab_size))
                else:
                    setattr(parent, name, FloatOutput(CpuLinear(child.weight.data, None, "bfloat16",
                                                                keep=child.vocab_size)))
                replaced += 1
    return replaced
