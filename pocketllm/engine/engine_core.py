"""The engine core: scheduler + model runner, stepping token ids (no text, no threads)."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch

from pocketllm.config import EngineArgs
from pocketllm.distributed import min_over_ranks
from pocketllm.engine.block_manager import BlockManager
from pocketllm.engine.draft_proposer import DraftModel, DraftProposer
from pocketllm.engine.mtp_proposer import MtpProposer
from pocketllm.engine.ngram_proposer import NgramProposer
from pocketllm.engine.proposer import Proposer
from pocketllm.engine.request import FinishReason, Request, RequestStatus
from pocketllm.engine.scheduler import Scheduler, SchedulerLimits
from pocketllm.engine.state_pool import StatePool
from pocketllm.errors import InvalidRequestError, UnsupportedFeatureError
from pocketllm.runner.model_runner import ModelRunner, resolve_device, resolve_dtype
from pocketllm.sampling_params import SamplingParams
from pocketllm.step.sampled import SampledToken, SampleResult
from pocketllm.step.scheduled_chunk import ScheduledChunk

if TYPE_CHECKING:
    from pocketllm.runner.cpu_decode import CpuDecodeStep

logger = logging.getLogger("pocketllm.engine")

GiB = 1 << 30

# GGUF weight types whose blocks the int4 layers hold exactly (GGUF's Q4_1 block is their block: quantising the
# dequantised weights gives back the file's codes, scales and minimums), so that ``cpu_weight_format="auto"``
# multiplies the file's own 4-bit weights, by 8-bit activations (docs/cpu-quality.md measures the cost).
INT4_EXACT_WEIGHT_TYPES = frozenset({"Q4_1"})


@dataclass(frozen=True)
class CpuWeightFormat:
    """``cpu_weight_format`` as the engine runs it, resolved once: ``name`` is "float32", "bfloat16", "int4" or
    "int8" on CPU ("auto" only for weights left in another compute dtype, and off CPU, where it means nothing);
    ``reason`` says why."""

    name: str
    reason: str


def resolve_cpu_weight_format(args: EngineArgs, device: torch.device, dtype: torch.dtype,
                              weight_type: str | None) -> CpuWeightFormat:
    """The format ``args.cpu_weight_format`` means here. "auto": int4 for a GGUF whose layers are Q4_1 blocks
    on one CPU rank where PocketLLM's 4-bit x 8-bit kernels run (AVX-512 VNNI, built); otherwise the weights
    as loaded in the compute dtype (float32 on CPU by default)."""
    if args.cpu_weight_format != "auto":
        return CpuWeightFormat(args.cpu_weight_format, "asked for")
    dense = str(dtype).removeprefix("torch.")
    if device.type != "cpu":
        return CpuWeightFormat("auto", f"{device.type}: weights in {dense}")
    # The weights as loaded: "float32" when that is the compute dtype, else "auto" (setup_cpu leaves both alone).
    as_loaded = "float32" if dtype == torch.float32 else "auto"
    if args.quantization is not None:
        return CpuWeightFormat(as_loaded, f"quantization={args.quantization}: linear layers quantised at load, "
                                          f"the rest as loaded ({dense})")
    if weight_type not in INT4_EXACT_WEIGHT_TYPES:
        kind = "float weights" if weight_type is None else f"{weight_type} weights"
        return CpuWeightFormat(as_loaded, f"{kind}: as loaded ({dense})")
    if args.tensor_parallel_size > 1:
        return CpuWeightFormat(as_loaded, f"{weight_type} weights over {args.tensor_parallel_size} ranks (int4 runs "
                                          f"on one): as loaded ({dense})")
    from pocketllm.kernels import cpu_native

    if not cpu_native.available():
        return CpuWeightFormat(as_loaded, f"{weight_type} weights, but PocketLLM's 4-bit CPU kernels do not run "
                                          f"here (no AVX-512 VNNI or no compiler): as loaded ({dense})")
    return CpuWeightFormat("int4", f"{weight_type} weights kept as 4-bit blocks (AVX-512 VNNI kernels)")


def _kv_dtype(args: EngineArgs, device: torch.device, weight_format: str) -> torch.dtype | None:
    """The KV cache's dtype (None: the compute dtype). On CPU, bfloat16/int4/int8 weights keep a bfloat16 cache:
    their decode steps read it in place (half the bytes of float32) and already round activations."""
    if args.kv_cache_dtype == "fp8":
        return torch.float8_e4m3fn
    if args.kv_cache_dtype == "bfloat16" or (
            device.type == "cpu" and args.kv_cache_dtype == "auto"
            and weight_format in ("bfloat16", "int4", "int8")):
        return torch.bfloat16
    return None


def _check_mtp(args: EngineArgs, kv_dtype: torch.dtype | None) -> None:
    """Refuse what speculative ``method="mtp"`` does not run with (the checkpoint is checked as it loads)."""
    if args.tensor_parallel_size > 1:
        raise UnsupportedFeatureError("speculative_config.method 'mtp' runs on one rank; use "
                                      "tensor_parallel_size=1 or method 'ngram'")
    if kv_dtype == torch.float8_e4m3fn:
        raise UnsupportedFeatureError("speculative_config.method 'mtp' keeps the MTP head's keys and values in the "
                                      "compute dtype; use kv_cache_dtype='auto'")


@dataclass(frozen=True)
class PendingStep:
    """A launched step: its chunks and the tokens it is sampling on the device (None if nothing samples)."""

    chunks: list
    sampled: SampleResult | None
    # A step with verify chunks (speculative decoding): each sampling chunk's tokens, read back already.
    verified: list[list[SampledToken]] | None = None
    # A step with verify chunks whose acceptance runs in ``complete`` (after the step before it is read back,
    # so that every request's history is on the host): the logits of its sampling rows.
    verify_logits: torch.Tensor | None = None


@dataclass(frozen=True)
class StepOutput:
    """One request's result of a step: the token it sampled (None when it ended without one). A verify chunk
    gives several, in order; ``last``: no later output of this request follows in the step; ``num_outputs``: the
    request's output tokens up to this one (None: all of them)."""

    request: Request
    token: SampledToken | None
    last: bool = True
    num_outputs: int | None = None


def _one_token_rows_longest_first(chunk: ScheduledChunk) -> int:
    """Sort key: one-token rows (decode rows, and a prompt's one-token chunk) first, longest context first;
    longer prompt chunks after them in scheduled order."""
    return -chunk.end if chunk.num_tokens == 1 else 1


class EngineCore:
    """Owns the model runner, the KV blocks and the scheduler; ``step()`` advances every running request."""

    def __init__(self, args: EngineArgs, hf_config, weights, eos_token_ids: frozenset[int],
                 weight_type: str | None = None, draft: DraftModel | None = None) -> None:
        """``weight_type``: the checkpoint's storage type of its layers' matrices (``Checkpoint.weight_type``),
        which ``cpu_weight_format="auto"`` goes by. ``draft``: the draft checkpoint of speculative
        ``method="draft_model"`` (loaded and checked against the target's tokenizer by the backend)."""
        self.args = args
        self.device = resolve_device(args.device)
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise UnsupportedFeatureError("device 'cuda' was asked for but no CUDA device is available")
        self.dtype = resolve_dtype(args.dtype, self.device)
        self.eos_token_ids = eos_token_ids
        self.cpu_weight_format = resolve_cpu_weight_format(args, self.device, self.dtype, weight_type)
        if self.device.type == "cpu":
            logger.info("CPU weight format: %s (%s)", self.cpu_weight_format.name, self.cpu_weight_format.reason)
        kv_dtype = _kv_dtype(args, self.device, self.cpu_weight_format.name)
        mtp = args.speculative_config is not None and args.speculative_config.method == "mtp"
        if mtp:
            _check_mtp(args, kv_dtype)
        self.runner = ModelRunner(hf_config, self.device, self.dtype, args.block_size, args.seed, kv_dtype, mtp)
        if kv_dtype == torch.float8_e4m3fn and not self.runner.reads_fp8_kv:
            raise UnsupportedFeatureError("kv_cache_dtype='fp8' needs the CUDA kernel path (a CUDA device and "
                                          "Triton) or, on CPU, the reference attention of a model built on the "
                                          f"shared attention layers ({type(self.runner.model).__name__} is not); "
                                          "use kv_cache_dtype='auto'")
        self.runner.load(weights, dummy_seed=args.seed, weight_format=self.cpu_weight_format.name,
                         cpu_compile=args.cpu_compile, quantization=args.quantization)
        self.speculative = args.speculative_config
        self.draft_runner = self._draft_runner(draft, hf_config)
        # Hybrid models (recurrent-state layers): one state slot per request that may run, allocated before
        # the KV cache is sized from what memory is left; with speculative decoding, each with a checkpoint slot
        # per proposal a verify chunk may hold (its state rolls back to the last accepted one).
        spec = args.speculative_config
        checkpoints = spec.num_speculative_tokens if spec is not None else 0
        self.state_pool = StatePool(args.max_num_seqs, checkpoints) if self.runner.state_layers else None
        if self.state_pool is not None:
            if checkpoints and self.runner.tp_size > 1:
                raise UnsupportedFeatureError("speculative decoding of a model with recurrent state runs on one "
                                              "rank; drop speculative_config or tensor_parallel_size")
            self.runner.allocate_state_pool(args.max_num_seqs, self.state_pool.num_bound_slots)
            logger.info("recurrent state: %d slots of %.1f MiB (and %d checkpoint slots)", args.max_num_seqs,
                        self.runner.state_bytes_per_slot() / (1 << 20), args.max_num_seqs * checkpoints)
        # Every tensor-parallel rank sizes its cache alike (the smallest of their budgets).
        num_blocks = min_over_ranks(args.num_kv_blocks or self._blocks_from_memory(), self.device)
        capacity = num_blocks * args.block_size
        context = int(getattr(hf_config, "max_position_embeddings", capacity))
        if self.draft_runner is not None:   # (the draft's positions run as far as the target's)
            context = min(context, int(getattr(self.draft_runner.hf_config, "max_position_embeddings", context)))
        max_model_len = args.max_model_len or min(context, capacity)
        if max_model_len > capacity:
            raise InvalidRequestError(
                f"max_model_len {max_model_len} needs more KV cache than the {capacity} tokens available; "
                "lower max_model_len or give the cache more memory", param="max_model_len")
        if max_model_len > context:
            logger.warning("max_model_len %d exceeds the checkpoint's context %d", max_model_len, context)
        self.max_model_len = max_model_len
        self.runner.allocate_kv_cache(num_blocks)
        if self.draft_runner is not None:
            self.draft_runner.allocate_kv_cache(num_blocks)
        if not args.enforce_eager:
            # Speculating: verify chunks (and the draft's catch-up chunks) replay graphs as decode rows too.
            flat_rows = spec is not None
            self.runner.capture_cuda_graphs(args.max_num_seqs, max_model_len, flat_rows)
            if self.draft_runner is not None:
                self.draft_runner.capture_cuda_graphs(args.max_num_seqs, max_model_len, flat_rows)
        # A cached KV prefix would skip the recurrent state of that prefix: prefix caching is off for hybrids.
        # With the MTP head too: a cached prefix would lack the head's keys and values (its layer of the cache
        # holds them only where the head ran with the target's hidden states).
        prefix_caching = args.enable_prefix_caching and self.state_pool is None and not mtp
        if args.enable_prefix_caching and not prefix_caching:
            logger.info("prefix caching is off: this model keeps recurrent state that a cached prefix lacks"
                        if self.state_pool is not None else "prefix caching is off with the MTP head")
        # Every layer that uses the cache slides: blocks older than the longest window are released as requests
        # run past them.
        window = self.runner.kv_window
        if self.draft_runner is not None:
            # The draft reads the same blocks: one is released only when neither model's window reaches it.
            draft_window = self.draft_runner.kv_window
            window = None if window is None or draft_window is None else max(window, draft_window)
        if window is not None:
            logger.info("KV blocks wholly outside the %d-token sliding window are released as requests run",
                        window)
        self._num_blocks, self._prefix_caching, self._window = num_blocks, prefix_caching, window
        self.vocab_size = int(hf_config.vocab_size)
        # Set by the backend when it can constrain outputs (runner.grammar.GrammarCompiler).
        self.grammar_compiler = None
        self._fresh_state()
        # CUDA: the engine loop schedules and launches step N+1 before reading step N's tokens back.
        # (Not under tensor parallelism: rank 0 broadcasts each step's finished inputs.)
        if args.async_scheduling == "on" and self.runner.tp_size > 1:
            raise UnsupportedFeatureError("async_scheduling='on' is not available with tensor parallelism "
                                          "(rank 0 sends each step's inputs once they are known); use 'auto'")
        proposer = self.scheduler.proposer
        if args.async_scheduling == "on" and proposer is not None and not proposer.pipelines:
            raise UnsupportedFeatureError("async_scheduling='on' is not available with a draft model or an MTP "
                                          "head (each step's tokens feed the drafter's next forward); use 'auto'")
        # With prompt lookup, a step is scheduled while a plain step runs; a verify step is read back first.
        self.pipelined = self.runner.tp_size == 1 and (proposer is None or proposer.pipelines) and (
            args.async_scheduling == "on" or (args.async_scheduling == "auto" and self.device.type == "cuda"))
        self.in_flight: PendingStep | None = None
        # CUDA: a step's decode rows run longest context first. The decode kernel's programs start in row
        # order, so the longest sequences no longer start last and hold the step's tail (with up to 2,048
        # programs of very different lengths). From step to step the order stays the same while the batch does
        # (every context grows by one), so pending tokens still take the plain copy. CPU keeps the scheduler's
        # order, which its dense K/V rows follow.
        self.longest_first = self.device.type == "cuda"
        logger.info("KV cache: %d blocks of %d tokens (%.2f GiB), max_model_len %d",
                    num_blocks, args.block_size, num_blocks * self._kv_bytes_per_block() / GiB,
                    max_model_len)
        compiled_step = self.runner.compiled_cpu_decode if args.cpu_compile else None
        if compiled_step is not None:
            self._compile_cpu_decode(compiled_step)
        if self.device.type == "cuda" and self.runner.tp_size == 1:
            self.warm_up()

    def _fresh_state(self) -> None:
        """The KV blocks, the scheduler (and its proposer), the request table and the counters, as new."""
        args = self.args
        self.blocks = BlockManager(self._num_blocks, args.block_size, self._prefix_caching, self._window)
        if self.state_pool is not None:
            self.state_pool = StatePool(self.state_pool.num_slots, self.state_pool.checkpoints)
        limits = SchedulerLimits(args.max_num_seqs, args.max_num_batched_tokens, self.max_model_len)
        chunk = args.max_num_batched_tokens if args.enable_chunked_prefill else 0
        self.scheduler = Scheduler(limits, self.blocks, chunk, self.state_pool, self._proposer())
        self.requests: dict[str, Request] = {}
        self.num_steps = 0
        # Speculative decoding: verify chunks run, tokens proposed, proposals accepted; verify chunks scheduled
        # while the step before ran (their first token pending).
        self.num_verify_chunks = self.num_proposed_tokens = self.num_accepted_tokens = 0
        self.num_pipelined_verify_chunks = 0
        self.runner.reset_graph_verify_steps()

    def warm_up(self) -> None:
        """Run a few short requests through the engine, then start again from a fresh state: the shapes of a
        first busy minute (prefill chunks longer and shorter than 16 tokens, a step mixing decode rows with new
        prompts, greedy, temperature-only and top-p/top-k sampling with log-probabilities) compile their Triton
        kernels here, at start-up, instead of stalling the first users' requests (on CUDA, on one rank, the engine
        does this when it is built). Sampling requests are seeded: the engine's shared generator is untouched."""
        started = time.perf_counter()
        room = max(1, min(64, self.max_model_len - 8))
        vocab = self.vocab_size
        greedy = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
        plain = SamplingParams(max_tokens=4, temperature=0.6, seed=1, ignore_eos=True)
        truncated = SamplingParams(max_tokens=4, temperature=0.8, top_p=0.9, top_k=20, seed=2, logprobs=1,
                                   ignore_eos=True)

        def prompt(length: int, salt: int) -> list[int]:
            return [(7919 * (i + 1) + salt) % vocab for i in range(max(1, min(length, room)))]

        waves = [[(prompt(40, 1), plain), (prompt(9, 2), greedy)], [(prompt(33, 3), truncated), (prompt(5, 4), plain)]]
        try:
            for number, wave in enumerate(waves):
                for index, (tokens, params) in enumerate(wave):
                    self.add_request(f"warm-up-{number}-{index}", tokens, params)
                self.step()   # the first wave's prefill; then decode rows beside the second wave's prompts
            while self.has_work():
                self.step()
        finally:
            self.in_flight = None
            self._fresh_state()
        logger.info("warmed up in %.1f s", time.perf_counter() - started)

    def _draft_runner(self, draft: DraftModel | None, hf_config) -> ModelRunner | None:
        """The draft model's runner for ``method="draft_model"`` (None for other methods): on the target's device,
        dtype and block size, its CPU weights as ``cpu_weight_format="auto"`` would have them (int4 for a Q4_1
        GGUF, whatever the target's format), its KV cache allocated with the target's."""
        spec = self.speculative
        if spec is None or spec.method != "draft_model":
            return None
        if draft is None:
            raise UnsupportedFeatureError("speculative_config.method 'draft_model' needs the draft checkpoint, "
                                          "which the torch backend loads; build the engine through LLM/AsyncLLM")
        if self.runner.tp_size > 1:
            raise UnsupportedFeatureError("speculative_config.method 'draft_model' runs on one rank; use "
                                          "tensor_parallel_size=1 or method 'ngram'")
        draft_vocab, vocab = int(draft.hf_config.vocab_size), int(hf_config.vocab_size)
        if draft_vocab != vocab:
            raise InvalidRequestError(f"speculative_config.model has a vocabulary of {draft_vocab} tokens and the "
                                      f"target {vocab}: a draft model needs the target's tokenizer",
                                      param="speculative_config")
        args = self.args
        weight_format = resolve_cpu_weight_format(args.replace(cpu_weight_format="auto"), self.device, self.dtype,
                                                  draft.weight_type)
        runner = ModelRunner(draft.hf_config, self.device, self.dtype, args.block_size, args.seed,
                             _kv_dtype(args, self.device, weight_format.name))
        if runner.kv_dtype == torch.float8_e4m3fn and not runner.reads_fp8_kv:
            raise UnsupportedFeatureError(f"kv_cache_dtype='fp8': the draft model ({type(runner.model).__name__}) "
                                          "cannot keep a float8 KV cache here; use kv_cache_dtype='auto'")
        if runner.state_layers:
            raise UnsupportedFeatureError("speculative_config.model keeps recurrent state, which a rejected "
                                          "proposal would need rolled back; choose a draft without it")
        runner.load(draft.weights, dummy_seed=args.seed, weight_format=weight_format.name)
        if self.device.type == "cpu":
            logger.info("draft model's CPU weight format: %s (%s)", weight_format.name, weight_format.reason)
        return runner

    def _proposer(self) -> Proposer | None:
        """The proposer of ``speculative_config`` (None without one); methods not built yet are refused."""
        spec = self.speculative
        if spec is None:
            return None
        if spec.method not in ("ngram", "draft_model", "mtp"):
            raise UnsupportedFeatureError(f"speculative_config.method {spec.method!r} is not available yet; "
                                          "use 'ngram', 'draft_model' or 'mtp'")
        if spec.method == "mtp":
            return MtpProposer(self.runner, spec.num_speculative_tokens)
        if self.draft_runner is not None:
            return DraftProposer(self.draft_runner, spec.num_speculative_tokens)
        return NgramProposer(spec.prompt_lookup_min, spec.prompt_lookup_max, spec.num_speculative_tokens)

    def _compile_cpu_decode(self, step: CpuDecodeStep) -> None:
        """``cpu_compile``: run throwaway requests now, so that every kind of compiled decode step compiles at
        start-up, not during the first requests. The first request outlives the others, which hold one block
        each: it decodes with them over the dense rows, then alone over its first block (a cache span), then
        alone over a first and a third block (one dense row). Later batches of another kind run eagerly."""
        started = time.perf_counter()
        several = min(self.args.max_num_seqs, step.compiled_max_rows)
        prompt, short = [1] * 4, SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
        self.add_request("compile-0", prompt, replace(short, max_tokens=self.args.block_size + 2))
        for i in range(1, several):
            self.add_request(f"compile-{i}", prompt, short)
        while self.has_work():
            self.step()
        step.compiled_all()
        self.blocks.reset_prefix_cache()
        self.num_steps = 0
        logger.info("compiled the CPU decode step in %.1f s", time.perf_counter() - started)

    def _runners(self) -> list[ModelRunner]:
        """The target's model runner, then the draft model's where there is one."""
        return [self.runner] + ([self.draft_runner] if self.draft_runner is not None else [])

    def _kv_bytes_per_block(self) -> int:
        """Bytes of a KV block of every runner's cache (the draft's cache has a block for each of the target's)."""
        return sum(runner.kv_bytes_per_block() for runner in self._runners())

    def _blocks_from_memory(self) -> int:
        """KV blocks that fit the memory budget (a block of the draft model's cache counted with each)."""
        runners = self._runners()
        per_block = self._kv_bytes_per_block()
        if self.device.type == "cuda":
            # What a full step needs beside weights and cache, measured with a dummy forward pass (of each model).
            reserve = sum(runner.profile_activation_bytes(self.args.max_num_batched_tokens, self.args.max_num_seqs)
                          for runner in runners)
            free, total = torch.cuda.mem_get_info(self.device)
            budget = free - total * (1.0 - self.args.gpu_memory_utilization) - reserve
        else:
            budget = self.args.cpu_kv_cache_gb * GiB
        return max(1, int(budget // per_block))

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> Request:
        """Validate and queue a request."""
        if request_id in self.requests:
            raise InvalidRequestError(f"request id {request_id!r} is already active", param="request_id")
        if not prompt_token_ids:
            raise InvalidRequestError("the prompt is empty", param="prompt")
        if len(prompt_token_ids) >= self.max_model_len:
            raise InvalidRequestError(
                f"the prompt has {len(prompt_token_ids)} tokens; this engine's context is {self.max_model_len} "
                "tokens and needs room for at least one generated token", param="prompt")
        bad = [t for t in prompt_token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidRequestError(f"prompt token id {bad[0]} is outside the vocabulary (0..{self.vocab_size - 1})",
                                      param="prompt")
        generator = None
        if params.seed is not None and not params.greedy:
            generator = torch.Generator(device=self.device).manual_seed(params.seed)
        grammar = None
        if params.structured_output is not None:
            if self.grammar_compiler is None:
                raise UnsupportedFeatureError("this engine has no structured outputs (xgrammar and a tokenizer "
                                              "are needed); drop the structured output")
            grammar = self.grammar_compiler.matcher(params.structured_output, params.stop_token_ids)
        request = Request(request_id, list(prompt_token_ids), params, self.eos_token_ids, generator, grammar)
        self.requests[request_id] = request
        self.scheduler.add(request)
        return request

    def abort(self, request_id: str) -> Request | None:
        """Cancel an active request at this step boundary; its blocks are freed at once."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        self.scheduler.finish(request, FinishReason.CANCELLED)
        return request

    def finish(self, request: Request, reason: FinishReason) -> None:
        """End a request the front end decided is complete (e.g. a stop string matched)."""
        if self.requests.pop(request.request_id, None) is not None:
            self.scheduler.finish(request, reason)

    def stats(self) -> dict[str, float | int]:
        """A snapshot of the engine's load and cache counters (read from any thread; values are plain ints)."""
        blocks = self.blocks
        return {
            "num_requests_running": len(self.scheduler.running),
            "num_requests_waiting": len(self.scheduler.waiting),
            "kv_cache_usage": blocks.usage(),
            "kv_cache_free_blocks": blocks.num_free_blocks,
            "kv_cache_total_blocks": blocks.num_blocks,
            "prefix_cache_queries": blocks.prefix_queries,
            "prefix_cache_hits": blocks.prefix_hits,
            "num_preemptions": self.scheduler.num_preemptions,
            "num_steps": self.num_steps,
            "spec_verify_chunks": self.num_verify_chunks,
            "spec_proposed_tokens": self.num_proposed_tokens,
            "spec_accepted_tokens": self.num_accepted_tokens,
            "spec_pipelined_verify_chunks": self.num_pipelined_verify_chunks,
            # CUDA: steps of verify chunks the target replayed from graphs (``HostBatch.flattened``; DeepSeek-V4: grids)
            "spec_graph_steps": self.runner.graph_verify_steps,
        }

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def _check_finished(self, request: Request, token: int) -> FinishReason | None:
        params = request.params
        if token in params.stop_token_ids or (not params.ignore_eos and token in request.eos_token_ids):
            request.stop_reason = token
            return FinishReason.STOP
        if request.reaches_length_limit(self.max_model_len):
            return FinishReason.LENGTH
        return None

    def step(self) -> list[StepOutput]:
        pending = self.launch()
        return [] if pending is None else self.complete(pending)

    def _cache_and_release(self, request: Request, end: int) -> None:
        """After a step that computed the request's tokens up to ``end``: register its full blocks in the prefix
        cache, then release the blocks no layer's window reaches from ``end`` on. Later steps of the request query
        from ``end`` on; one launched already holds its block table and reads the released blocks, unchanged,
        before any later step can write them. A request preempted and readmitted while this step ran may stand
        below ``end``: nothing is released for it then."""
        self.blocks.cache_full_blocks(request)
        if request.num_computed_tokens >= end:
            self.blocks.release_outside_window(request, end)

    def needs_sync(self) -> bool:
        """Whether the step in flight must be read back before the next one is scheduled: some request with
        a pending token samples from host-side history (a grammar, or penalties over its output tokens), or the
        step verifies proposals (how many it keeps decides where the request's next chunk starts)."""
        if self.in_flight is None:
            return False
        if self.in_flight.verify_logits is not None or self.in_flight.verified is not None:
            return True
        if self.in_flight.sampled is None:
            return False
        return any(c.samples and (c.request.grammar is not None or c.request.params.needs_penalties)
                   for c in self.in_flight.chunks)

    def launch(self) -> PendingStep | None:
        """Schedule a step and queue its forward pass and sampling (asynchronous on CUDA); None when nothing
        runs. At most one launched step is left uncompleted; its pending tokens feed this one on the device."""
        chunks = self.scheduler.schedule()
        if not chunks:
            return None
        proposer = self.scheduler.proposer
        if proposer is not None:
            chunks = proposer.fill(chunks)
        if self.longest_first:
            chunks.sort(key=_one_token_rows_longest_first)
        previous = self.in_flight.sampled if self.in_flight is not None else None
        logits = self.runner.launch(chunks, previous.tokens if previous is not None else None)
        verified = verify_logits = sampled = None
        if not any(chunk.draft for chunk in chunks):
            sampled = self.runner.sample_async(chunks, logits)
        else:
            self.num_pipelined_verify_chunks += sum(1 for c in chunks if c.draft and c.last_token_pending)
            if proposer.reads_emitted_tokens:
                verified = self.runner.verify(chunks, logits, self.speculative.forced_acceptance)
            else:
                verify_logits = logits
        if proposer is not None and proposer.reads_emitted_tokens:
            # The MTP head runs the step's kept positions with the tokens after them: read the tokens back now.
            if verified is None:
                verified, sampled = [[token] for token in (sampled.to_host() if sampled is not None else ())], None
            proposer.advance(chunks, verified)
        row = 0
        for chunk in chunks:
            request = chunk.request
            request.num_computed_tokens = chunk.end
            if chunk.samples:
                request.num_pending_tokens += 1
                request.pending_row = row
                row += 1
        pending = PendingStep(chunks, sampled, verified, verify_logits)
        self.in_flight = pending
        return pending

    def complete(self, pending: PendingStep) -> list[StepOutput]:
        """Read the launched step's tokens back and advance its requests. A request that ended after the launch
        (cancelled, or stopped by the front end while the step ran) is skipped and its token dropped."""
        chunks = pending.chunks
        if pending.verify_logits is not None:
            emitted = iter(self.runner.verify(chunks, pending.verify_logits, self.speculative.forced_acceptance))
        elif pending.verified is not None:
            emitted = iter(pending.verified)
        else:
            emitted = ([token] for token in (pending.sampled.to_host() if pending.sampled is not None else ()))
        if self.in_flight is pending:
            self.in_flight = None
        now = time.monotonic()
        self.num_steps += 1
        outputs: list[StepOutput] = []
        for chunk in chunks:
            request = chunk.request
            tokens = next(emitted) if chunk.samples else []
            if tokens:
                request.num_pending_tokens -= 1
            if request.is_finished:
                continue
            running = request.status is RequestStatus.RUNNING
            if chunk.draft and tokens:
                accepted = len(tokens) - 1
                self.num_verify_chunks += 1
                self.num_proposed_tokens += len(chunk.draft)
                self.num_accepted_tokens += accepted
                # Propose as far as this request's proposals have lately held: every rejected proposal costs a
                # row of the verify step.
                limit = self.speculative.num_speculative_tokens
                request.speculative_window = (min(limit, len(chunk.draft) + 1) if accepted == len(chunk.draft)
                                              else accepted + 1)
                # A draft model ran the proposals but the last: with every one kept, it lacks that one's KV.
                request.draft_lag = int(accepted == len(chunk.draft))
            if chunk.draft and running:
                # Keep the KV of the accepted proposals only; the rejected ones' slots go back.
                request.num_computed_tokens = chunk.start + len(tokens)
                self.blocks.truncate(request, request.num_computed_tokens)
                if self.state_pool is not None and 0 < len(tokens) <= len(chunk.draft):
                    # Recurrent state: back to its checkpoint after the last position kept.
                    self.runner.restore_state(request.state_slot, request.state_checkpoints + len(tokens) - 1)
            if not tokens:
                if running:
                    self._cache_and_release(request, chunk.end)
                continue
            if request.first_token_time is None:
                request.first_token_time = now
            reason = None
            mine: list[StepOutput] = []
            for token in tokens:
                request.output_token_ids.append(token.token_id)
                off_grammar = request.grammar is not None and not request.grammar.accept(token.token_id)
                reason = self._check_finished(request, token.token_id)
                if off_grammar and reason is None:
                    # Cannot happen while the sampler masks the row; end the request rather than let it drift.
                    logger.error("request %s: token %d is outside its grammar; ending it", request.request_id,
                                 token.token_id)
                    reason = FinishReason.STOP
                mine.append(StepOutput(request, token, last=False, num_outputs=len(request.output_token_ids)))
                if reason is not None:
                    break
            mine[-1] = replace(mine[-1], last=True)
            if running:
                # A verify chunk's KV stands at what it accepted (the rejected slots went back above).
                self._cache_and_release(request, chunk.start + len(tokens) if chunk.draft else chunk.end)
            if reason is not None:
                self.requests.pop(request.request_id, None)
                self.scheduler.finish(request, reason)
            outputs.extend(mine)
        return outputs
