"""The PyTorch backend: loads a checkpoint, builds the engine core and runs it on the engine thread."""

from __future__ import annotations

import logging

from pocketllm.backends.base import EngineCaps
from pocketllm.backends.draft_checkpoint import load_draft
from pocketllm.config import EngineArgs
from pocketllm.distributed import tp_size
from pocketllm.engine.engine_core import EngineCore
from pocketllm.engine.loop import EngineLoop
from pocketllm.engine.model_info import ModelInfo, describe_model
from pocketllm.errors import InvalidRequestError, UnsupportedFeatureError
from pocketllm.loaders.checkpoint import load_checkpoint
from pocketllm.loaders.default_model import default_model_path
from pocketllm.runner.grammar import GrammarCompiler, xgrammar_available
from pocketllm.sampling_params import MAX_LOGPROBS
from pocketllm.tokenizer.eos import resolve_eos

logger = logging.getLogger("pocketllm.backend")

KNOWN_OPTIONS = frozenset({"eos_token_id"})


class TorchBackend:
    """One model, one engine thread."""

    name = "torch"

    def __init__(self, args: EngineArgs) -> None:
        unknown = sorted(set(args.backend_options) - KNOWN_OPTIONS)
        if unknown:
            raise InvalidRequestError(
                f"backend_options {unknown} are not understood by the torch backend "
                f"(known: {', '.join(sorted(KNOWN_OPTIONS))})", param="backend_options")
        if tp_size() > 1:
            raise UnsupportedFeatureError("this process already runs a tensor-parallel engine; shut it down first "
                                          "(one engine per process under tensor parallelism)")
        spec = args.speculative_config
        if args.tensor_parallel_size > 1 and spec is not None and spec.method in ("draft_model", "mtp"):
            raise UnsupportedFeatureError(f"speculative_config.method {spec.method!r} runs on one rank; use "
                                          "tensor_parallel_size=1 or method 'ngram'")
        self.args = args
        # Tensor parallelism: this process is rank 0 (it schedules and samples); the worker ranks are started
        # here (or by an external launcher) and joined before the model is built, since layers shard by rank.
        self.tp = None
        if args.tensor_parallel_size > 1:
            from pocketllm.distributed.engine_group import EngineGroup
            from pocketllm.runner.model_runner import resolve_device

            self.tp = EngineGroup(args, resolve_device(args.device))
        try:
            self._build(args)
            if self.tp is not None:
                self.tp.loaded()
        except BaseException:
            if self.tp is not None:
                self.tp.close(clean=False)
            raise

    def _build(self, args: EngineArgs) -> None:
        self.model_path = args.model or default_model_path()
        # A GGUF file's tokenizer loads on a thread of its own while the weights load: it is waited for only
        # where it is needed (the EOS ids when the config names none, the grammar compiler, ``self.tokenizer``).
        checkpoint = self.checkpoint = load_checkpoint(self.model_path, args.load_format)
        eos_ids, eos_source = resolve_eos(args.backend_options, checkpoint.generation_config,
                                          checkpoint.hf_config, None)
        if not eos_ids:
            eos_ids, eos_source = resolve_eos(args.backend_options, checkpoint.generation_config,
                                              checkpoint.hf_config, checkpoint.tokenizer)
        dummy = args.load_format == "dummy" or checkpoint.format == "dummy"
        weights = None if dummy else checkpoint.iter_weights()
        hf_config, weight_type = checkpoint.hf_config, checkpoint.weight_type
        draft = load_draft(args, checkpoint)

        def build() -> EngineCore:   # runs on the engine thread (EngineLoop says why)
            core = EngineCore(args, hf_config, weights, eos_ids, weight_type, draft)
            tokenizer = checkpoint.tokenizer
            if tokenizer is not None and xgrammar_available():
                # Added tokens (<|im_end|>, <think>, <tool_call>, ...) never appear inside constrained text.
                never_in_text = tokenizer.special_token_ids | frozenset(tokenizer.hf.added_tokens_decoder)
                core.grammar_compiler = GrammarCompiler(tokenizer.vocab_bytes, never_in_text, core.vocab_size,
                                                        eos_ids)
            return core

        self.loop = EngineLoop(build)
        self.core = self.loop.core
        self.tokenizer = checkpoint.tokenizer
        self.caps = EngineCaps(
            max_slots=args.max_num_seqs,
            chunked_prefill=args.enable_chunked_prefill,
            prefix_caching=self.core.blocks.enable_prefix_caching,   # off for hybrid (recurrent-state) models
            max_logprobs=MAX_LOGPROBS,
            structured_outputs=self.core.grammar_compiler is not None,
            speculative=(args.speculative_config.method,) if args.speculative_config is not None else (),
            details={
                "backend": "torch",
                "eos_source": eos_source,
                "eos_token_ids": sorted(eos_ids),
                "architecture": (self.checkpoint.hf_config.architectures or ["?"])[0],
                "format": self.checkpoint.format,
                "device": str(self.core.device),
                "dtype": str(self.core.dtype).removeprefix("torch."),
                "cpu_weight_format": self.core.cpu_weight_format.name,
                "quantization": args.quantization,
                "max_model_len": self.core.max_model_len,
                "vocab_size": self.core.vocab_size,
                "block_size": args.block_size,
                "num_kv_blocks": self.core.blocks.num_blocks,
                "tensor_parallel_size": args.tensor_parallel_size,
            })

    def model_info(self) -> ModelInfo:
        """Sizes, dtype and device of the model the engine runs."""
        return describe_model(self.core)

    def shutdown(self) -> None:
        self.loop.shutdown()
        if self.tp is not None:
            # The stop message is only safe once the engine thread is gone and its last step went through.
            self.tp.close(clean=not self.loop.thread.is_alive() and self.loop.error is None)
