"""CPU decode fast path: a decode-only step of a Llama-family model as one flat loop of few ops per layer.

The step computes what the model describes in its ``DecodePlan`` (``layers/decode_plan.py``, exported by
``decode_plan()``): norms, products, attention shapes and rotary tables, built once at setup. It reads nothing of
the model but that plan, so a model family gets the fast path by exporting one.

The reference path (``model.forward``) spends most of a small model's CPU decode step in per-op Python and
dispatch overhead (about sixty ops per layer, cache gathers per layer). This step computes the same layers
with about twenty ops each: one fused RMSNorm op, rotary embedding as ``x * cos + roll(x) * sin`` with the
sign folded into ``sin``, the KV store as one ``index_copy_`` per cache, and attention over a view of the
paged cache when the request's blocks are consecutive; several sequences attend over dense copies of their
context kept from step to step (``cpu_kv_rows.py``), and a gather of their blocks is the fallback. The padding
mask and the step's host metadata (slots, lengths, rotary rows) are built once per step, not per layer; so
are, per sliding window of the model, each row's first attended position (or its mask for torch's attention).
"""

from __future__ import annotations

import logging
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

from pocketllm.distributed import tp_size
from pocketllm.errors import InvalidRequestError
from pocketllm.kernels import cpu_native
from pocketllm.layers.decode_plan import DecodePlan, LayerPlan, decode_plan_of
from pocketllm.layers.quantized_linear import INT4_MAX_ROWS
from pocketllm.runner.cpu_kv_rows import DenseDecodeRows

logger = logging.getLogger("pocketllm.runner")

# Multi-row decode steps of up to this many sequences keep their context in dense rows (cpu_kv_rows.py).
DENSE_ROWS_MAX = 16


def setup_cpu(model: torch.nn.Module, weight_format: str, block_size: int,
              compile_step: bool = False, fast_path: bool = True) -> CpuDecodeStep | None:
    """Convert ``model``'s linear layers to ``weight_format`` (bfloat16, int4, int8; float32/auto: as loaded) and
    return the decode fast path when the model's layers are ones it computes (else None), compiled with
    ``compile_step``; ``fast_path=False``: the conversion and the checks only (the caller runs every step on the
    reference forward)."""
    if weight_format in ("bfloat16", "int4", "int8"):
        if tp_size() != 1:
            raise InvalidRequestError("cpu_weight_format bfloat16/int4/int8 runs on one rank only",
                                      param="cpu_weight_format")
        from pocketllm.layers.quantized_linear import convert_model, int8_available

        if weight_format == "int8" and not int8_available():
            raise InvalidRequestError("cpu_weight_format int8 needs fbgemm (an x86 build of torch); use int4",
                                      param="cpu_weight_format")
        count = convert_model(model, weight_format)
        logger.info("CPU weights: %d linear layers (LM head included) as %s", count, weight_format)
    plan = decode_plan_of(model) if tp_size() == 1 else None
    if plan is None or not CpuDecodeStep.supports(plan):
        if compile_step:
            raise InvalidRequestError(f"cpu_compile compiles the decode step of Llama-family models; "
                                      f"{type(model).__name__} has layers it does not compute", param="cpu_compile")
        logger.info("CPU decode fast path off: %s has layers it does not compute", type(model).__name__)
        return None
    return CpuDecodeStep(plan, block_size, compile_step) if fast_path else None


class DecodeBatch(NamedTuple):
    """A decode step's inputs, built once. The context is the cache rows ``span`` (one request whose blocks
    are consecutive), the dense rows (``dense_index``: each row's new-token index in them; ``dense_length``
    positions attended), or the gathered blocks ``index`` ([rows * blocks]); ``bias`` masks the padding for
    torch's attention, ``lengths`` (positions each row attends to) for PocketLLM's (``cpu_native``). Layers with a
    sliding window ``w`` attend from ``window_starts[w]`` (PocketLLM's attention) or under ``window_bias[w]``
    (torch's)."""

    ids: torch.Tensor
    slots: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    span: tuple[int, int] | None
    index: torch.Tensor | None
    bias: torch.Tensor | None
    dense_index: torch.Tensor | None = None
    dense_length: int = 0
    lengths: torch.Tensor | None = None
    window_starts: dict[int, torch.Tensor] | None = None
    window_bias: dict[int, torch.Tensor] | None = None
    row_seq: torch.Tensor | None = None     # a verify step over dense rows: each row's dense row


class FusedLayers(NamedTuple):
    """What ``cpu_native.decode_layers`` takes of the model: six weights per layer (norm, QKV records, output
    records, norm, gate/up records, down records; norms in float32), the QKV biases (float32; empty when there
    are none), the layers' shared norm eps, the final norm, and each layer's sliding window (0: none)."""

    weights: list[torch.Tensor]
    qkv_bias: list[torch.Tensor]
    eps: float
    final_norm: torch.Tensor
    final_eps: float
    windows: list[int]


def _fused_layers(plan: DecodePlan) -> FusedLayers | None:
    """The plan's layers as ``cpu_native.decode_layers`` takes them, or None when some product is not held as q4
    records (another weight format, or torch's int4 kernel), a layer has q/k norms or a bias outside the QKV
    product, or the layers' norms differ in eps."""
    weights, biases, eps = [], [], set()
    for layer in plan.layers:
        products = (layer.qkv, layer.o_proj, layer.gate_up, layer.down)
        if layer.attention.q_norm is not None or any(p.q4_records is None for p in products):
            return None
        if any(p.bias is not None for p in products[1:]):
            return None
        weights.extend([layer.input_norm.weight.float().contiguous(), layer.qkv.q4_records,
                        layer.o_proj.q4_records, layer.post_attention_norm.weight.float().contiguous(),
                        layer.gate_up.q4_records, layer.down.q4_records])
        if layer.qkv.bias is not None:
            biases.append(layer.qkv.bias.float().contiguous())
        eps.update((layer.input_norm.eps, layer.post_attention_norm.eps))
    if len(eps) != 1 or len(biases) not in (0, len(plan.layers)):
        return None
    final = plan.final_norm
    windows = [layer.attention.sliding_window or 0 for layer in plan.layers]
    return FusedLayers(weights, biases, eps.pop(), final.weight.float().contiguous(), final.eps, windows)


def _eager_layer(layer: LayerPlan) -> tuple:
    """A layer as the eager step unpacks it: input norm weight and eps, QKV product, q and k norm plans (or
    None), the attention holding the caches, output product, post-attention norm weight and eps, gate/up and
    down products (the products as callables)."""
    attention = layer.attention
    return (layer.input_norm.weight, layer.input_norm.eps, layer.qkv.run, attention.q_norm, attention.k_norm,
            attention.cache, layer.o_proj.run, layer.post_attention_norm.weight, layer.post_attention_norm.eps,
            layer.gate_up.run, layer.down.run)


class CpuDecodeStep:
    """Decode-only steps (every chunk one token that samples) of a supported model on CPU."""

    def __init__(self, plan: DecodePlan, block_size: int, compile_step: bool = False) -> None:
        self.plan = plan
        self.block_size = block_size
        first = plan.layers[0].attention
        self.num_heads, self.num_kv_heads, self.head_dim = first.num_heads, first.num_kv_heads, first.head_dim
        self.grouped = self.num_heads != self.num_kv_heads
        cos = first.rotary.cos
        half = self.head_dim // 2
        sign = torch.cat([-torch.ones(half), torch.ones(half)]).to(cos.dtype)
        # Rotary runs in the dtype of the q/k rows: the QKV projection's output (float32, or bfloat16 from
        # bfloat16/int4 weights), float32 after q/k norms; every layer has the same (``supports``).
        rotary_dtype = torch.float32 if first.q_norm is not None else plan.layers[0].qkv.out_dtype
        self.cos = cos.to(rotary_dtype)
        self.sin_signed = (first.rotary.sin * sign).to(rotary_dtype)
        self.embedding = plan.embedding
        self.layers = [_eager_layer(layer) for layer in plan.layers]
        self.windows = sorted({layer.attention.sliding_window for layer in plan.layers} - {None})
        self.norm = (plan.final_norm.weight, plan.final_norm.eps)
        self.scale = first.scale
        self.first_attention = first.cache   # its cache (bound later by the runner) gives the KV dtype
        # PocketLLM's decode attention where it runs (``cpu_native``): over the same bfloat16 rows on the 2-core
        # development machine, 4.1-5.9x faster than torch's SDPA at 1 row and 2.2-2.7x at 8 (contexts 160-384).
        self._native_heads = cpu_native.attention_supported(self.head_dim, self.num_heads // self.num_kv_heads)
        # With every product in q4 records, the steps over a cache span or the dense rows run as one C++ call
        # (``cpu_native.decode_layers``): no per-op Python, dispatch or compiled graph's guards.
        self.fused = _fused_layers(plan) if self._native_heads else None
        self._views: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._flat_views: list[torch.Tensor] = []   # ``_views`` as K, V, K, V, ... (``decode_layers``)
        self._views_of: torch.Tensor | None = None
        self.dense_rows: DenseDecodeRows | None = None   # made at the first multi-row step (caches bound)
        self._static_rows: list | None = None            # the dense rows last marked static (``run_step``)
        # Compiled (the steps ``run_step`` names): inductor's C++ code for the whole step around torch's int4
        # products, called from a C++ wrapper rather than a Python one (same process, same steps: 0.88 of the
        # Python wrapper's step time; max-autotune with frozen weights, which offers inductor's own int4
        # templates, found none faster than torch's kernel on the 2-core development machine). Row count and
        # context length stay symbolic, so each kind of step is one compile: one row over a cache span, one row
        # over a dense row (its blocks are not consecutive), several rows over dense rows (a row count of one is
        # a size of its own to the compiler).
        self._compiled = None
        self._tracing = True   # dynamo may still compile a step (until ``compiled_all``)
        if compile_step and self.fused is not None:
            logger.info("CPU decode steps run as one C++ call (q4 weights); cpu_compile has nothing to compile")
        elif compile_step and self.windows:
            logger.info("CPU decode steps of a model with sliding windows run eagerly; cpu_compile is off")
        elif compile_step:
            self._compiled = torch.compile(self.run, dynamic=True, options={"cpp_wrapper": True})

    # The most rows a compiled step runs: the linear layers change kernels above INT4_MAX_ROWS, so a larger
    # batch would need a graph of its own.
    compiled_max_rows = INT4_MAX_ROWS

    @property
    def compiles(self) -> bool:
        """Whether some kind of step is compiled (``cpu_compile``, unless every step it would compile is fused)."""
        return self._compiled is not None

    @staticmethod
    def supports(plan: DecodePlan) -> bool:
        """Whether the step computes ``plan``: every layer with the same attention shape, rotary and q/k norms
        (or none), and every layer's QKV product returning one dtype."""
        first = plan.layers[0]
        return all(layer.attention.shape == first.attention.shape and layer.qkv.out_dtype == first.qkv.out_dtype
                   for layer in plan.layers)

    def handles(self, chunks: list[Any]) -> bool:
        """Every chunk is one known new token that samples (a pure decode step; a token still pending from an
        asynchronously scheduled step goes through the reference path), or, with verify chunks (speculative
        decoding) among them, a step that ``verifies``."""
        if any(c.draft for c in chunks):
            return self.verifies(chunks)
        return all(c.num_tokens == 1 and c.samples and not c.last_token_pending for c in chunks)

    def verifies(self, chunks: list[Any]) -> bool:
        """Whether a step of decode rows and verify chunks runs here: every position as a row of one
        ``decode_layers`` call (q4 weights, PocketLLM's attention), over one request's cache span or the
        requests' dense rows (when they fit)."""
        if self.fused is None or not self.native_attention() or any(
                c.last_token_pending or not c.samples or (c.num_tokens > 1 and not c.draft) for c in chunks):
            return False
        if len(chunks) == 1 and self._span_table(chunks[0]) is not None:
            return True
        return self._dense_rows().fits(len(chunks), max(c.end for c in chunks) + 1,
                                       self.first_attention.k_cache.dtype)

    def _span_table(self, chunk: Any) -> list[int] | None:
        """The chunk's blocks up to its last position when they are consecutive (a cache span), else None."""
        table = chunk.request.block_table[: (chunk.end - 1) // self.block_size + 1]
        return table if all(b == table[0] + i for i, b in enumerate(table)) else None

    def _verify_metadata(self, chunks: list[Any]) -> DecodeBatch:
        """A step with verify chunks: one row per position (a decode row's token; a verify chunk's last known
        token and proposals), each attending to its sequence up to itself."""
        bs = self.block_size
        ids, positions, slots, seqs, tables = [], [], [], [], []
        for i, chunk in enumerate(chunks):
            request = chunk.request
            output = request.output_token_ids
            ids.append(output[-1] if output else request.prompt_token_ids[-1])
            ids.extend(chunk.draft)
            table = request.block_table
            for p in range(chunk.start, chunk.end):
                positions.append(p)
                slots.append(table[p // bs] * bs + p % bs)
            seqs.extend([i] * chunk.num_tokens)
            tables.append(table[: (chunk.end - 1) // bs + 1])
        lengths = [p + 1 for p in positions]
        starts, _ = self._windows(lengths, max(lengths), True)
        pos = torch.tensor(positions)
        span = self._span_table(chunks[0]) if len(chunks) == 1 else None
        dense_index = row_seq = None
        if span is not None:
            span = (span[0] * bs, span[0] * bs + chunks[0].end)
        else:
            first = self._dense_rows().prepare([c.request for c in chunks], [c.start for c in chunks], tables, bs,
                                               self._cache_views(), adds=[c.num_tokens for c in chunks])
            if first is None:
                raise RuntimeError("a verify step's context does not fit the dense rows")
            starts_of = first.tolist()
            dense_index = torch.tensor([starts_of[i] + p - chunks[i].start for i, p in zip(seqs, positions)])
            row_seq = torch.tensor(seqs)
        return DecodeBatch(torch.tensor(ids), torch.tensor(slots), self.cos[pos][:, None, :],
                           self.sin_signed[pos][:, None, :], span, None, None, dense_index,
                           max(lengths) if dense_index is not None else 0, torch.tensor(lengths), starts,
                           row_seq=row_seq)

    def _metadata(self, chunks: list[Any]) -> DecodeBatch:
        """Token ids, positions, cache slots and the attention context of a decode step (built once)."""
        if any(c.draft for c in chunks):
            return self._verify_metadata(chunks)
        bs = self.block_size
        ids, positions, slots, tables = [], [], [], []
        for chunk in chunks:
            request = chunk.request
            pos = chunk.start
            output = request.output_token_ids
            ids.append(output[-1] if output else request.prompt_token_ids[-1])  # pos is the last known token
            positions.append(pos)
            table = request.block_table
            slots.append(table[pos // bs] * bs + pos % bs)
            tables.append(table[: pos // bs + 1])
        lengths = [p + 1 for p in positions]
        span, index, bias, dense_index, padded = None, None, None, None, 0
        native = self.native_attention()
        table = tables[0]
        if len(chunks) == 1 and all(b == table[0] + i for i, b in enumerate(table)):
            span = (table[0] * bs, table[0] * bs + lengths[0])
        else:
            dense_index = self._dense_rows().prepare([c.request for c in chunks], positions, tables, bs,
                                                     self._cache_views())
            if dense_index is not None:
                padded = max(lengths)
            else:
                # Whole blocks (one contiguous copy each), every row padded to the longest table.
                blocks = max(len(t) for t in tables)
                index = torch.tensor([b for t in tables for b in t + [0] * (blocks - len(t))])
                padded = blocks * bs
            if not native:
                # The mask hides the positions past each row's length (added to scores in the cache's dtype).
                mask = torch.arange(padded)[None, :] < torch.tensor(lengths)[:, None]
                cache_dtype = self.first_attention.k_cache.dtype
                bias = torch.zeros(mask.shape, dtype=cache_dtype).masked_fill_(~mask, float("-inf"))
                bias = bias[:, None, None, :]
        starts, window_bias = self._windows(lengths, lengths[0] if span is not None else padded, native)
        pos = torch.tensor(positions)
        return DecodeBatch(torch.tensor(ids), torch.tensor(slots), self.cos[pos][:, None, :],
                           self.sin_signed[pos][:, None, :], span, index, bias, dense_index,
                           padded if dense_index is not None else 0,
                           torch.tensor(lengths) if native else None, starts, window_bias)

    def _windows(self, lengths: list[int], width: int, native: bool
                 ) -> tuple[dict[int, torch.Tensor] | None, dict[int, torch.Tensor] | None]:
        """Per sliding window ``w`` of the model: each row's first attended position (``max(0, length - w)``) for
        PocketLLM's attention, or the mask of the ``width`` context positions as a bias for torch's."""
        if not self.windows:
            return None, None
        ends = torch.tensor(lengths)
        firsts = {w: (ends - w).clamp(min=0) for w in self.windows}
        if native:
            return firsts, None
        cols = torch.arange(width)[None, :]
        cache_dtype = self.first_attention.k_cache.dtype
        biases = {}
        for w, first in firsts.items():
            mask = (cols >= first[:, None]) & (cols < ends[:, None])
            biases[w] = torch.zeros(mask.shape, dtype=cache_dtype).masked_fill_(~mask, float("-inf"))[:, None, None]
        return None, biases

    def native_attention(self) -> bool:
        """Whether steps attend through ``cpu_native.decode_attention`` (else torch's SDPA)."""
        return self._native_heads and self.first_attention.k_cache.dtype in cpu_native.ATTENTION_DTYPES

    def _dense_rows(self) -> DenseDecodeRows:
        """The dense K/V rows of multi-row steps, limited to a quarter of the paged cache's bytes."""
        if self.dense_rows is None:
            cache = self.first_attention.k_cache
            paged_bytes = cache.numel() * cache.element_size() * 2 * len(self.layers)
            self.dense_rows = DenseDecodeRows(len(self.layers), self.num_kv_heads, self.head_dim,
                                              DENSE_ROWS_MAX, paged_bytes // 4)
        return self.dense_rows

    def forward(self, chunks: list[Any]) -> torch.Tensor:
        """The hidden states after the final norm, one row per chunk (float32)."""
        return self.run_step(self._metadata(chunks))

    def run_step(self, batch: DecodeBatch) -> torch.Tensor:
        """``run``, compiled when the step was built to be: one row over its cache span, or up to
        ``compiled_max_rows`` rows over the dense K/V rows (one row too, when its blocks are not consecutive);
        other batches run eagerly."""
        rows = batch.ids.shape[0]
        if self.fused is not None and batch.lengths is not None and (
                batch.span is not None or batch.dense_index is not None):
            return self.run_fused(batch)
        if self._compiled is None or (rows > 1 and (batch.dense_index is None or rows > self.compiled_max_rows)):
            return self.run(batch)
        # Only the row count and the context length vary between steps: the rotary rows' width, the caches
        # (``_cache_views``) and the dense rows' heads keep static sizes, which lets inductor emit fixed-size
        # loops for rotary and the cache store (same process, same one-row batches: 0.91 of the step with every
        # size symbolic). Without duck sizing, sizes that happen to be equal at the first compile are not tied
        # to each other (such a tie would compile the step again once they differ). Python floats (the norms'
        # eps, the attention scale) are constants of the step: left symbolic, they made dynamo trace every step
        # twice (it restarts once it finds it cannot turn them into tensors): 171 s of start-up instead of about
        # 60 s with inductor's cache warm. Both settings only matter while dynamo traces, and entering them costs
        # ~0.1 ms, so steps after start-up skip them.
        for table in (batch.cos, batch.sin):
            torch._dynamo.mark_static(table, 1)
            torch._dynamo.mark_static(table, 2)
        if rows > 1 and self._static_rows is not self.dense_rows.layers:   # once per allocation of the rows
            for k_rows, v_rows in self.dense_rows.layers:
                for t in (k_rows, v_rows):
                    torch._dynamo.mark_static(t, 2)
                    torch._dynamo.mark_static(t, 3)
            self._static_rows = self.dense_rows.layers
        if self._tracing:
            shapes = torch.fx.experimental._config.patch(use_duck_shape=False)
            with shapes, torch._dynamo.config.patch(specialize_float=True):
                return self._compiled(batch)
        with torch.compiler.set_stance("eager_on_recompile"):
            return self._compiled(batch)

    def run_fused(self, batch: DecodeBatch) -> torch.Tensor:
        """The layers over a batch whose context is a cache span or the dense rows, in ``decode_layers``."""
        fused = self.fused
        rows = batch.ids.shape[0]
        self._cache_views()
        dense = batch.dense_index is not None
        hidden = F.embedding(batch.ids, self.embedding)
        return cpu_native.decode_layers(
            hidden if hidden.dtype == torch.float32 else hidden.float(), fused.weights, fused.qkv_bias,
            self._flat_views, batch.slots, batch.cos.reshape(rows, -1), batch.sin.reshape(rows, -1),
            self.dense_rows.flat if dense else [], batch.dense_index, 0 if dense else batch.span[0], batch.lengths,
            self.num_heads, self.num_kv_heads, fused.eps, self.scale, fused.final_norm, fused.final_eps,
            fused.windows, batch.row_seq)

    def compiled_all(self) -> None:
        """Start-up has compiled every kind of step (``EngineCore``): from now on a batch that matches none of
        the compiled steps runs eagerly instead of compiling mid-run (10-25 s on two cores, inside a request)."""
        self._tracing = False

    def _cache_views(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Every layer's K and V cache as ``[slots, kv_heads, head_dim]`` views, made again only when the runner
        has allocated new caches."""
        first = self.first_attention.k_cache
        if self._views_of is not first:
            shape = (-1, self.num_kv_heads, self.head_dim)
            self._views = [(layer[5].k_cache.view(shape), layer[5].v_cache.view(shape)) for layer in self.layers]
            self._flat_views = [t for pair in self._views for t in pair]
            self._views_of = first
            if self._compiled is not None:   # static sizes in the compiled step (``run_step``)
                for k, v in self._views:
                    torch._dynamo.mark_static(k)
                    torch._dynamo.mark_static(v)
        return self._views

    def run(self, batch: DecodeBatch) -> torch.Tensor:
        """The layers over a built decode batch."""
        dense = self.dense_rows.layers if batch.dense_index is not None else [None] * len(self.layers)
        hidden = F.embedding(batch.ids, self.embedding)
        residual = hidden
        for index, (layer, views, rows_kv) in enumerate(zip(self.layers, self._cache_views(), dense)):
            # The first residual is the embedding's fresh output; later ones are added to in place.
            hidden = self.layer(batch, layer, views, rows_kv, residual, hidden, index > 0)
        residual = residual + hidden
        return F.rms_norm(residual, self.norm[0].shape, self.norm[0], self.norm[1])

    def layer(self, batch: DecodeBatch, layer: tuple, views: tuple[torch.Tensor, torch.Tensor],
              rows_kv: tuple[torch.Tensor, torch.Tensor] | None, residual: torch.Tensor, hidden: torch.Tensor,
              add: bool) -> torch.Tensor:
        """One decoder layer: adds the attention output to ``residual`` in place (and ``hidden`` first when
        ``add``); returns the MLP's output, which the next layer (or the final norm) adds."""
        slots, cos, sin, span, index, bias = batch.slots, batch.cos, batch.sin, batch.span, batch.index, batch.bias
        dense_index, dense_length = batch.dense_index, batch.dense_length
        k_flat, v_flat = views
        rows = batch.ids.shape[0]
        heads, kv_heads, dim = self.num_heads, self.num_kv_heads, self.head_dim
        q_width = heads * dim
        norm1, eps1, qkv_proj, q_norm, k_norm, attn, o_proj, norm2, eps2, gate_up, down = layer
        if add:
            residual.add_(hidden)
        x = F.rms_norm(residual, norm1.shape, norm1, eps1)
        qkv = qkv_proj(x)  # float32, or bfloat16 from bfloat16/int4 weights: rotary runs in that dtype
        if q_norm is not None:
            qkv = qkv.float()
        qk = qkv[:, : q_width + kv_heads * dim].view(rows, heads + kv_heads, dim)
        if q_norm is not None:
            qk = torch.cat([F.rms_norm(qk[:, :heads], (dim,), q_norm.weight, q_norm.eps),
                            F.rms_norm(qk[:, heads:], (dim,), k_norm.weight, k_norm.eps)], dim=1)
        qk = torch.addcmul(qk * cos, qk.roll(dim // 2, -1), sin)
        q = qk[:, :heads]
        k = qk[:, heads:]
        v = qkv[:, q_width + kv_heads * dim:].view(rows, kv_heads, dim)
        kv_dtype = k_flat.dtype
        k, v = (k if k.dtype == kv_dtype else k.to(kv_dtype)), (v if v.dtype == kv_dtype else v.to(kv_dtype))
        k_flat.index_copy_(0, slots, k)
        v_flat.index_copy_(0, slots, v)
        # Dense rows are [rows, length, kv heads, dim] already; other contexts are viewed that way.
        if rows_kv is not None:
            k_rows, v_rows = rows_kv
            k_rows.view(-1, kv_heads, dim).index_copy_(0, dense_index, k)
            v_rows.view(-1, kv_heads, dim).index_copy_(0, dense_index, v)
            keys, values = k_rows[:rows, :dense_length], v_rows[:rows, :dense_length]
        else:
            if span is not None:
                keys, values = k_flat[span[0]:span[1]], v_flat[span[0]:span[1]]
            else:
                keys, values = attn.k_cache.index_select(0, index), attn.v_cache.index_select(0, index)
            keys = keys.view(rows, -1, kv_heads, dim)
            values = values.view(rows, -1, kv_heads, dim)
        window = attn.sliding_window
        if batch.lengths is not None:   # PocketLLM's kernel: float32 queries, each row to its own length
            query = q.reshape(rows, kv_heads, heads // kv_heads, dim)
            out = cpu_native.decode_attention(query if query.dtype == torch.float32 else query.float(), keys, values,
                                              batch.lengths, self.scale,
                                              None if window is None else batch.window_starts[window])
        else:
            out = self._sdpa(q, keys, values, bias if window is None else batch.window_bias[window], rows)
        out = out.reshape(rows, q_width)
        residual.add_(o_proj(out if out.dtype == qkv.dtype else out.to(qkv.dtype)))
        x = F.rms_norm(residual, norm2.shape, norm2, eps2)
        gu = gate_up(x)
        width = gu.shape[-1] // 2
        return down(F.silu(gu[:, :width]) * gu[:, width:])

    def _sdpa(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, bias: torch.Tensor | None,
              rows: int) -> torch.Tensor:
        """torch's attention over [rows, L, KV heads, dim] keys/values: one fused kernel reads the strided context
        in place, in the cache's dtype. A KV head's query heads go in as query positions of that head: measured
        faster than grouped heads at 1-8 rows, float32 (8-41%) and bfloat16 (SmolLM2's heads, gathered context
        144-384: 11-20% at 1 row, 23-51% at 8)."""
        kv_heads, dim, kv_dtype = keys.shape[2], keys.shape[3], keys.dtype
        keys, values = keys.transpose(1, 2), values.transpose(1, 2)
        if self.grouped:
            query = q.reshape(rows, kv_heads, self.num_heads // kv_heads, dim)
        else:
            query = q.unsqueeze(2)
        return F.scaled_dot_product_attention(query if query.dtype == kv_dtype else query.to(kv_dtype), keys,
                                              values, attn_mask=bias, scale=self.scale)
