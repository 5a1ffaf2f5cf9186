"""``EngineArgs``: the one typed source of engine configuration (the CLI's engine flags come from it)."""

from __future__ import annotations

import dataclasses
import json
import os
import types
import typing
from dataclasses import dataclass, field
from typing import Any

from pocketllm.errors import InvalidRequestError

BACKENDS = ("auto", "torch", "cpp")
DTYPES = ("auto", "float32", "bfloat16", "float16")
LOAD_FORMATS = ("auto", "dummy")
DEVICES = ("auto", "cpu", "cuda")
CPU_WEIGHT_FORMATS = ("auto", "float32", "bfloat16", "int4", "int8")
QUANTIZATIONS = ("fp8",)


SPECULATIVE_METHODS = ("ngram", "draft_model", "mtp")
SPECULATIVE_KEYS = ("method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "model",
                    "forced_acceptance")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding, validated once (vLLM's spelling): ``method`` ngram (prompt lookup: the last
    ``prompt_lookup_max``..``prompt_lookup_min`` tokens matched against earlier context), draft_model (``model``)
    or mtp; ``num_speculative_tokens`` proposed per step. ``forced_acceptance`` (PocketLLM's, for benchmarks with
    random weights only): every proposal is kept whatever the target says, so that a run measures the mechanics'
    cost at an acceptance length of ``num_speculative_tokens + 1``."""

    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 4
    model: str | None = None
    forced_acceptance: bool = False

    def __post_init__(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise InvalidRequestError(f"speculative_config.method must be one of {', '.join(SPECULATIVE_METHODS)}; "
                                      f"got {self.method!r}", param="speculative_config")
        for name in ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InvalidRequestError(f"speculative_config.{name} must be a positive integer; got {value!r}",
                                          param="speculative_config")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise InvalidRequestError("speculative_config.prompt_lookup_min must not exceed prompt_lookup_max",
                                      param="speculative_config")
        if not isinstance(self.forced_acceptance, bool):
            raise InvalidRequestError(f"speculative_config.forced_acceptance must be true or false; got "
                                      f"{self.forced_acceptance!r}", param="speculative_config")
        if (self.method == "draft_model") != (self.model is not None):
            raise InvalidRequestError("speculative_config.model names the draft checkpoint, for method draft_model "
                                      "only (and it needs one)", param="speculative_config")

    @classmethod
    def from_dict(cls, values: typing.Mapping[str, Any]) -> SpeculativeConfig:
        """The config from a mapping with vLLM's keys (unknown keys refused)."""
        unknown = sorted(set(values) - set(SPECULATIVE_KEYS))
        if unknown:
            raise InvalidRequestError(f"speculative_config: unknown key {unknown[0]!r} (known: "
                                      f"{', '.join(SPECULATIVE_KEYS)})", param="speculative_config")
        if "method" not in values or "num_speculative_tokens" not in values:
            raise InvalidRequestError("speculative_config needs method and num_speculative_tokens",
                                      param="speculative_config")
        return cls(**values)

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in dataclasses.asdict(self).items()
                if v is not None and not (k == "forced_acceptance" and not v)}


def _opt(default: Any, help_text: str) -> Any:
    """A field with its command-line help attached."""
    return field(default=default, metadata={"help": help_text})


@dataclass(frozen=True)
class EngineArgs:
    """Engine options. ``None`` means "derive from the checkpoint or the device"."""

    model: str | None = _opt(None, "Checkpoint: a .gguf file, an HF safetensors directory, or a preset "
                             "name with load_format=dummy (default: the packaged SmolLM2-135M-Instruct GGUF).")
    backend: str = _opt("auto", "auto | torch | cpp (the native plane on CPU: Qwen3, Qwen3.5 and their MoE "
                                "variants as safetensors, llama/qwen2/qwen3 GGUF files; docs/native.md). auto: "
                                "the native plane for a Qwen3.5 safetensors checkpoint on CPU when it is built "
                                "and no option needs torch, else torch.")
    device: str = _opt("auto", "auto (cuda when available, else cpu) | cpu | cuda.")
    dtype: str = _opt("auto", "Compute dtype: auto (float32 on CPU, bfloat16 on CUDA) | float32 | bfloat16 | "
                              "float16.")
    cpu_weight_format: str = _opt("auto", "CPU weights of the linear layers and LM head: auto (int4 for a Q4_1 "
                                          "GGUF where PocketLLM's AVX-512 VNNI kernels run, close to "
                                          "float32 in perplexity: docs/cpu-quality.md; else as --dtype) | "
                                          "float32 | bfloat16 | int4 (weight-only, groups of 32: a Q4 GGUF keeps "
                                          "its 4-bit codes) | int8 (8-bit weights and activations: faster than "
                                          "int4 for batches of 2-8 rows). bfloat16, int4 and int8 change results "
                                          "slightly (docs/benchmarks.md).")
    cpu_compile: bool = _opt(False, "CPU: compile the decode steps of one row and of 2-8 rows with PyTorch's "
                                    "inductor (C++ wrapper) at start-up, which takes about a minute on 2 cores with "
                                    "inductor's cache warm and about nine the first time: about 0.6 of the eager "
                                    "step's time at one row and 0.84 at eight with int4 weights on a 2-core "
                                    "machine (docs/benchmarks.md).")
    max_model_len: int | None = _opt(None, "Longest prompt + output in tokens (default: the checkpoint's "
                                           "context, capped by the KV cache).")
    max_num_seqs: int = _opt(64, "Most requests running at once.")
    max_num_batched_tokens: int = _opt(2048, "Token budget of one engine step (decode tokens plus prefill "
                                             "chunks).")
    enable_chunked_prefill: bool = _opt(True, "Split long prompts across steps so decodes keep running.")
    block_size: int = _opt(16, "Tokens per KV-cache block.")
    enable_prefix_caching: bool = _opt(True, "Reuse KV blocks of identical prompt prefixes.")
    num_kv_blocks: int | None = _opt(None, "Size the KV cache in blocks explicitly (default: from memory).")
    cpu_kv_cache_gb: float = _opt(2.0, "KV-cache size on CPU, in GiB.")
    gpu_memory_utilization: float = _opt(0.9, "Fraction of GPU memory the engine may use.")
    quantization: str | None = _opt(None, "Weights of the linear layers (default: the compute dtype): fp8 (float8 e4m3 "
                                          "with one scale per output row, quantised at load: half the bytes of "
                                          "bfloat16 for decode-bound steps; the embedding and LM head keep the "
                                          "compute dtype; quality in docs/benchmarks.md; dense models).")
    kv_cache_dtype: str = _opt("auto", "auto (the compute dtype; on CPU with bfloat16/int4/int8 weights, bfloat16) | "
                                       "bfloat16 | fp8 (float8 e4m3 with scale 1, half the KV bytes of bfloat16; "
                                       "magnitudes beyond 448 saturate; on CPU a slow reference path for "
                                       "measuring quality, docs/benchmarks.md).")
    async_scheduling: str = _opt("auto", "auto (on for CUDA) | on | off: schedule and launch step N+1 before "
                                          "step N's sampled tokens are read back.")
    enforce_eager: bool = _opt(False, "CUDA: run decode steps eagerly instead of replaying captured CUDA graphs.")
    load_format: str = _opt("auto", "auto | dummy (random weights with the checkpoint's or preset's shapes).")
    seed: int = _opt(0, "Seed of the shared sampling generator (requests without their own seed).")
    tensor_parallel_size: int = _opt(1, "Number of tensor-parallel ranks.")
    tensor_parallel_supervisor: bool = _opt(
        True, "With tensor_parallel_size > 1, start, watch and reap the local ranks; off: an external launcher "
              "(torchrun, a manual script) started them and each process reads RANK/WORLD_SIZE/LOCAL_RANK (and "
              "MASTER_ADDR/MASTER_PORT) from its environment.")
    tensor_parallel_startup_timeout: float = _opt(
        600.0, "Seconds every tensor-parallel rank may take to start and load before the group is stopped.")
    tensor_parallel_shutdown_timeout: float = _opt(
        60.0, "Seconds the tensor-parallel ranks may take to exit once asked before they are killed.")
    tensor_parallel_master_addr: str | None = _opt(
        None, "Rendezvous over TCP at this address (default: a file store in the private run directory).")
    tensor_parallel_master_port: int | None = _opt(
        None, "TCP rendezvous port (default: a free port when a master address is given).")
    tensor_parallel_rendezvous_dir: str | None = _opt(
        None, "Parent of the private per-run rendezvous directory (default: the system temp directory); "
              "never removed.")
    engine_process: bool | None = _opt(
        None, "Run the engine (scheduler, model, sampling) in a process of its own, the caller's process keeping "
              "tokenising, detokenising and the HTTP front end. Unset: on for the server on CUDA, else off (the "
              "library keeps the engine in-process). Not with tensor parallelism.")
    speculative_config: SpeculativeConfig | None = field(
        default=None, metadata={"help": 'Speculative decoding as JSON (vLLM\'s keys), e.g. {"method": "ngram", '
                                        '"num_speculative_tokens": 4, "prompt_lookup_min": 2, '
                                        '"prompt_lookup_max": 4}, or a draft model: {"method": "draft_model", '
                                        '"model": "draft.gguf", "num_speculative_tokens": 4}, or a Qwen3.5 '
                                        'checkpoint\'s MTP head: {"method": "mtp", "num_speculative_tokens": 2} '
                                        '(docs/library.md).'})
    backend_options: dict[str, Any] = field(
        default_factory=dict, metadata={"help": 'Backend-specific knobs as JSON, e.g. {"eos_token_id": 2}.'})

    def __post_init__(self) -> None:
        self._choice("backend", BACKENDS)
        self._choice("device", DEVICES)
        self._choice("dtype", DTYPES)
        self._choice("load_format", LOAD_FORMATS)
        self._choice("async_scheduling", ("auto", "on", "off"))
        self._choice("kv_cache_dtype", ("auto", "bfloat16", "fp8"))
        self._choice("cpu_weight_format", CPU_WEIGHT_FORMATS)
        if self.quantization is not None:
            self._choice("quantization", QUANTIZATIONS)
            if self.cpu_weight_format not in ("auto", "float32"):
                raise InvalidRequestError(f"quantization={self.quantization!r} and cpu_weight_format="
                                          f"{self.cpu_weight_format!r} both choose the linear layers' weights: "
                                          "give one of them", param="quantization")
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size", "tensor_parallel_size"):
            self._positive(name)
        for name in ("max_model_len", "num_kv_blocks"):
            if getattr(self, name) is not None:
                self._positive(name)
        if self.engine_process not in (None, True, False):
            raise InvalidRequestError("engine_process must be true, false or unset", param="engine_process")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise InvalidRequestError("gpu_memory_utilization must be in (0, 1]",
                                      param="gpu_memory_utilization")
        if not self.cpu_kv_cache_gb > 0:
            raise InvalidRequestError("cpu_kv_cache_gb must be positive", param="cpu_kv_cache_gb")
        for name in ("tensor_parallel_startup_timeout", "tensor_parallel_shutdown_timeout"):
            if not getattr(self, name) > 0:
                raise InvalidRequestError(f"{name} must be positive", param=name)
        port = self.tensor_parallel_master_port
        if port is not None and (isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536):
            raise InvalidRequestError(f"tensor_parallel_master_port must be in 1..65535; got {port!r}",
                                      param="tensor_parallel_master_port")
        spec = self.speculative_config
        if isinstance(spec, typing.Mapping):
            # Built once here (a frozen field never changes after construction).
            object.__setattr__(self, "speculative_config", SpeculativeConfig.from_dict(spec))
        elif spec is not None and not isinstance(spec, SpeculativeConfig):
            raise InvalidRequestError("speculative_config must be a mapping", param="speculative_config")
        spec = self.speculative_config
        if spec is not None and spec.forced_acceptance and self.load_format != "dummy":
            raise InvalidRequestError("speculative_config.forced_acceptance keeps proposals the model may reject, "
                                      "for benchmarks with random weights only: it needs load_format='dummy'",
                                      param="speculative_config")
        if not isinstance(self.backend_options, dict):
            raise InvalidRequestError("backend_options must be a mapping", param="backend_options")

    def _choice(self, name: str, choices: tuple[str, ...]) -> None:
        if getattr(self, name) not in choices:
            raise InvalidRequestError(
                f"{name} must be one of {', '.join(choices)}; got {getattr(self, name)!r}", param=name)

    def _positive(self, name: str) -> None:
        value = getattr(self, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise InvalidRequestError(f"{name} must be a positive integer; got {value!r}", param=name)

    @classmethod
    def from_env(cls, environ: typing.Mapping[str, str] | None = None, **overrides: Any) -> EngineArgs:
        """Read ``POCKETLLM_<FIELD>`` variables (explicit ``overrides`` win)."""
        environ = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            raw = environ.get(f"POCKETLLM_{f.name.upper()}")
            if raw is not None:
                values[f.name] = parse_field(f.name, raw)
        values.update(overrides)
        return cls(**values)

    def replace(self, **changes: Any) -> EngineArgs:
        """A copy with ``changes`` applied (the original is never mutated)."""
        return dataclasses.replace(self, **changes)


def field_kind(name: str) -> type:
    """The basic type (int, float, bool, str, dict, SpeculativeConfig) a field of EngineArgs holds."""
    hint = typing.get_type_hints(EngineArgs)[name]
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        hint = next(a for a in typing.get_args(hint) if a is not type(None))
    return typing.get_origin(hint) or hint


def parse_field(name: str, raw: str) -> Any:
    """Parse a string (environment or command line) into field ``name``'s type."""
    kind = field_kind(name)
    try:
        if kind is bool:
            lowered = raw.strip().lower()
            if lowered not in ("1", "0", "true", "false", "yes", "no", "on", "off"):
                raise ValueError(raw)
            return lowered in ("1", "true", "yes", "on")
        if kind in (dict, SpeculativeConfig):
            value = json.loads(raw)
            if not isinstance(value, dict):
                raise ValueError(raw)
            return value
        if kind in (int, float):
            return kind(raw)
        return raw
    except ValueError:
        raise InvalidRequestError(f"{name}: cannot read {raw!r} as {kind.__name__}", param=name) from None
