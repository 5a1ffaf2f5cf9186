"""Builds the model on its device, owns the paged KV cache, and runs one scheduled step."""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

import numpy as np
import torch

from pocketllm.distributed import tp_rank, tp_size
from pocketllm.distributed.step_channel import StepChannel
from pocketllm.errors import InvalidRequestError, UnsupportedFeatureError
from pocketllm.kernels import available as kernels_available
from pocketllm.layers.attention_backend import TritonAttentionBackend
from pocketllm.models.registry import model_class
from pocketllm.models.weights import init_dummy_weights, load_weights
from pocketllm.runner.mtp_head import MtpHead
from pocketllm.runner.reference_graphs import ReferenceGraphStep
from pocketllm.runner.sampler import Sampler, SamplingRow
from pocketllm.runner.spec_verify import verify
from pocketllm.runner.step_backend import (
    CpuDecodeBackend,
    CudaGraphStep,
    HostBatchStep,
    ReferenceStep,
    StepBackend,
)
from pocketllm.sampling_params import SamplingParams
from pocketllm.step.attention_metadata import AttentionMetadata
from pocketllm.step.host_batch import HostBatch
from pocketllm.step.sampled import SampledToken, SampleResult
from pocketllm.step.scheduled_chunk import ScheduledChunk

if TYPE_CHECKING:
    from pocketllm.runner.cpu_decode import CpuDecodeStep

logger = logging.getLogger("pocketllm.runner")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return DTYPES[name]


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero tensor; on CPU from ``calloc`` (numpy's zeros), whose large blocks are pages the kernel zeroes when
    first touched: a 2 GiB cache costs nothing until used, where ``torch.zeros`` writes every byte first (seconds
    on a small CPU)."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = int(np.prod(shape, dtype=np.int64)) * torch.empty(0, dtype=dtype).element_size()
    raw = np.zeros(nbytes + 64, dtype=np.uint8)
    start = -raw.ctypes.data % 64   # rows on cache-line boundaries, as torch's own allocations are
    return torch.from_numpy(raw[start:start + nbytes]).view(dtype).view(shape)


@dataclasses.dataclass
class OneRowSetting:
    """One-row launch settings that ``modules`` (same weight shape, same path) share in ``attribute``, and the
    settings timed for it."""

    attribute: str
    modules: list[torch.nn.Module]
    candidates: list

    def apply(self, config) -> None:
        for module in self.modules:
            setattr(module, self.attribute, config)


def _apply_all(choices: list[tuple[OneRowSetting, object]]) -> None:
    for setting, config in choices:
        setting.apply(config)


class ModelRunner:
    """Turns a list of scheduled chunks into one flat forward pass and samples where a chunk ends.

    A step runs on the first of ``step_backends`` (``step_backend.py``) that handles its chunks: the CPU decode
    step where ``load`` set one up, then the host-batch step, which handles every step (the CUDA step on CUDA
    with Triton, else the PyTorch reference). The attention layers' backend goes with the host-batch step: the
    Triton kernels with the CUDA step, the PyTorch reference otherwise.
    """

    def __init__(self, hf_config, device: torch.device, dtype: torch.dtype, block_size: int,
                 seed: int, kv_dtype: torch.dtype | None = None, mtp: bool = False) -> None:
        """``mtp``: build the checkpoint's MTP head too (speculative ``method="mtp"``, ``mtp_head.py``), whose
        attention is one more layer of the KV cache."""
        self.hf_config = hf_config
        self.device = device
        self.dtype = dtype
        self.kv_dtype = kv_dtype or dtype
        self.block_size = block_size
        cls = model_class(hf_config)
        if mtp and not getattr(cls, "supports_mtp", False):
            names = list(getattr(hf_config, "architectures", None) or [])
            raise UnsupportedFeatureError(f"speculative_config.method 'mtp' runs the MTP head of a Qwen3.5 or "
                                          f"DeepSeek-V4 checkpoint; {names[0] if names else cls.__name__} is not one")
        with torch.device(device):
            default_dtype = torch.get_default_dtype()
            torch.set_default_dtype(dtype)
            try:
                self.model = cls(hf_config)
                if mtp:
                    self.model.add_mtp_head()
            finally:
                torch.set_default_dtype(default_dtype)
        self.model.eval()
        self.sampler = Sampler(seed)
        self.attention_layers = [m for m in self.model.modules() if type(m).__name__ == "Attention"]
        # Hybrid models: layers with per-request recurrent state, held in slots (``allocate_state_pool``).
        self.state_layers = [m for m in self.model.modules() if hasattr(m, "state_specs")]
        self.num_blocks = 0
        # Tensor parallelism: rank 0 broadcasts each step's inputs; the workers run the same forward
        # (distributed/worker.py), on CUDA through the kernel path without decode graphs.
        self.tp_size = tp_size()
        self.step_channel = StepChannel() if self.tp_size > 1 and tp_rank() == 0 else None
        # CUDA with Triton: kernel metadata from one pinned copy per step, decode CUDA graphs (cuda_graphs.py),
        # the attention layers on the Triton backend; else the reference step. A model whose attention is its
        # own (``kernel_step = False``: DeepSeek-V4) runs the reference step on CUDA too.
        self.cuda_step = None
        self.num_state_slots = 0
        self.reference_step = ReferenceStep(self.model, device, block_size, self.step_channel,
                                            bool(self.state_layers))
        self.host_step: HostBatchStep = self.reference_step
        if (device.type == "cuda" and kernels_available(device) and self.attention_layers
                and getattr(self.model, "kernel_step", True)):
            from pocketllm.runner.cuda_graphs import CudaStepRunner

            self.cuda_step = CudaStepRunner(self.model, device, block_size,
                                            max(layer.num_kv_heads for layer in self.attention_layers))
            self.host_step = CudaGraphStep(self.cuda_step, block_size, self.step_channel)
            triton = TritonAttentionBackend()
            for layer in self.attention_layers:
                layer.backend = triton
        elif (device.type == "cuda" and kernels_available(device) and self.tp_size == 1
              and getattr(self.model, "reference_decode_graphs", False)):
            # A model of its own attention whose reference decode step a graph can replay (with the Triton
            # kernels: its experts' PyTorch form reads the host): its decode steps from CUDA graphs
            # (``capture_cuda_graphs`` sets them up).
            self.host_step = ReferenceGraphStep(self.reference_step)
        self.mtp_head = MtpHead(self.model, device, block_size) if mtp else None
        # CPU: the flat decode step (cpu_decode.py) goes first, set up by ``load``.
        self.step_backends: list[StepBackend] = [self.host_step]

    def load(self, weights: Iterable[tuple[str, torch.Tensor]] | None, dummy_seed: int | None = None,
             weight_format: str = "auto", cpu_compile: bool = False, quantization: str | None = None) -> None:
        """Load checkpoint weights, or fill random ones when ``weights`` is None; with ``quantization="fp8"``
        hold the linear layers as float8; on CPU, convert the linear layers to ``weight_format`` and set up the
        decode fast path (compiled with ``cpu_compile``)."""
        if weights is None:
            init_dummy_weights(self.model, dummy_seed or 0)
        else:
            load_weights(self.model, weights)
        if quantization == "fp8":
            from pocketllm.layers.fp8_weights import quantize_model_fp8

            count = quantize_model_fp8(self.model)
            logger.info("fp8 weights: %d linear layers and LM heads as float8 e4m3 with per-row scales", count)
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
        if self.device.type == "cpu":
            from pocketllm.runner.cpu_decode import setup_cpu

            fp8_cache = self.kv_dtype == torch.float8_e4m3fn
            if fp8_cache and cpu_compile:
                raise UnsupportedFeatureError("cpu_compile compiles the CPU decode fast path, which does not read "
                                              "a float8 KV cache; drop cpu_compile or kv_cache_dtype='fp8'")
            # With the MTP head every step runs the reference forward, which keeps every row. The fast path's
            # attention (and its dense K/V rows) read bfloat16/float32 rows only: every step of a float8 cache
            # runs the reference step, whose attention quantises and widens as CUDA does.
            fast_path = self.mtp_head is None and not fp8_cache
            step = setup_cpu(self.model, weight_format, self.block_size, cpu_compile, fast_path)
            if fp8_cache and self.mtp_head is None:
                logger.info("CPU decode fast path off: kv_cache_dtype='fp8' runs the reference attention "
                            "(a path for measuring quality, not speed)")
            self.step_backends = [self.host_step] if step is None else [
                CpuDecodeBackend(step, self.model, self.host_step), self.host_step]
        elif cpu_compile:
            raise InvalidRequestError(f"cpu_compile compiles the CPU decode step; this engine runs on {self.device}",
                                      param="cpu_compile")

    @property
    def graph_verify_steps(self) -> int:
        """Steps of verify chunks replayed from CUDA graphs (since ``reset_graph_verify_steps``)."""
        if self.cuda_step is not None:
            return self.cuda_step.flat_replays
        return self.host_step.verify_replays if isinstance(self.host_step, ReferenceGraphStep) else 0

    def reset_graph_verify_steps(self) -> None:
        if self.cuda_step is not None:
            self.cuda_step.flat_replays = 0
        if isinstance(self.host_step, ReferenceGraphStep):
            self.host_step.verify_replays = 0

    @property
    def uses_kernels(self) -> bool:
        """Whether steps run the Triton kernels (CUDA with Triton, a model with attention layers that takes the
        kernel step)."""
        return self.cuda_step is not None

    @property
    def reads_fp8_kv(self) -> bool:
        """Whether a float8 KV cache runs here: on the Triton kernels (CUDA), or on CPU through the PyTorch
        reference attention of a model that uses the shared attention layers (not DeepSeek-V4's own)."""
        return self.uses_kernels or (self.device.type == "cpu" and bool(self.attention_layers)
                                     and getattr(self.model, "kernel_step", True))

    @property
    def cpu_decode(self) -> CpuDecodeStep | None:
        """The CPU decode step among the step backends (None where there is none)."""
        for backend in self.step_backends:
            if isinstance(backend, CpuDecodeBackend):
                return backend.step
        return None

    @property
    def compiled_cpu_decode(self) -> CpuDecodeStep | None:
        """The CPU decode step when it runs compiled (``cpu_compile``), else None."""
        step = self.cpu_decode
        return step if step is not None and step.compiles else None

    @torch.inference_mode()
    def profile_activation_bytes(self, max_num_batched_tokens: int, max_num_seqs: int) -> int:
        """CUDA: peak memory a full step needs beyond weights and KV cache, measured with one dummy forward of
        ``max_num_batched_tokens`` tokens plus logits for ``max_num_seqs`` rows (and room for the sampler)."""
        tokens = max_num_batched_tokens
        blocks = -(-tokens // self.block_size) + 1
        self.allocate_kv_cache(blocks)
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        base = torch.cuda.memory_allocated(self.device)
        ids = torch.zeros(tokens, dtype=torch.int64, device=self.device)
        positions = torch.arange(tokens, device=self.device)
        table = list(range(blocks - 1))
        if self.cuda_step is not None:
            dev = torch.tensor(list(range(tokens)) + [tokens, 0, tokens] + table, dtype=torch.int32,
                               device=self.device)
            meta = AttentionMetadata(
                slot_mapping=dev[:tokens], block_tables=dev[tokens + 3:].view(1, -1), query_start=[0, tokens],
                context_lens=[tokens], block_size=self.block_size, context_lens_gpu=dev[tokens:tokens + 1],
                query_start_gpu=dev[tokens + 1:tokens + 3], max_query_len=tokens)
        else:
            meta = AttentionMetadata(
                slot_mapping=torch.arange(tokens, device=self.device),
                block_tables=torch.tensor([table], dtype=torch.int64, device=self.device),
                query_start=[0, tokens], context_lens=[tokens], block_size=self.block_size)
        if self.state_layers:
            meta = dataclasses.replace(meta, state_slots=torch.zeros(1, dtype=torch.int64, device=self.device),
                                       state_slots_host=[0])
        hidden = self.model(ids, positions, meta)
        rows = min(max_num_seqs, tokens)
        logits = self.model.compute_logits(hidden[:rows]).float()
        del hidden, logits
        if self.mtp_head is not None:
            self.mtp_head.release_target_hidden()
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - base
        vocab = int(self.hf_config.vocab_size)
        sampler = 4 * max_num_seqs * vocab * 4  # a few [rows, vocab] float32 temporaries
        self.allocate_kv_cache(0)
        torch.cuda.empty_cache()
        return peak + sampler

    def capture_cuda_graphs(self, max_num_seqs: int, max_model_len: int, flat_rows: bool = False) -> None:
        """CUDA: capture the decode graphs (after the KV cache is allocated); a no-op elsewhere, and under
        tensor parallelism (the step's all-reduces run eagerly). ``flat_rows`` (speculative decoding): also those
        that verify chunks and other short chunks replay as decode rows (``CudaStepRunner.capture``)."""
        if self.cuda_step is None:
            if isinstance(self.host_step, ReferenceGraphStep):
                self.host_step.setup(max_num_seqs, max_model_len)
            return
        settings = self.choose_kernels()
        if self.tp_size > 1:
            logger.info("decode CUDA graphs off under tensor parallelism")
            return
        with torch.inference_mode():
            one_row = self.settle_in_step(settings, max_model_len) if settings else {}
            self.cuda_step.capture(max_num_seqs, max_model_len, one_row, flat_rows)

    def choose_kernels(self) -> list[OneRowSetting]:
        """CUDA: time the skinny Triton kernel against cuBLAS on each distinct weight shape (LM head and the
        per-layer projections) and keep the faster for each number of rows; likewise, for projections that
        declare an input prologue (a norm or SiLU·mul before them), the fused kernel against the two launches, and
        for a [gate; up] projection feeding SiLU·mul, the activation computed in the product's kernel (one row).
        Returns the one-row launch settings chosen, with the modules sharing each and its candidates."""
        if self.cuda_step is None:
            return []
        from pocketllm.kernels.gemv import (
            RMS_NORM,
            SILU_MUL,
            SKINNY_WEIGHT_DTYPES,
            OneRowConfig,
            best_one_row_config,
            fused_candidates,
            fused_rows_for,
            one_row_candidates,
            silu_epilogue_candidates,
            silu_epilogue_choice,
            skinny_rows_for,
        )

        prologues = {"rms_norm": RMS_NORM, "silu_mul": SILU_MUL}
        chosen: dict[tuple[int, ...], tuple[OneRowConfig, int]] = {}
        fused: dict[tuple[str | int, ...], tuple[OneRowConfig, int]] = {}
        epilogues: dict[tuple[str | int, ...], tuple[OneRowConfig | None, bool]] = {}
        settings: dict[tuple, OneRowSetting] = {}
        for name, module in self.model.named_modules():
            weight = getattr(module, "weight", None)
            if not hasattr(module, "skinny_rows") or weight is None or weight.dim() != 2:
                continue
            # float8 weights (``quantization="fp8"``) are timed with their per-row scales, apart from others
            scale = getattr(module, "weight_scale", None)
            shape = (*weight.shape, *(() if scale is None else ("fp8",)))
            if shape not in chosen and weight.dtype in SKINNY_WEIGHT_DTYPES and weight.stride(1) == 1:
                config = best_one_row_config(weight, scale=scale)
                chosen[shape] = config, skinny_rows_for(weight, config, scale)
                logger.info("%s %s: Triton skinny kernel up to %d rows (one row: %s), cuBLAS beyond", name,
                            list(shape), chosen[shape][1], config)
            module.one_row, module.skinny_rows = chosen.get(shape, (None, 0))
            prologue = getattr(module, "prologue", None)
            if prologue is not None and module.one_row is not None:
                key = (prologue, *shape)
                if key not in fused:
                    candidates = fused_candidates(shape[1], module.one_row, scale is not None)
                    config = best_one_row_config(weight, prologues[prologue], candidates, scale)
                    fused[key] = config, fused_rows_for(weight, prologues[prologue], module.skinny_rows,
                                                        module.one_row, config, scale)
                    logger.info("%s %s: %s fused into the product up to %d rows (one row: %s)", name,
                                list(shape), prologue, fused[key][1], config)
                module.fused_one_row, module.fused_rows = fused[key]
            if getattr(module, "epilogue", None) == "silu_mul" and module.one_row is not None and module.bias is None:
                key = ("silu_epilogue", prologue or "", *shape)
                if key not in epilogues:
                    epilogues[key] = silu_epilogue_choice(weight, prologue == "rms_norm", module.one_row,
                                                          module.skinny_rows, module.fused_one_row, module.fused_rows,
                                                          scale)
                    logger.info("%s %s: SiLU·mul in the product's kernel for one row: %s (norm in it too: %s)",
                                name, list(shape), *epilogues[key])
                module.silu_epilogue, module.silu_epilogue_norm = epilogues[key]
            # The one-row settings the module's path at one row runs with: the product with the SiLU·mul epilogue
            # where chosen, else with its norm prologue fused where chosen, else the plain product (a SiLU·mul
            # prologue is fused or not as the [gate; up] product before it decides: both).
            k, float8 = shape[1], scale is not None
            if getattr(module, "silu_epilogue", None) is not None:
                used = [("silu_epilogue", silu_epilogue_candidates(k, float8))]
            elif prologue == "rms_norm" and module.fused_rows >= 1:
                used = [("fused_one_row", fused_candidates(k, module.one_row, float8))]
            else:
                used = [("one_row", one_row_candidates(k, float8))] if module.skinny_rows >= 1 else []
                if prologue is not None and module.fused_rows >= 1:
                    used.append(("fused_one_row", fused_candidates(k, module.one_row, float8)))
            for attribute, candidates in used:
                settings.setdefault((attribute, prologue or "", shape),
                                    OneRowSetting(attribute, [], candidates)).modules.append(module)
        return list(settings.values())

    def settle_in_step(self, settings: list[OneRowSetting], max_model_len: int) -> dict[int, Callable[[], None]]:
        """CUDA: for each split count a one-row decode graph is captured with, time the one-row settings'
        candidates again in whole one-row decode steps (greedy sampling included, pipelined as the engine runs
        them) at a context that split count serves, and keep the fastest; returns, per split count, what sets
        them. In a step a product launches as a dependent of the kernel before it and reads its first weight
        tile while that kernel runs, which a product timed alone does not show, and how much that hides depends
        on the attention before it, so on the context: on Qwen3-0.6B (H200) one O-projection setting gave
        643-650 µs steps at contexts 130-192 and 671 µs at 256, another 664-667 µs at all of them. Settings are
        changed one at a time, each kept only when the step is at least 0.2% faster."""
        started = time.perf_counter()
        greedy = [SamplingRow(SamplingParams(max_tokens=1, temperature=0.0), [], [])]
        contexts = self.cuda_step.one_row_contexts(min(max_model_len, self.num_blocks * self.block_size))
        chosen: dict[int, list[tuple[OneRowSetting, object]]] = {}
        for splits, context in contexts.items():
            def step_time(context: int = context) -> float:
                return self.cuda_step.time_one_row_step(
                    context, lambda logits: self.sampler.sample_async(logits, greedy).start_copy())

            best_time = step_time()
            for setting in settings:
                best = getattr(setting.modules[0], setting.attribute)
                for candidate in setting.candidates:
                    if candidate != best:
                        setting.apply(candidate)
                        t = step_time()
                        if t < 0.998 * best_time:
                            best, best_time = candidate, t
                setting.apply(best)
            chosen[splits] = [(setting, getattr(setting.modules[0], setting.attribute)) for setting in settings]
            described = "; ".join(f"{setting.attribute} {list(setting.modules[0].weight.shape)} {tuple(config)}"
                                  for setting, config in chosen[splits])
            logger.info("one-row settings timed in the step, %d splits (context %d, %.1f µs a step): %s", splits,
                        context, best_time * 1000, described)
        logger.info("one-row settings timed in the step in %.1f s", time.perf_counter() - started)
        return {splits: functools.partial(_apply_all, choices) for splits, choices in chosen.items()}

    @property
    def kv_window(self) -> int | None:
        """The window behind which the block manager may release a running request's KV blocks, as the model
        declares it (``kv_window``: every layer that uses the cache slides and the cache holds nothing else);
        None, and every block kept, for a model that declares none or has a full-attention layer."""
        window = getattr(self.model, "kv_window", None)
        if window is not None and any(layer.sliding_window is None or layer.sliding_window > window
                                      for layer in self.attention_layers):
            raise ValueError(f"the model declares kv_window {window}, but a cache layer attends further back")
        return window

    def kv_bytes_per_block(self) -> int:
        element = torch.tensor([], dtype=self.kv_dtype).element_size()
        per_layer = sum(2 * a.num_kv_heads * a.head_dim for a in self.attention_layers)
        return per_layer * self.block_size * element

    def state_bytes_per_slot(self) -> int:
        """Recurrent state (all state layers) of one request."""
        return sum(math.prod(shape) * torch.tensor([], dtype=dtype).element_size()
                   for layer in self.state_layers for shape, dtype in layer.state_specs(self.dtype).values())

    def allocate_state_pool(self, num_slots: int, num_bound: int | None = None) -> None:
        """Bind ``[num_bound, *shape]`` zeroed tensors (default ``num_slots + 1``) to every state layer (hybrid
        models): the request slots, then one slot of scratch for the padding rows of CUDA-graph replays, then
        any checkpoint slots (``StatePool``)."""
        self.num_state_slots = num_slots
        for layer in self.state_layers:
            for name, (shape, dtype) in layer.state_specs(self.dtype).items():
                setattr(layer, name, torch.zeros((num_bound or num_slots + 1, *shape), dtype=dtype,
                                                 device=self.device))
        if self.cuda_step is not None:
            self.cuda_step.state_padding_slot = num_slots
        if isinstance(self.host_step, ReferenceGraphStep):
            self.host_step.scratch_slot = num_slots

    def restore_state(self, slot: int, checkpoint: int) -> None:
        """Roll every state layer's ``slot`` back to the state held in slot ``checkpoint`` (a verify chunk's
        checkpoint of its last accepted position)."""
        for layer in self.state_layers:
            for name in layer.state_specs(self.dtype):
                state = getattr(layer, name)
                state[slot].copy_(state[checkpoint])

    def allocate_kv_cache(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        for attn in self.attention_layers:
            shape = (num_blocks, self.block_size, attn.num_kv_heads, attn.head_dim)
            attn.k_cache = _zeros(shape, self.kv_dtype, self.device)
            attn.v_cache = _zeros(shape, self.kv_dtype, self.device)

    def forward_reference(self, host: HostBatch, previous_tokens: torch.Tensor | None = None
                          ) -> torch.Tensor | None:
        """The PyTorch reference forward of a host batch: hidden states of its sampling rows (None if none).
        Runs where the attention layers are on the reference backend (not on the CUDA kernel path)."""
        return self.reference_step.sampled_hidden(host, previous_tokens)

    def run_host_batch(self, host: HostBatch) -> torch.Tensor | None:
        """A tensor-parallel worker's step: the host batch rank 0 sent, through the host-batch step (the logits
        of its sampling rows)."""
        return self.host_step.run(host)

    @torch.inference_mode()
    def execute(self, chunks: list[ScheduledChunk]) -> list[SampledToken]:
        """Run the chunks; return one sampled token per chunk that reached the end of its sequence."""
        result = self.sample_async(chunks, self.launch(chunks))
        return result.to_host() if result is not None else []

    @torch.inference_mode()
    def launch(self, chunks: list[ScheduledChunk], previous_tokens: torch.Tensor | None = None
               ) -> torch.Tensor | None:
        """Queue the forward pass; the logits of the sampling rows in the model's dtype (None if no chunk
        samples). A chunk whose last input is still pending takes it from ``previous_tokens`` (the previous
        step's sampled tokens, on the device). On CUDA nothing here waits for the device."""
        for backend in self.step_backends:
            if backend.handles(chunks):
                return backend.launch(chunks, previous_tokens)
        raise RuntimeError("no step backend handles this step")   # the host-batch step handles every step

    @torch.inference_mode()
    def sample_async(self, chunks: list[ScheduledChunk], logits: torch.Tensor | None) -> SampleResult | None:
        """Queue the sampling of one token per sampling chunk from the logits ``launch`` returned."""
        if logits is None:
            return None
        rows = [SamplingRow(c.request.params, c.request.prompt_token_ids, c.request.output_token_ids,
                            c.request.generator, c.request.grammar) for c in chunks if c.samples]
        return self.sampler.sample_async(logits, rows).start_copy()

    @torch.inference_mode()
    def verify(self, chunks: list[ScheduledChunk], logits: torch.Tensor | None,
               forced: bool = False) -> list[list[SampledToken]]:
        """A step with verify chunks (speculative decoding): the tokens each sampling chunk emits, by the
        acceptance rule of ``spec_verify.py`` (waits for the step); ``forced``: every proposal kept (benchmarks)."""
        return [] if logits is None else verify(self.sampler, logits, chunks, forced)
