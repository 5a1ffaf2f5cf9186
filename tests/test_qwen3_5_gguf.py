"""Qwen3.5 and Qwen3.5-MoE from llama.cpp GGUF files (``qwen35``, ``qwen35moe``): the tiny checkpoints written
as llama.cpp's converter writes them, with the ``gguf`` package, load to the same config and weights as the
safetensors checkpoints, and give the same greedy tokens (transformers') and log-probabilities in every engine
regime of the parity tests. Written quantised (F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0), they load to the weights of
the gguf package's quantise-dequantise round trip, and in F16 and Q8_0 give the greedy tokens of a checkpoint
rounded that way."""

from __future__ import annotations

import json
import math
import os
import re

import numpy as np
import pytest
import torch
from conftest import (
    QWEN3_5_NEW_TOKENS,
    QWEN3_5_REGIMES,
    gguf_writer,
    greedy_in_regime,
    qwen3_5_prompts,
    write_checkpoint,
)
from safetensors.torch import load_file

TOP = 5
GLOBALS = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
PARTS = {"input_layernorm": "attn_norm", "post_attention_layernorm": "post_attention_norm",
         "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
         "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
         "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
         "linear_attn.in_proj_qkv": "attn_qkv", "linear_attn.in_proj_z": "attn_gate",
         "linear_attn.in_proj_a": "ssm_alpha", "linear_attn.in_proj_b": "ssm_beta",
         "linear_attn.conv1d": "ssm_conv1d", "linear_attn.norm": "ssm_norm", "linear_attn.out_proj": "ssm_out",
         # Qwen3.5-MoE: the router, the shared expert and its gate
         "mlp.gate": "ffn_gate_inp", "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
         "mlp.shared_expert.up_proj": "ffn_up_shexp", "mlp.shared_expert.down_proj": "ffn_down_shexp",
         "mlp.shared_expert_gate": "ffn_gate_inp_shexp"}
# variant -> (tiny checkpoint, llama.cpp architecture, the experts' gate and up fused in one tensor)
VARIANTS = {"qwen35": ("qwen3_5_text", "qwen35", False), "qwen35moe": ("qwen3_5_moe_text", "qwen35moe", False),
            "qwen35moe-fused-gate-up": ("qwen3_5_moe_text", "qwen35moe", True)}
# The parity tests' regimes the GGUF runs in besides the default one (tests/conftest.py's QWEN3_5_REGIMES).
REGIMES = ("no-prefix-cache", "prefill-budget-16", "preemption")
# Tensor types the loader dequantises that the gguf package also writes (the vectorised F16, BF16, Q8_0, Q4_0 and
# Q4_1, and Q5_0 through the package's own slower code: the dense model only); the greedy tokens are compared for
# F16 and Q8_0, and a Q4_1 file runs in the default CPU weight format (4-bit blocks kept where the kernels run).
QUANTISED = ("F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0")


pytestmark = pytest.mark.usefixtures("one_thread")


def _grouped_to_tiled(tensor: torch.Tensor, k_heads: int, v_heads: int, dim: int = 0) -> torch.Tensor:
    """llama.cpp's converter's value-head order: from grouped by key head to tiled (see gguf_loader.py)."""
    per_k = v_heads // k_heads
    moved = tensor.movedim(dim, 0)
    head = moved.shape[0] // v_heads
    tiled = moved.reshape(k_heads, per_k, head, *moved.shape[1:]).transpose(0, 1).reshape(moved.shape)
    return tiled.movedim(0, dim)


def _gguf_tensors(name: str, tensor: torch.Tensor, config: dict,
                  fuse_gate_up: bool) -> list[tuple[str, torch.Tensor]]:
    """(llama.cpp's tensor name, the tensor as its converter writes it) for a checkpoint entry; the stacked
    experts' gate-up tensor is split in halves unless ``fuse_gate_up`` (the converter's gate-up fusion)."""
    k_heads, v_heads = config["linear_num_key_heads"], config["linear_num_value_heads"]
    qk_rows = 2 * k_heads * config["linear_key_head_dim"]
    if name.endswith("norm.weight") and ".linear_attn." not in name:
        tensor = tensor + 1.0
    if name in GLOBALS:
        return [(GLOBALS[name], tensor)]
    _, _, layer, rest = name.split(".", 3)
    if rest == "linear_attn.A_log":
        return [(f"blk.{layer}.ssm_a", _grouped_to_tiled(-tensor.exp(), k_heads, v_heads))]
    if rest == "linear_attn.dt_bias":
        return [(f"blk.{layer}.ssm_dt.bias", _grouped_to_tiled(tensor, k_heads, v_heads))]
    if rest == "mlp.experts.gate_up_proj":        # [experts, 2 * width, hidden]: gate rows, then up rows
        if fuse_gate_up:
            return [(f"blk.{layer}.ffn_gate_up_exps.weight", tensor)]
        gate, up = tensor.chunk(2, dim=1)
        return [(f"blk.{layer}.ffn_gate_exps.weight", gate), (f"blk.{layer}.ffn_up_exps.weight", up)]
    if rest == "mlp.experts.down_proj":
        return [(f"blk.{layer}.ffn_down_exps.weight", tensor)]
    module, suffix = rest.rsplit(".", 1)
    part = PARTS[module]
    if part in ("attn_gate", "ssm_alpha", "ssm_beta"):
        tensor = _grouped_to_tiled(tensor, k_heads, v_heads)
    elif part in ("attn_qkv", "ssm_conv1d"):
        tensor = tensor.reshape(tensor.shape[0], -1)   # the conv kernel squeezed to [channels, K]
        tensor = torch.cat([tensor[:qk_rows], _grouped_to_tiled(tensor[qk_rows:], k_heads, v_heads)])
    elif part == "ssm_out":
        tensor = _grouped_to_tiled(tensor, k_heads, v_heads, dim=1)
    return [(f"blk.{layer}.{part}.{suffix}", tensor)]


def _stacked_experts(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The checkpoint with per-expert tensors (``mlp.experts.E.gate_proj.weight``, as ``save_pretrained`` writes
    them) stacked per layer, as llama.cpp's converter merges them: ``gate_up_proj`` [E, 2I, H], ``down_proj``."""
    out: dict[str, torch.Tensor] = {}
    experts: dict[str, dict[str, dict[int, torch.Tensor]]] = {}
    for name, tensor in state.items():
        match = re.match(r"^(.*\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$", name)
        if match is None:
            out[name] = tensor
            continue
        prefix, index, part = match.groups()
        experts.setdefault(prefix, {}).setdefault(part, {})[int(index)] = tensor
    for prefix, parts in experts.items():
        gate, up, down = (torch.stack([parts[p][i] for i in sorted(parts[p])]) for p in ("gate", "up", "down"))
        out[f"{prefix}.gate_up_proj"] = torch.cat([gate, up], dim=1)
        out[f"{prefix}.down_proj"] = down
    return out


def _unstacked_experts(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The inverse of ``_stacked_experts``: per-expert tensors, as the safetensors checkpoint holds them."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        prefix, _, rest = name.rpartition(".mlp.experts.")
        if rest == "gate_up_proj":
            for index, (gate, up) in enumerate(zip(*tensor.chunk(2, dim=1))):
                out[f"{prefix}.mlp.experts.{index}.gate_proj.weight"] = gate.contiguous()
                out[f"{prefix}.mlp.experts.{index}.up_proj.weight"] = up.contiguous()
        elif rest == "down_proj":
            for index, down in enumerate(tensor):
                out[f"{prefix}.mlp.experts.{index}.down_proj.weight"] = down.contiguous()
        else:
            out[name] = tensor
    return out


def _checkpoint(directory: str) -> tuple[dict, dict[str, torch.Tensor]]:
    with open(os.path.join(directory, "config.json"), encoding="utf-8") as handle:
        config = json.load(handle)
    return config, load_file(os.path.join(directory, "model.safetensors"))


def _quantised(array: np.ndarray, qtype: str) -> bool:
    """Whether the writer stores a tensor in ``qtype``: matrices whose rows are whole blocks of it (llama.cpp's
    converter keeps vectors, and rows a block does not divide, in F32)."""
    import gguf

    block = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[qtype]][0]
    return qtype != "F32" and array.ndim >= 2 and array.shape[-1] % block == 0


def _round_trip(array: np.ndarray, qtype: str) -> np.ndarray:
    """``array`` quantised to ``qtype`` and back by the gguf package (llama.cpp's reference rounding)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize, quantize

    kind = GGMLQuantizationType[qtype]
    return dequantize(quantize(array, kind), kind)


def _rounded_state(state: dict[str, torch.Tensor], config: dict, qtype: str) -> dict[str, torch.Tensor]:
    """The checkpoint's weights as a ``qtype`` GGUF of ``_write_gguf`` holds them: every tensor it quantises goes
    through the round trip in llama.cpp's layout (experts stacked, value heads tiled, so that the blocks are the
    file's) and back, the element positions traced through the same conversion."""
    rounded: dict[str, torch.Tensor] = {}
    for name, tensor in _stacked_experts(state).items():
        flat = tensor.flatten().clone()
        positions = torch.arange(tensor.numel(), dtype=torch.float64).reshape(tensor.shape)
        for (_, converted), (_, where) in zip(_gguf_tensors(name, tensor, config, True),
                                              _gguf_tensors(name, positions, config, True)):
            array = converted.contiguous().numpy()
            if _quantised(array, qtype):
                flat[where.flatten().long()] = torch.from_numpy(_round_trip(array, qtype)).flatten()
        rounded[name] = flat.reshape(tensor.shape)
    return _unstacked_experts(rounded)


def _write_gguf(path: str, arch: str, config: dict, state: dict[str, torch.Tensor], fuse_gate_up: bool,
                expert_weights_norm: bool | None = None, qtype: str = "F32") -> None:
    """The checkpoint as llama.cpp's converter writes a Qwen3.5 (``qwen35``) or Qwen3.5-MoE (``qwen35moe``)
    GGUF: the matrices in ``qtype`` (quantised by the gguf package) where their rows allow, the rest in F32
    (``expert_weights_norm``: that key too, when not None)."""
    gguf = pytest.importorskip("gguf")
    from gguf.quants import quantize

    writer = gguf_writer(gguf, path, arch, config)
    rope = config["rope_parameters"]
    writer.add_rope_freq_base(rope["rope_theta"])
    writer.add_rope_dimension_count(int(config["head_dim"] * rope["partial_rotary_factor"]))
    writer.add_full_attention_interval(config["layer_types"].index("full_attention") + 1)
    writer.add_ssm_conv_kernel(config["linear_conv_kernel_dim"])
    writer.add_ssm_state_size(config["linear_key_head_dim"])
    writer.add_ssm_group_count(config["linear_num_key_heads"])
    writer.add_ssm_time_step_rank(config["linear_num_value_heads"])
    writer.add_ssm_inner_size(config["linear_num_value_heads"] * config["linear_value_head_dim"])
    if arch == "qwen35moe":
        writer.add_expert_count(config["num_experts"])
        writer.add_expert_used_count(config["num_experts_per_tok"])
        writer.add_expert_feed_forward_length(config["moe_intermediate_size"])
        writer.add_expert_shared_feed_forward_length(config["shared_expert_intermediate_size"])
        if expert_weights_norm is not None:
            writer.add_expert_weights_norm(expert_weights_norm)
    writer.add_tokenizer_model("llama")   # a placeholder vocabulary: the test runs on token ids
    writer.add_token_list(["<unk>", "<s>", "</s>"] + [f"<tok{i}>" for i in range(3, config["vocab_size"])])
    writer.add_token_scores([0.0] * config["vocab_size"])
    writer.add_token_types([gguf.TokenType.NORMAL] * config["vocab_size"])
    writer.add_bos_token_id(config["bos_token_id"])
    writer.add_eos_token_id(config["eos_token_id"])
    writer.add_unk_token_id(0)
    for name, tensor in _stacked_experts(state).items():
        for gguf_name, converted in _gguf_tensors(name, tensor.float(), config, fuse_gate_up):
            array = converted.contiguous().numpy()
            kind = gguf.GGMLQuantizationType[qtype if _quantised(array, qtype) else "F32"]
            writer.add_tensor(gguf_name, quantize(array, kind), raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="module")
def gguf_file(tiny_checkpoint, tmp_path_factory):
    """``gguf_file(variant, qtype="F32")``: the variant's tiny checkpoint written as a GGUF (once per module)."""
    made: dict[tuple[str, str], str] = {}

    def make(variant: str, qtype: str = "F32") -> str:
        if (variant, qtype) not in made:
            arch, gguf_arch, fuse_gate_up = VARIANTS[variant]
            path = str(tmp_path_factory.mktemp("gguf") / f"{variant}-{qtype}.gguf")
            _write_gguf(path, gguf_arch, *_checkpoint(tiny_checkpoint(arch)), fuse_gate_up, qtype=qtype)
            made[variant, qtype] = path
        return made[variant, qtype]

    return make


@pytest.fixture(scope="module")
def rounded_checkpoint(tiny_checkpoint, tmp_path_factory):
    """``rounded_checkpoint(arch, qtype)``: the tiny safetensors checkpoint with the weights a ``qtype`` GGUF of
    it holds (``_rounded_state``), written once per module."""
    made: dict[tuple[str, str], str] = {}

    def make(arch: str, qtype: str) -> str:
        if (arch, qtype) not in made:
            directory = tiny_checkpoint(arch)
            config, state = _checkpoint(directory)
            out = str(tmp_path_factory.mktemp(f"rounded-{arch}-{qtype}"))
            write_checkpoint(out, config, _rounded_state(state, config, qtype), directory)
            made[arch, qtype] = out
        return made[arch, qtype]

    return make


def _loaded_model(path: str) -> torch.nn.Module:
    """Our model with the checkpoint's weights loaded (GGUF or safetensors), on the CPU."""
    from pocketllm.loaders.checkpoint import load_checkpoint
    from pocketllm.models.registry import model_class
    from pocketllm.models.weights import load_weights

    checkpoint = load_checkpoint(path)
    model = model_class(checkpoint.hf_config)(checkpoint.hf_config)
    load_weights(model, checkpoint.iter_weights())
    return model


def _assert_same_parameters(path: str, directory: str) -> None:
    from_gguf, from_safetensors = _loaded_model(path).state_dict(), _loaded_model(directory).state_dict()
    assert set(from_gguf) == set(from_safetensors)
    for name, tensor in from_gguf.items():
        torch.testing.assert_close(tensor, from_safetensors[name], rtol=1e-6, atol=1e-6, msg=name)


def _greedy(path: str, regime: str, logprobs: int | None = None, **engine_args) -> list:
    return greedy_in_regime(path, regime, {**QWEN3_5_REGIMES[regime], **engine_args}, qwen3_5_prompts(),
                            QWEN3_5_NEW_TOKENS, logprobs=logprobs)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_gguf_equals_the_safetensors_checkpoint(variant, tiny_checkpoint, qwen3_5_references, gguf_file):
    """A GGUF written as llama.cpp's converter writes one (norms as 1 + w, -exp(A_log), the conv kernel
    squeezed, the value heads tiled: 4 value heads over 2 key heads; for the MoE the experts stacked per layer,
    split or fused, the shared expert and its gate) loads to the checkpoint's config and to the same parameters,
    and generates transformers' greedy tokens with the log-probabilities of the safetensors load."""
    from pocketllm.loaders.checkpoint import load_checkpoint

    arch, gguf_arch, _ = VARIANTS[variant]
    directory, path = tiny_checkpoint(arch), gguf_file(variant)
    ours, original = load_checkpoint(path).hf_config, load_checkpoint(directory).hf_config
    assert ours.architectures == original.architectures and not ours.tie_word_embeddings
    keys = ["layer_types", "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
            "linear_value_head_dim", "linear_conv_kernel_dim", "head_dim", "num_key_value_heads"]
    if gguf_arch == "qwen35moe":
        keys += ["num_experts", "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size"]
    for key in keys:
        assert getattr(ours, key) == getattr(original, key), key
    assert ours.partial_rotary_factor == original.rope_parameters["partial_rotary_factor"]
    _assert_same_parameters(path, directory)

    outputs, expected = _greedy(path, "default", TOP), _greedy(directory, "default", TOP)
    assert [o.token_ids for o in outputs] == qwen3_5_references(arch)
    assert [o.token_ids for o in outputs] == [o.token_ids for o in expected]
    for out, reference in zip(outputs, expected):
        for got, want in zip(out.logprobs, reference.logprobs):
            assert [alt.token_id for alt in got.top] == [alt.token_id for alt in want.top]
            for a, b in zip(got.top, want.top):
                assert math.isclose(a.logprob, b.logprob, abs_tol=1e-5)


@pytest.mark.parametrize("variant", ["qwen35", "qwen35moe"])
@pytest.mark.parametrize("regime", REGIMES)
def test_gguf_greedy_in_engine_regimes(variant, regime, tiny_checkpoint, qwen3_5_references, gguf_file):
    """Batched prompts of mixed lengths, with prefix caching off, prefills chunked by a 16-token budget, or a KV
    pool small enough to preempt: the GGUF's greedy tokens are the safetensors checkpoint's and transformers'."""
    arch = VARIANTS[variant][0]
    tokens = [o.token_ids for o in _greedy(gguf_file(variant), regime)]
    assert tokens == qwen3_5_references(arch)
    assert tokens == [o.token_ids for o in _greedy(tiny_checkpoint(arch), regime)]


@pytest.mark.parametrize("variant, qtype", [(variant, qtype) for variant in ("qwen35", "qwen35moe")
                                             for qtype in QUANTISED if (variant, qtype) != ("qwen35moe", "Q5_0")]
                         + [("qwen35moe-fused-gate-up", "Q8_0")])
def test_quantised_gguf_loads_the_rounded_weights(variant, qtype, tiny_checkpoint, gguf_file):
    """Matrices written in ``qtype`` load to the gguf package's dequantisation of what was written: the
    safetensors checkpoint's weights rounded the same way, in the same blocks; the rest as written."""
    from pocketllm.loaders.checkpoint import load_checkpoint
    from pocketllm.loaders.gguf_file import GGUFFile

    arch = VARIANTS[variant][0]
    path = gguf_file(variant, qtype)
    kinds = {tensor.name: tensor.type.name for tensor in GGUFFile(path).tensors}
    expect = {"token_embd.weight", "output.weight", "blk.0.attn_qkv.weight", "blk.0.ssm_out.weight",
              "blk.3.attn_q.weight"}
    expect |= {"blk.0.ffn_gate_inp.weight", "blk.0.ffn_down_exps.weight"} if arch.endswith("moe_text") else set()
    assert {name: kinds[name] for name in expect} == dict.fromkeys(expect, qtype)
    assert kinds["blk.0.attn_norm.weight"] == "F32"
    config, state = _checkpoint(tiny_checkpoint(arch))
    rounded = _rounded_state(state, config, qtype)
    loaded = dict(load_checkpoint(path).iter_weights())
    assert set(loaded) == set(rounded)
    for name, tensor in loaded.items():
        torch.testing.assert_close(tensor, rounded[name], rtol=1e-6, atol=1e-6, msg=name)
    assert not torch.equal(loaded["model.embed_tokens.weight"], state["model.embed_tokens.weight"])


@pytest.mark.parametrize("variant", ["qwen35", "qwen35moe"])
@pytest.mark.parametrize("qtype, regime", [("F16", "prefill-budget-16"), ("Q8_0", "preemption")])
def test_quantised_gguf_generates_the_rounded_checkpoints_tokens(variant, qtype, regime, gguf_file,
                                                                 rounded_checkpoint):
    """A quantised GGUF's greedy tokens (batched prompts of mixed lengths), its weights dequantised to float32,
    are those of the safetensors checkpoint whose weights were rounded the same way."""
    tokens = [o.token_ids for o in _greedy(gguf_file(variant, qtype), regime, cpu_weight_format="float32")]
    assert tokens == [o.token_ids for o in _greedy(rounded_checkpoint(VARIANTS[variant][0], qtype), regime)]


@pytest.mark.parametrize("variant", ["qwen35", "qwen35moe"])
def test_q4_1_gguf_runs_in_the_default_cpu_weight_format(variant, gguf_file):
    """A Q4_1 GGUF in the default CPU weight format (its 4-bit blocks kept where the AVX-512 VNNI kernels run,
    with 8-bit activations, so not the float32 tokens) generates every token under preemption."""
    _greedy(gguf_file(variant, "Q4_1"), "preemption")


def test_qwen35moe_gguf_without_renormalised_expert_weights_is_refused(tiny_checkpoint, tmp_path):
    """llama.cpp may store ``expert_weights_norm``; Qwen3.5-MoE always renormalises, so false is refused by name."""
    from pocketllm.errors import CheckpointError
    from pocketllm.loaders.checkpoint import load_checkpoint

    path = str(tmp_path / "no-norm.gguf")
    _write_gguf(path, "qwen35moe", *_checkpoint(tiny_checkpoint("qwen3_5_moe_text")), False,
                expert_weights_norm=False)
    with pytest.raises(CheckpointError, match="expert_weights_norm"):
        load_checkpoint(path)
