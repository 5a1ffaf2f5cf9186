"""Speculative decoding with DeepSeek-V4's own MTP layer (``method="mtp"``): the layer against a reference
computation (fp32, its decoder block from transformers), refusals, greedy outputs equal to the engine's without
speculation (batched with mixed lengths, chunked prefill, preemption; the target's compressed layers roll their
state back after a rejection), and seeded sampling in distribution.

The tiny checkpoint is ``tests/conftest.py``'s DeepSeek-V4 with an MTP layer added in DeepSeek's names
(``mtp.0.*``): its attention the sliding layer 0's weights with noise, its experts the score-routed layer 1's
with noise, the norms, projections and hyper-head random.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from conftest import write_checkpoint
from safetensors.torch import load_file
from test_deepseek_v4_model import use_graph_steps
from test_speculative import _first_tokens, _generate, assert_chained_on_the_device_equal, assert_same_distribution
from test_speculative_mtp import mtp_spec

from pocketllm import LLM, EngineArgs, SamplingParams
from pocketllm.engine.mtp_proposer import MtpProposer
from pocketllm.errors import UnsupportedFeatureError
from pocketllm.runner.mtp_head import MtpHead

ARCH = "deepseek_v4"
VOCAB = 49152
PROMPTS = [[(1000 + 7919 * (i + 1) * (n + 3)) % VOCAB for i in range(length)]
           for n, length in enumerate((5, 17, 30, 9))]
pytestmark = pytest.mark.usefixtures("one_thread")
MTP_OWN = ("enorm", "hnorm", "norm", "e_proj", "h_proj")     # the MTP layer's tensors outside its decoder block
CPU = {"device": "cpu"}
KV = {**CPU, "num_kv_blocks": 128}


def _noisy(tensor: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    if not tensor.is_floating_point() or tensor.numel() < 2:
        return tensor.clone()
    return (tensor + 0.3 * tensor.std() * torch.randn(tensor.shape, generator=generator)).contiguous()


def _mtp_weights(weights: dict[str, torch.Tensor], agree: bool) -> dict[str, torch.Tensor]:
    """The MTP layer's tensors (``mtp.0.*``) made from the tiny checkpoint's. ``agree``: a layer whose logits are
    close to the target's at the same position (``h_proj`` passes the streams through, the block adds nothing and
    mixes no stream into another, the hyper-head and norm are the target's), so that it proposes the target's last
    token again, and a target made to repeat itself often (its final norm keeps two coordinates)."""
    generator = torch.Generator().manual_seed(13)
    hidden = weights["model.embed_tokens.weight"].shape[1]
    streams = weights["model.hc_head.hc_base"].shape[0]
    out: dict[str, torch.Tensor] = {}
    for name, tensor in weights.items():
        for layer, parts in (("0", (".attn.", ".attn_norm.", ".hc_attn_")), ("1", (".ffn.", ".ffn_norm.", ".hc_ffn_"))):
            prefix = f"model.layers.{layer}."
            if name.startswith(prefix) and any(part in "." + name[len(prefix):] for part in parts):
                out["mtp.0." + name[len(prefix):]] = _noisy(tensor, generator)
    for norm in ("enorm", "hnorm", "norm"):
        out[f"mtp.0.{norm}.weight"] = 1.0 + 0.2 * torch.randn(hidden, generator=generator)
    for proj in ("e_proj", "h_proj"):
        out[f"mtp.0.{proj}.weight"] = torch.randn(hidden, hidden, generator=generator) / hidden ** 0.5
    for part in ("fn", "base", "scale"):
        out[f"mtp.0.hc_head_{part}"] = _noisy(weights[f"model.hc_head.hc_{part}"], generator)
    if agree:
        out["mtp.0.hnorm.weight"] = torch.ones(hidden)
        out["mtp.0.e_proj.weight"] = torch.zeros(hidden, hidden)
        out["mtp.0.h_proj.weight"] = torch.eye(hidden)
        for name in list(out):
            if name.endswith(("wo_b.weight", "w2.weight")):
                out[name] = torch.zeros_like(out[name])
            if name.endswith(("hc_attn_fn", "hc_ffn_fn")):
                out[name] = torch.zeros_like(out[name])
            if name.endswith(("hc_attn_base", "hc_ffn_base")):     # comb: the identity (pre, post: anything)
                base = torch.zeros_like(out[name])
                base[2 * streams:] = 30.0 * torch.eye(streams).flatten()
                out[name] = base
        for part in ("fn", "base", "scale"):
            out[f"mtp.0.hc_head_{part}"] = weights[f"model.hc_head.hc_{part}"].clone()
        final = torch.zeros(hidden)
        final[:2] = 1.0
        weights["model.norm.weight"] = final
        out["mtp.0.norm.weight"] = final.clone()
    return out


def _with_mtp_layer(source: str, out_dir: str, agree: bool, config_update: dict | None = None) -> str:
    weights = load_file(os.path.join(source, "model.safetensors"))
    weights.update(_mtp_weights(weights, agree))
    with open(os.path.join(source, "config.json"), encoding="utf-8") as handle:
        config = {**json.load(handle), "num_nextn_predict_layers": 1, **(config_update or {})}
    write_checkpoint(out_dir, config, weights, source)
    return out_dir


@pytest.fixture(scope="module")
def mtp_checkpoint(tiny_checkpoint, tmp_path_factory):
    """Factory: ``mtp_checkpoint(agree=False)`` -> the tiny DeepSeek-V4 with an MTP layer (built once each)."""
    built: dict[bool, str] = {}

    def make(agree: bool = False) -> str:
        if agree not in built:
            out = str(tmp_path_factory.mktemp(f"mtp-deepseek-{'agree' if agree else 'random'}"))
            built[agree] = _with_mtp_layer(tiny_checkpoint(ARCH), out, agree)
        return built[agree]

    return make


# ---------------------------------------------------------------------------------------------------------------
# refusals and loading


def test_refusals(tiny_checkpoint, mtp_checkpoint, tmp_path):
    # transformers' config declares one MTP layer by default; the tiny checkpoint has no weights for it.
    with pytest.raises(UnsupportedFeatureError, match="mtp.*lacks"):
        LLM(EngineArgs(model=tiny_checkpoint(ARCH), speculative_config=mtp_spec(), **KV))
    source = mtp_checkpoint()
    none = _with_mtp_layer(tiny_checkpoint(ARCH), str(tmp_path / "none"), False, {"num_nextn_predict_layers": 0})
    with pytest.raises(UnsupportedFeatureError, match="mtp.*num_nextn_predict_layers 0"):
        LLM(EngineArgs(model=none, speculative_config=mtp_spec(), **KV))
    two = _with_mtp_layer(tiny_checkpoint(ARCH), str(tmp_path / "two"), False, {"num_nextn_predict_layers": 2})
    with pytest.raises(UnsupportedFeatureError, match="mtp.*declares 2"):
        LLM(EngineArgs(model=two, speculative_config=mtp_spec(), **KV))
    # An MTP layer with a compressor: ours slides.
    weights = load_file(os.path.join(source, "model.safetensors"))
    weights["mtp.0.attn.compressor.wkv.weight"] = weights["model.layers.2.attn.compressor.wkv.weight"].clone()
    with open(os.path.join(source, "config.json"), encoding="utf-8") as handle:
        config = json.load(handle)
    compressed = str(tmp_path / "compressed")
    write_checkpoint(compressed, config, weights, source)
    with pytest.raises(UnsupportedFeatureError, match="mtp.*compresses its attention"):
        LLM(EngineArgs(model=compressed, speculative_config=mtp_spec(), **KV))
    del weights["mtp.0.attn.compressor.wkv.weight"]
    weights["mtp.0.ffn.gate.tid2eid"] = weights["model.layers.0.ffn.gate.tid2eid"].clone()
    hashed = str(tmp_path / "hashed")
    write_checkpoint(hashed, config, weights, source)
    with pytest.raises(UnsupportedFeatureError, match="mtp.*token hash"):
        LLM(EngineArgs(model=hashed, speculative_config=mtp_spec(), **KV))
    with pytest.raises(UnsupportedFeatureError, match="'mtp' runs on one rank"):
        LLM(EngineArgs(model=source, tensor_parallel_size=2, speculative_config=mtp_spec(), **KV))


def test_checkpoint_with_an_mtp_layer_runs_without_it(mtp_checkpoint, tiny_checkpoint):
    """Without ``method="mtp"`` the MTP layer's weights are skipped and the model is the one without them."""
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    with_layer, _ = _generate(EngineArgs(model=mtp_checkpoint(), **KV), PROMPTS[:2], params)
    plain, _ = _generate(EngineArgs(model=tiny_checkpoint(ARCH), **KV), PROMPTS[:2], params)
    assert [o.token_ids for o in with_layer] == [o.token_ids for o in plain]


# ---------------------------------------------------------------------------------------------------------------
# the layer against a reference computation


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def _hyper_head(streams: torch.Tensor, weights: dict, prefix: str, config) -> torch.Tensor:
    """DeepSeek-V4's hyper-head written out: sigmoid weights from the RMS-normalised flattened streams."""
    flat = streams.flatten(-2)
    mixes = (flat * torch.rsqrt(flat.pow(2).mean(-1, keepdim=True) + config.rms_norm_eps)) @ weights[prefix + "fn"].T
    pre = torch.sigmoid(mixes * weights[prefix + "scale"] + weights[prefix + "base"]) + config.hc_eps
    return (pre.unsqueeze(-1) * streams).sum(-2)


def _reference_layer(model, layer, weights: dict, next_ids: list[int], streams: torch.Tensor) -> torch.Tensor:
    """The MTP layer written out in fp32 over one sequence (positions 0..T-1): ``enorm`` of each next token's
    embedding through ``e_proj``, added to ``h_proj`` of each ``hnorm``-ed stream; transformers' own decoder block
    (``layer``, a sliding score-routed one, causal over the sequence). Returns the output streams [T, hc, D]."""
    config = model.config
    eps = config.rms_norm_eps
    ids = torch.tensor([next_ids])
    embedded = _rms(model.model.embed_tokens(ids), weights["mtp.0.enorm.weight"], eps)
    x = (embedded @ weights["mtp.0.e_proj.weight"].T).unsqueeze(2) + \
        _rms(streams[None], weights["mtp.0.hnorm.weight"], eps) @ weights["mtp.0.h_proj.weight"].T
    length = x.shape[1]
    positions = torch.arange(length)[None]
    rotary = {label: model.model.rotary_emb(x[:, :, 0], position_ids=positions, layer_type=label)
              for label in ("main", "compress")}
    offset = positions[0][:, None] - positions[0][None, :]
    allowed = (offset >= 0) & (offset < config.sliding_window)
    mask = torch.zeros(length, length).masked_fill(~allowed, float("-inf"))[None, None]
    out = layer(x, position_embeddings=rotary, position_ids=positions, attention_mask=mask, input_ids=ids,
                cache=None)
    return (out[0] if isinstance(out, tuple) else out)[0]


def _block_state(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The MTP layer's decoder-block tensors (``mtp.0.*`` but its own norms, projections and hyper-head) as
    transformers' decoder layer names them, its routed experts stacked."""
    from pocketllm.models.deepseek_v4 import UPSTREAM_RENAMES

    state: dict[str, torch.Tensor] = {}
    experts: dict[int, dict[str, torch.Tensor]] = {}
    for name, tensor in weights.items():
        rest = name.removeprefix("mtp.0.")
        if rest == name or rest.split(".")[0] in MTP_OWN or rest.startswith("hc_head_"):
            continue
        renamed = "layers.0." + rest
        for pattern, replacement in UPSTREAM_RENAMES:
            renamed = pattern.sub(replacement, renamed)
        renamed = renamed.removeprefix("layers.0.").replace("self_attn.norm.weight", "self_attn.kv_norm.weight")
        if renamed.startswith("mlp.experts."):
            index, part, _ = renamed.removeprefix("mlp.experts.").split(".")
            experts.setdefault(int(index), {})[part] = tensor
        else:
            state[renamed] = tensor
    order = sorted(experts)
    state["mlp.experts.gate_up_proj"] = torch.stack([torch.cat([experts[e]["gate_proj"], experts[e]["up_proj"]])
                                                    for e in order])
    state["mlp.experts.down_proj"] = torch.stack([experts[e]["down_proj"] for e in order])
    return state


def test_layer_matches_a_reference_computation(mtp_checkpoint, hf_reference, monkeypatch):
    """fp32: the layer's output streams and logits over a prompt (the target's last streams, each position with
    the next token) and at a chained proposal (the layer's own streams and first proposal) equal the formula
    written out with transformers' target and decoder block (a sliding, score-routed block carrying the MTP
    layer's weights), the hyper-head and norms by hand."""
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4DecoderLayer

    path = mtp_checkpoint()
    weights = load_file(os.path.join(path, "model.safetensors"))
    target = hf_reference.model(path)
    config = target.config
    # transformers builds no MTP layer: a block of the MTP layer's kind (layer 0's sliding attention, layer 1's
    # score-routed experts) loaded with its weights stands in.
    block_config = type(config).from_dict({**config.to_dict(), "mlp_layer_types": ["moe"] * config.num_hidden_layers})
    layer = DeepseekV4DecoderLayer(block_config, 0).float().eval()
    missing, unexpected = layer.load_state_dict(_block_state(weights), strict=False)
    assert not unexpected and not missing, (missing, unexpected)

    calls: list[tuple[list[int], list[int], torch.Tensor]] = []
    forward = MtpHead.forward

    def recording(self, host, hidden):
        out = forward(self, host, hidden)
        calls.append((list(host.input_ids), list(host.positions), out.clone()))
        return out

    scored: list[torch.Tensor] = []
    head_logits = MtpHead.logits

    def recording_logits(self, hidden):
        out = head_logits(self, hidden)
        scored.append(out.clone())
        return out

    monkeypatch.setattr(MtpHead, "forward", recording)
    monkeypatch.setattr(MtpHead, "logits", recording_logits)
    prompt = PROMPTS[2]
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    with LLM(EngineArgs(model=path, speculative_config=mtp_spec(2), **KV)) as llm:
        first = llm.generate([prompt], params)[0].token_ids[0]
    n = len(prompt)
    (ids_a, positions_a, out_a), (ids_b, positions_b, out_b) = calls[:2]
    assert ids_a == prompt[1:] + [first] and positions_a == list(range(n))
    captured = {}
    hook = target.model.hc_head.register_forward_hook(lambda module, args, _: captured.setdefault("s", args[0]))
    with torch.no_grad():
        target.model(torch.tensor([prompt]))
        hook.remove()
        streams = captured["s"][0]
        expected_a = _reference_layer(target, layer, weights, ids_a, streams)

        def logits(out: torch.Tensor) -> torch.Tensor:
            collapsed = _hyper_head(out, weights, "mtp.0.hc_head_", config)
            return target.lm_head(_rms(collapsed, weights["mtp.0.norm.weight"], config.rms_norm_eps))

        logits_a = logits(expected_a)
        proposal = int(logits_a[-1].argmax())
        assert ids_b == [proposal] and positions_b == [n]
        expected_b = _reference_layer(target, layer, weights, ids_a + [proposal],
                                      torch.cat([streams, expected_a[-1:]]))[-1:]
        torch.testing.assert_close(out_a, expected_a, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(out_b, expected_b, atol=1e-4, rtol=1e-4)
        # The engine's logits (the layer's hyper-head, norm and the LM head) of the first and chained proposals.
        torch.testing.assert_close(scored[0], logits_a[-1:], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(scored[1], logits(expected_b), atol=1e-4, rtol=1e-4)


# ---------------------------------------------------------------------------------------------------------------
# greedy: token for token


REGIMES = {
    "default": KV,
    "chunked-5": {**KV, "max_num_batched_tokens": 5},
    "preemption": {**CPU, "num_kv_blocks": 24, "block_size": 4, "max_num_batched_tokens": 24},
}


@pytest.mark.parametrize("regime", sorted(REGIMES))
def test_greedy_equal_with_the_mtp_layer(regime, mtp_checkpoint):
    """Batched prompts of mixed lengths (within and past the 8-token window and the compression rates 4 and 8),
    greedy: the tokens of the engine without speculation, with a random MTP layer (hardly a proposal kept: the
    target's compressed layers roll back their open windows after nearly every verify step) and with one that
    agrees with a target that often repeats (many kept, some not)."""
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    for agree in (False, True):
        args = EngineArgs(model=mtp_checkpoint(agree), **REGIMES[regime])
        plain, _ = _generate(args, PROMPTS, params)
        spec, stats = _generate(args.replace(speculative_config=mtp_spec()), PROMPTS, params)
        assert [o.token_ids for o in spec] == [o.token_ids for o in plain], agree
        assert stats["spec_verify_chunks"] > 0
        if agree:
            assert 0 < stats["spec_accepted_tokens"] < stats["spec_proposed_tokens"]
        if regime == "preemption":
            assert stats["num_preemptions"] > 0


@pytest.mark.parametrize("regime", ["default", "chunked-5", "preemption"])
def test_greedy_equal_with_verify_steps_as_the_cuda_graphs_run_them(regime, mtp_checkpoint):
    """Verify steps as CUDA graphs run them (``runner/reference_graphs.py``), eagerly here: a step's chunks laid out
    as a grid (as many rows for each sequence as its longest chunk, a chunk's rows past its end repeating its last
    one, the sequences padded to the bucket with copies of the first), each position's states copied to its
    checkpoint inside the grid. With the agreeing MTP layer (proposals kept, some rejected: the compressed layers'
    states rolled back to those checkpoints) the tokens are those of the engine without speculation, and the
    layer, reading the grid's hidden states back in the batch's order, proposes and keeps what it does when the
    steps run as the batch lists them; also where prompt chunks (a 5-token prefill budget) run eagerly beside the
    grid and the two parts' hidden states are joined."""
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    args = EngineArgs(model=mtp_checkpoint(True), **REGIMES[regime])
    plain, _ = _generate(args, PROMPTS, params)
    eager, eager_stats = _generate(args.replace(speculative_config=mtp_spec()), PROMPTS, params)
    with LLM(args.replace(speculative_config=mtp_spec())) as llm:
        step = use_graph_steps(llm)
        spec = llm.generate(PROMPTS, params)
        stats = llm.stats()
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain] == [o.token_ids for o in eager]
    assert step.verify_steps > 0 and 0 < stats["spec_accepted_tokens"] < stats["spec_proposed_tokens"]
    counts = ("spec_verify_chunks", "spec_proposed_tokens", "spec_accepted_tokens")
    assert [stats[c] for c in counts] == [eager_stats[c] for c in counts]
    if regime == "chunked-5":
        assert step.split_steps > 0
    if regime == "preemption":
        assert stats["num_preemptions"] > 0


@pytest.mark.gpu
def test_mtp_on_cuda_replays_verify_grids(mtp_checkpoint):
    """On CUDA (float32): the target's decode and verify steps replayed from the reference step's graphs give the
    tokens of the engine without speculation, and the agreeing MTP layer proposes and keeps what it does with
    every step eager."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    args = EngineArgs(model=mtp_checkpoint(True), device="cuda", dtype="float32", num_kv_blocks=128, max_num_seqs=8)
    plain, _ = _generate(args, PROMPTS, params)
    spec, stats = _generate(args.replace(speculative_config=mtp_spec()), PROMPTS, params)
    _, eager = _generate(args.replace(speculative_config=mtp_spec(), enforce_eager=True), PROMPTS, params)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    assert stats["spec_graph_steps"] > 0 and eager["spec_graph_steps"] == 0
    counts = ("spec_verify_chunks", "spec_proposed_tokens", "spec_accepted_tokens")
    assert [stats[c] for c in counts] == [eager[c] for c in counts]


@pytest.mark.parametrize("regime", ["default", "chunked-5", "preemption", "pipelined"])
def test_greedy_equal_with_mixed_verify_grids(regime, tiny_checkpoint):
    """Grids of verify chunks of different lengths beside plain decode rows (an oracle proposer that proposes up to
    four tokens, some wrong, and nothing every other call), run as the CUDA graphs run them: the rows past a
    shorter chunk repeat its last position, whose window may close there, without paging that window's entry
    again. Pipelined (``async_scheduling="on"``): a verify chunk's first token is still pending when its grid is
    laid out. With a 5-token prefill budget, prompt chunks run eagerly beside the grid. The tokens are those of
    the engine without speculation."""
    from test_speculative import NGRAM, OracleProposer

    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    engine = {**KV, "async_scheduling": "on"} if regime == "pipelined" else REGIMES[regime]
    args = EngineArgs(model=tiny_checkpoint(ARCH), **engine)
    plain, _ = _generate(args, PROMPTS, params)
    with LLM(args.replace(speculative_config=NGRAM)) as llm:
        step = use_graph_steps(llm)
        # (Pipelined: proposals only while a plain step runs, so that every verify chunk starts with a pending
        # token, in every sequence of its grid.)
        llm._client.backend.core.scheduler.proposer = OracleProposer(
            {tuple(p): o.token_ids for p, o in zip(PROMPTS, plain)}, pause_every=1 if regime == "pipelined" else 2)
        spec = llm.generate(PROMPTS, params)
        stats = llm.stats()
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    assert step.verify_steps > 0 and 0 < stats["spec_accepted_tokens"] < stats["spec_proposed_tokens"]
    if regime == "preemption":
        assert stats["num_preemptions"] > 0
    if regime == "pipelined":
        assert stats["spec_pipelined_verify_chunks"] > 0
    if regime == "chunked-5":
        assert step.split_steps > 0


@pytest.mark.parametrize("agree", [False, True])
def test_greedy_proposals_chained_on_the_device(agree, mtp_checkpoint, monkeypatch):
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    assert_chained_on_the_device_equal(MtpProposer, EngineArgs(model=mtp_checkpoint(agree), **KV), mtp_spec(),
                                       PROMPTS, params, monkeypatch)


# ---------------------------------------------------------------------------------------------------------------
# sampling: in distribution against the plain sampler


def test_seeded_sampling_with_the_mtp_layer_is_distribution_correct(mtp_checkpoint):
    """The first four tokens of many seeded draws with and without the agreeing MTP layer (proposals kept,
    rejected with a residual draw, and kept in full with a bonus token; the second from a chained step) come from
    one distribution: a chi-square two-sample test, rare outcomes pooled."""
    params = SamplingParams(max_tokens=4, temperature=1.0, top_k=3, ignore_eos=True)
    args = EngineArgs(model=mtp_checkpoint(agree=True), max_num_seqs=64, **KV)
    draws = 800
    plain, _ = _first_tokens(args, PROMPTS[0], draws, params)
    spec, stats = _first_tokens(args.replace(speculative_config=mtp_spec(2)), PROMPTS[0], draws, params)
    assert stats["spec_proposed_tokens"] > stats["spec_verify_chunks"]     # chained proposals too
    assert stats["spec_verify_chunks"] > 0 and 0 < stats["spec_accepted_tokens"] < stats["spec_proposed_tokens"]
    assert_same_distribution(plain, spec)


def test_greedy_equal_with_ngram_proposals(tiny_checkpoint):
    """The target's own rollback with any proposer: prompt-lookup proposals on repeating prompts, greedy, with
    preemption — the compressed layers' open windows go back to their state after the last kept position."""
    prompts = [[(311 * (i % period) + 7) % VOCAB for i in range(length)]
               for period, length in ((3, 14), (5, 27), (4, 9))]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    for regime in ("default", "preemption"):
        args = EngineArgs(model=tiny_checkpoint(ARCH), **REGIMES[regime])
        plain, _ = _generate(args, prompts, params)
        ngram = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
        spec, stats = _generate(args.replace(speculative_config=ngram), prompts, params)
        assert [o.token_ids for o in spec] == [o.token_ids for o in plain], regime
        assert stats["spec_verify_chunks"] > 0 and stats["spec_accepted_tokens"] < stats["spec_proposed_tokens"]
