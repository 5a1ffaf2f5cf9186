"""backend='cpp': the native plane (``pocketllm_cpp``) behind the same facade as the Torch backend. Everything
the native engine does not do is refused here, before the module loads a weight."""

from __future__ import annotations

from typing import Any

from pocketllm.backends.base import EngineCaps
from pocketllm.backends.cpp_core import NativeCore
from pocketllm.backends.native import check_args, native_model_path, require_native
from pocketllm.config import EngineArgs
from pocketllm.engine.commands import ExportPrefix, ImportPrefix
from pocketllm.engine.loop import EngineLoop
from pocketllm.engine.model_info import ModelInfo
from pocketllm.errors import UnsupportedFeatureError
from pocketllm.loaders.checkpoint import load_checkpoint
from pocketllm.sampling_params import MAX_LOGPROBS
from pocketllm.tokenizer.eos import resolve_eos


class _NativeLoop(EngineLoop):
    """The engine thread over a ``NativeCore``: KV snapshots are refused (the native cache has no export)."""

    def _execute(self, command: Any) -> object:
        if isinstance(command, (ExportPrefix, ImportPrefix)):
            raise UnsupportedFeatureError("backend='cpp' cannot export or import KV prefixes")
        return super()._execute(command)


class CppBackend:
    """One native engine, stepped on the engine thread."""

    name = "cpp"

    def __init__(self, args: EngineArgs) -> None:
        check_args(args)
        native = require_native()
        self.args = args
        self.model_path = native_model_path(args)   # a GGUF file, or a safetensors directory
        is_gguf = self.model_path.endswith(".gguf")
        checkpoint = self.checkpoint = load_checkpoint(self.model_path, "gguf" if is_gguf else "safetensors")
        self.tokenizer = checkpoint.tokenizer
        eos_ids, eos_source = resolve_eos(args.backend_options, checkpoint.generation_config, checkpoint.hf_config,
                                          checkpoint.tokenizer)
        options = native.QwenEngineOptions()
        options.block_size = args.block_size
        options.prefix_caching = args.enable_prefix_caching
        options.max_slots = args.max_num_seqs
        options.weight_format = args.cpu_weight_format   # "auto": a Q4_1 GGUF's layers stay 4-bit (on the CPU)
        options.device = args.device   # "auto": a CUDA device where the module is a CUDA build and one is there
        options.eos_token_ids = sorted(eos_ids)
        if args.num_kv_blocks is not None:
            options.num_kv_blocks = args.num_kv_blocks
        options.kv_cache_mb = args.cpu_kv_cache_gb * 1024.0
        if args.max_model_len is not None:
            options.max_model_len = args.max_model_len
        budget = args.max_num_batched_tokens if args.enable_chunked_prefill else 0
        spec = args.speculative_config   # check_args let only prompt lookup through

        def build() -> NativeCore:   # on the engine thread, like the Torch backend's core
            try:
                engine = native.QwenEngine(self.model_path, options)
            except ValueError as exc:
                raise UnsupportedFeatureError(f"backend='cpp': {exc}") from None
            core = NativeCore(native, engine, args.max_num_seqs, budget, args.seed)
            if spec is not None:
                core.batch.set_ngram_speculation(spec.num_speculative_tokens, spec.prompt_lookup_min,
                                                 spec.prompt_lookup_max)
            return core

        self.loop = _NativeLoop(build)
        self.core = self.loop.core
        engine = self.core.engine
        self.caps = EngineCaps(
            max_slots=args.max_num_seqs,
            chunked_prefill=args.enable_chunked_prefill,
            prefix_caching=bool(args.enable_prefix_caching and engine.options.prefix_caching),
            max_logprobs=MAX_LOGPROBS,
            structured_outputs=False,
            speculative=(spec.method,) if spec is not None else (),
            details={
                "backend": "cpp",
                "native_backend": native.backend,
                "eos_source": eos_source,
                "eos_token_ids": sorted(eos_ids),
                "architecture": engine.architecture or "Qwen3ForCausalLM",
                "format": "gguf" if is_gguf else "safetensors",
                "device": engine.device,
                "dtype": "float32",
                "weight_format": engine.weight_format,
                "max_model_len": self.core.max_model_len,
                "vocab_size": self.core.vocab_size,
                "block_size": engine.block_size,
                "num_kv_blocks": engine.num_kv_blocks,
                "tensor_parallel_size": 1,
            })

    def model_info(self) -> ModelInfo:
        """Sizes of the native engine's model."""
        engine = self.core.engine
        return ModelInfo(architecture=self.caps.details["architecture"], vocab_size=self.core.vocab_size,
                         num_parameters=int(engine.num_parameters), weight_bytes=int(engine.decode_weight_bytes),
                         dtype="float32", device=str(engine.device), max_model_len=self.core.max_model_len)

    def shutdown(self) -> None:
        self.loop.shutdown()
