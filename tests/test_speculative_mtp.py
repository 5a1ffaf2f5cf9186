"""Speculative decoding with the checkpoint's MTP head (``method="mtp"``, Qwen3.5 dense and MoE): the head
against a reference computation (fp32, its decoder layer from transformers), refusals, greedy outputs equal to
the engine's without speculation (batched with mixed lengths, chunked prefill, preemption), a head made to agree
with the target keeping proposals, and seeded sampling in distribution."""

from __future__ import annotations

import json
import os

import pytest
import torch
from conftest import write_checkpoint
from safetensors.torch import load_file
from test_speculative import _first_tokens, _generate, assert_chained_on_the_device_equal, assert_same_distribution

from pocketllm import LLM, EngineArgs, SamplingParams
from pocketllm.engine.mtp_proposer import MtpProposer
from pocketllm.errors import UnsupportedFeatureError
from pocketllm.runner.mtp_head import MtpHead

ARCHS = ("qwen3_5_text", "qwen3_5_moe_text")
FULL_LAYER = 3          # the tiny Qwen3.5's full-attention layer, the MTP layer's model
PROMPTS = [[(1000 + 7919 * (i + 1) * (n + 3)) % 49152 for i in range(length)]
           for n, length in enumerate((5, 17, 40, 9))]
KV = {"num_kv_blocks": 128, "backend": "torch"}   # the Torch engine's MTP (auto could run Qwen3.5 natively)


pytestmark = pytest.mark.usefixtures("one_thread")


def mtp_spec(k: int = 3) -> dict:
    return {"method": "mtp", "num_speculative_tokens": k}


def _with_mtp_head(source: str, out_dir: str, agree: bool, layers: int = 1) -> str:
    """A copy of the tiny Qwen3.5 checkpoint ``source`` with an MTP head (``mtp.*``, HF names): its layer the
    full-attention layer's weights with noise, ``fc`` and the norms random. ``agree``: a head whose logits
    are the target's at the same position (``fc`` passes the hidden state through, the layer adds nothing, the
    norms are plain), so that it proposes the target's last token again, and a target made to repeat itself often
    (its final norm keeps two coordinates of the hidden state, so that its greedy tokens come from a handful)."""
    weights = load_file(os.path.join(source, "model.safetensors"))
    generator = torch.Generator().manual_seed(11)
    hidden = weights["model.embed_tokens.weight"].shape[1]
    prefix = f"model.layers.{FULL_LAYER}."
    for name, tensor in list(weights.items()):
        if name.startswith(prefix):
            noise = 0.3 * tensor.std() * torch.randn(tensor.shape, generator=generator) if tensor.numel() > 1 else 0
            weights["mtp.layers.0." + name[len(prefix):]] = (tensor + noise).contiguous()
    norms = ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm")
    for norm in norms:
        weights[f"mtp.{norm}.weight"] = 0.2 * torch.randn(hidden, generator=generator)
    weights["mtp.fc.weight"] = torch.randn(hidden, 2 * hidden, generator=generator) / (2 * hidden) ** 0.5
    if agree:
        for norm in norms:
            weights[f"mtp.{norm}.weight"] = torch.zeros(hidden)
        weights["mtp.fc.weight"] = torch.cat([torch.zeros(hidden, hidden), torch.eye(hidden)], dim=1)
        for name in weights:
            if name.startswith("mtp.layers.0.") and name.endswith(("o_proj.weight", "down_proj.weight",
                                                                     "experts.down_proj")):
                weights[name] = torch.zeros_like(weights[name])
        final = -torch.ones(hidden)     # (an offset norm: a scale of 1 + weight)
        final[:2] = 0.0
        weights["model.norm.weight"] = final
    with open(os.path.join(source, "config.json"), encoding="utf-8") as handle:
        config = {**json.load(handle), "mtp_num_hidden_layers": layers}
    write_checkpoint(out_dir, config, weights, source)
    return out_dir


@pytest.fixture(scope="module")
def mtp_checkpoint(tiny_checkpoint, tmp_path_factory):
    """Factory: ``mtp_checkpoint(arch, agree=False)`` -> the tiny Qwen3.5 ``arch`` with an MTP head (built once)."""
    built: dict[tuple[str, bool], str] = {}

    def make(arch: str, agree: bool = False) -> str:
        if (arch, agree) not in built:
            out = str(tmp_path_factory.mktemp(f"mtp-{arch}-{'agree' if agree else 'random'}"))
            built[arch, agree] = _with_mtp_head(tiny_checkpoint(arch), out, agree)
        return built[arch, agree]

    return make


# ---------------------------------------------------------------------------------------------------------------
# refusals


def test_refusals(tiny_checkpoint, mtp_checkpoint, tmp_path):
    with pytest.raises(UnsupportedFeatureError, match="mtp.*Qwen3.5"):
        LLM(EngineArgs(model=tiny_checkpoint("llama"), speculative_config=mtp_spec()))
    with pytest.raises(UnsupportedFeatureError, match="mtp.*mtp_num_hidden_layers 0"):
        LLM(EngineArgs(model=tiny_checkpoint("qwen3_5_text"), speculative_config=mtp_spec(), **KV))
    # The config declares the head, the weights lack it.
    source = tiny_checkpoint("qwen3_5_text")
    with open(os.path.join(source, "config.json"), encoding="utf-8") as handle:
        config = {**json.load(handle), "mtp_num_hidden_layers": 1}
    bare = str(tmp_path / "no-head-weights")
    write_checkpoint(bare, config, load_file(os.path.join(source, "model.safetensors")), source)
    with pytest.raises(UnsupportedFeatureError, match="mtp.*lacks"):
        LLM(EngineArgs(model=bare, speculative_config=mtp_spec(), **KV))
    with pytest.raises(UnsupportedFeatureError, match="'mtp' runs on one rank"):
        LLM(EngineArgs(model=mtp_checkpoint("qwen3_5_text"), tensor_parallel_size=2, speculative_config=mtp_spec()))


def test_checkpoint_with_a_head_runs_without_it(mtp_checkpoint, tiny_checkpoint):
    """Without ``method="mtp"`` the head's weights are skipped and the model is the one without them."""
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    with_head, _ = _generate(EngineArgs(model=mtp_checkpoint("qwen3_5_text"), **KV), PROMPTS[:2], params)
    plain, _ = _generate(EngineArgs(model=tiny_checkpoint("qwen3_5_text"), **KV), PROMPTS[:2], params)
    assert [o.token_ids for o in with_head] == [o.token_ids for o in plain]


def test_conditional_generation_checkpoint_with_stacked_experts(mtp_checkpoint, tmp_path):
    """The head of a ``Qwen3_5MoeForConditionalGeneration`` checkpoint: the text weights under
    ``model.language_model.``, the head's under ``mtp.`` at the top, every layer's experts stacked (one tensor
    per layer, the head's too); greedy output and acceptance are the text checkpoint's."""
    source = mtp_checkpoint("qwen3_5_moe_text", agree=True)
    with open(os.path.join(source, "config.json"), encoding="utf-8") as handle:
        text_config = json.load(handle)
    config = {"architectures": ["Qwen3_5MoeForConditionalGeneration"], "model_type": "qwen3_5_moe",
              "text_config": text_config, "tie_word_embeddings": False,
              "vision_config": {"depth": 1, "hidden_size": 16, "num_heads": 2, "intermediate_size": 32,
                                "out_hidden_size": text_config["hidden_size"]}}
    weights: dict[str, torch.Tensor] = {}
    experts: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    for name, tensor in load_file(os.path.join(source, "model.safetensors")).items():
        if ".mlp.experts." in name:     # PREFIX.mlp.experts.E.{gate,up,down}_proj.weight
            prefix, rest = name.split(".mlp.experts.")
            index, part, _ = rest.split(".")
            experts.setdefault(prefix, {}).setdefault(int(index), {})[part] = tensor
            continue
        weights[name if name.startswith("mtp.") else name.replace("model.", "model.language_model.", 1)] = tensor
    assert any(prefix.startswith("mtp.") for prefix in experts)
    for prefix, by_expert in experts.items():
        stacked = prefix if prefix.startswith("mtp.") else prefix.replace("model.", "model.language_model.", 1)
        order = sorted(by_expert)
        weights[f"{stacked}.mlp.experts.gate_up_proj"] = torch.stack(
            [torch.cat([by_expert[e]["gate_proj"], by_expert[e]["up_proj"]]) for e in order])
        weights[f"{stacked}.mlp.experts.down_proj"] = torch.stack([by_expert[e]["down_proj"] for e in order])
    directory = str(tmp_path / "conditional")
    write_checkpoint(directory, config, weights, source)
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    text, text_stats = _generate(EngineArgs(model=source, speculative_config=mtp_spec(), **KV), PROMPTS, params)
    nested, stats = _generate(EngineArgs(model=directory, speculative_config=mtp_spec(), **KV), PROMPTS, params)
    assert [o.token_ids for o in nested] == [o.token_ids for o in text]
    assert stats["spec_accepted_tokens"] == text_stats["spec_accepted_tokens"] > 0


# ---------------------------------------------------------------------------------------------------------------
# the head against a reference computation


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Qwen3.5's offset RMSNorm in float32: ``x / rms(x) * (1 + weight)``."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + weight)


def _reference_head(model, layer, weights: dict, next_ids: list[int], hidden: torch.Tensor) -> torch.Tensor:
    """The MTP head written out in fp32 over one sequence (positions 0..T-1): the embedding of each next token
    and the hidden state, each normed, concatenated (embedding first) through ``fc``; transformers' own decoder
    layer (``layer``, causal over the sequence); the final norm. Returns the normed hidden states [T, H]."""
    eps = model.config.rms_norm_eps
    embedded = model.model.embed_tokens(torch.tensor(next_ids))
    joined = torch.cat([_rms(embedded, weights["mtp.pre_fc_norm_embedding.weight"], eps),
                        _rms(hidden, weights["mtp.pre_fc_norm_hidden.weight"], eps)], dim=-1)
    x = (joined @ weights["mtp.fc.weight"].T)[None]
    length = x.shape[1]
    positions = torch.arange(length)[None]
    rotary = model.model.rotary_emb(x, positions[None].expand(3, 1, -1))
    mask = torch.full((length, length), float("-inf")).triu(1)[None, None]
    out = layer(x, position_embeddings=rotary, attention_mask=mask, position_ids=positions)
    out = out[0] if isinstance(out, tuple) else out
    return _rms(out[0], weights["mtp.norm.weight"], eps)


@pytest.mark.parametrize("arch", ARCHS)
def test_head_matches_a_reference_computation(arch, mtp_checkpoint, hf_reference, tmp_path, monkeypatch):
    """fp32: the head's hidden states and logits over a prompt (the target's hidden states, each position with
    the next token) and at a chained proposal (the head's own hidden state and first proposal) equal the formula
    written out with transformers' target and decoder layer (the MTP layer's weights put in its place)."""
    path = mtp_checkpoint(arch)
    weights = load_file(os.path.join(path, "model.safetensors"))
    # transformers has no MTP head: its full-attention layer carrying the MTP layer's weights stands in.
    swapped = {name: tensor for name, tensor in weights.items() if not name.startswith("mtp.")}
    for name, tensor in weights.items():
        if name.startswith("mtp.layers.0."):
            swapped[f"model.layers.{FULL_LAYER}." + name.removeprefix("mtp.layers.0.")] = tensor
    with open(os.path.join(path, "config.json"), encoding="utf-8") as handle:
        config = json.load(handle)
    write_checkpoint(str(tmp_path / "swapped"), config, swapped, path)
    layer = hf_reference.model(str(tmp_path / "swapped")).model.layers[FULL_LAYER]
    target = hf_reference.model(path)

    calls: list[tuple[list[int], list[int], torch.Tensor]] = []
    forward = MtpHead.forward

    def recording(self, host, hidden):
        out = forward(self, host, hidden)
        calls.append((list(host.input_ids), list(host.positions), out.clone()))
        return out

    monkeypatch.setattr(MtpHead, "forward", recording)
    prompt = PROMPTS[3]
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    with LLM(EngineArgs(model=path, speculative_config=mtp_spec(2), **KV)) as llm:
        first = llm.generate([prompt], params)[0].token_ids[0]
    n = len(prompt)
    (ids_a, positions_a, out_a), (ids_b, positions_b, out_b) = calls[:2]
    assert ids_a == prompt[1:] + [first] and positions_a == list(range(n))
    with torch.no_grad():
        hidden = target.model(torch.tensor([prompt])).last_hidden_state[0]
        expected_a = _reference_head(target, layer, weights, ids_a, hidden)
        logits_a = target.lm_head(expected_a)
        proposal = int(logits_a[-1].argmax())
        assert ids_b == [proposal] and positions_b == [n]
        expected_b = _reference_head(target, layer, weights, ids_a + [proposal],
                                     torch.cat([hidden, expected_a[-1:]]))[-1:]
        logits_b = target.lm_head(expected_b)
        torch.testing.assert_close(out_a, expected_a, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(out_b, expected_b, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(target.lm_head(out_a), logits_a, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(target.lm_head(out_b), logits_b, atol=1e-4, rtol=1e-4)


# ---------------------------------------------------------------------------------------------------------------
# greedy: token for token


REGIMES = {
    "default": KV,
    "chunked-16": {**KV, "max_num_batched_tokens": 16},
    "no-chunking": {**KV, "enable_chunked_prefill": False},
    "preemption": {"num_kv_blocks": 24, "block_size": 4, "max_num_batched_tokens": 24, "backend": "torch"},
}


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("regime", sorted(REGIMES))
def test_greedy_equal_with_the_mtp_head(arch, regime, mtp_checkpoint, tiny_checkpoint):
    """Batched prompts of mixed lengths, greedy: the tokens of the engine without speculation, with a random head
    (hardly a proposal kept) and with a head that agrees with a target that often repeats (many kept, some not)."""
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    for agree in (False, True):
        args = EngineArgs(model=mtp_checkpoint(arch, agree), **REGIMES[regime])
        plain, _ = _generate(args, PROMPTS, params)
        spec, stats = _generate(args.replace(speculative_config=mtp_spec()), PROMPTS, params)
        assert [o.token_ids for o in spec] == [o.token_ids for o in plain], agree
        assert stats["spec_verify_chunks"] > 0
        if agree:
            assert 0 < stats["spec_accepted_tokens"] < stats["spec_proposed_tokens"]
        if regime == "preemption":
            assert stats["num_preemptions"] > 0


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("agree", [False, True])
def test_greedy_proposals_chained_on_the_device(arch, agree, mtp_checkpoint, monkeypatch):
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    assert_chained_on_the_device_equal(MtpProposer, EngineArgs(model=mtp_checkpoint(arch, agree), **KV),
                                       mtp_spec(), PROMPTS, params, monkeypatch)


def test_a_verify_chunk_without_head_state_decodes_one_token(mtp_checkpoint, monkeypatch):
    """A verify chunk whose request has no head state at the position before it (none is ever missing while the
    head follows every step; here every other step's states are dropped) decodes one token instead: the same
    greedy tokens, with fewer verify chunks."""
    advance = MtpProposer.advance
    calls = [0]

    def forgetful(self, chunks, emitted):
        advance(self, chunks, emitted)
        calls[0] += 1
        if calls[0] % 2:
            self._states.clear()

    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    args = EngineArgs(model=mtp_checkpoint("qwen3_5_text", agree=True), speculative_config=mtp_spec(), **KV)
    full, full_stats = _generate(args, PROMPTS, params)
    monkeypatch.setattr(MtpProposer, "advance", forgetful)
    spec, stats = _generate(args, PROMPTS, params)
    assert [o.token_ids for o in spec] == [o.token_ids for o in full]
    assert 0 < stats["spec_verify_chunks"] < full_stats["spec_verify_chunks"]


def test_budget_logprobs_and_stop_tokens(mtp_checkpoint):
    """However many proposals are kept, a request emits at most max_tokens, stops at a stop token (inside a verify
    step's accepted run too), and its log-probabilities are those of the engine without speculation."""
    args = EngineArgs(model=mtp_checkpoint("qwen3_5_text", agree=True), **KV)
    long = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=2)
    plain, _ = _generate(args, PROMPTS, long)
    stop_at = plain[0].token_ids[9]
    cases = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, logprobs=2) for n in (1, 2, 5)]
    cases.append(SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=2, stop_token_ids=[stop_at]))
    with LLM(args.replace(speculative_config=mtp_spec(4))) as llm:
        for params in cases:
            for out, ref in zip(llm.generate(PROMPTS, params), plain):
                expected = ref.token_ids[:params.max_tokens]
                if params.stop_token_ids and stop_at in expected:
                    expected = expected[:expected.index(stop_at)]   # (a stop token is not returned)
                assert out.token_ids == expected
                for a, b in zip(out.logprobs, ref.logprobs):
                    assert a.token_id == b.token_id and abs(a.logprob - b.logprob) < 1e-4
        assert llm.stats()["spec_accepted_tokens"] > 0


def test_bench_reports_the_acceptance_length_with_forced_acceptance(mtp_checkpoint, monkeypatch, capsys):
    """The mechanics' benchmark with the head: random weights (``load_format="dummy"``, the head's drawn with the
    rest), every proposal kept, so that the reported acceptance length is exactly k + 1."""
    from argparse import Namespace

    from pocketllm.bench import speculative

    monkeypatch.setattr(speculative, "PROMPT_SETS", {"chat": ("Hello",)})
    path = mtp_checkpoint("qwen3_5_moe_text")
    spec = {**mtp_spec(2), "forced_acceptance": True}
    args = Namespace(output_len=10, num_iters=1, output_json=None)
    result = speculative.run(args, EngineArgs(model=path, load_format="dummy", speculative_config=spec, **KV))
    assert result["sets"]["chat"]["with"]["mean_acceptance_length"] == 3.0
    assert "mean acceptance length 3.00" in capsys.readouterr().out


# ---------------------------------------------------------------------------------------------------------------
# sampling: in distribution against the plain sampler


def test_seeded_sampling_with_the_mtp_head_is_distribution_correct(mtp_checkpoint):
    """The first four tokens of many seeded draws with and without the head (the agreeing one: its q is the
    target's distribution one position earlier, so proposals are kept, rejected with a residual draw, and kept in
    full with a bonus token; the second proposal comes from a chained step) come from one distribution: a
    chi-square two-sample test, rare outcomes pooled."""
    params = SamplingParams(max_tokens=4, temperature=1.0, top_k=3, ignore_eos=True)
    args = EngineArgs(model=mtp_checkpoint("qwen3_5_text", agree=True), max_num_seqs=64, **KV)
    draws = 1200
    plain, _ = _first_tokens(args, PROMPTS[0], draws, params)
    spec, stats = _first_tokens(args.replace(speculative_config=mtp_spec(2)), PROMPTS[0], draws, params)
    assert stats["spec_proposed_tokens"] > stats["spec_verify_chunks"]     # chained proposals too
    assert stats["spec_verify_chunks"] > 0 and 0 < stats["spec_accepted_tokens"] < stats["spec_proposed_tokens"]
    assert_same_distribution(plain, spec)


@pytest.mark.gpu
def test_mtp_on_cuda_greedy_equal(mtp_checkpoint):
    """On CUDA (float32; the target on the kernel path, its verify steps replayed from the decode graphs, which keep
    their rows' hidden states for the head; the head's attention on the reference path): greedy output equals the
    engine's without speculation, dense and MoE, with a random and an agreeing head; and the head proposes and
    keeps what it does when every step runs eagerly (it read the graphs' hidden states of the right rows)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    counts = ("spec_verify_chunks", "spec_proposed_tokens", "spec_accepted_tokens")
    for arch in ARCHS:
        for agree in (False, True):
            args = EngineArgs(model=mtp_checkpoint(arch, agree), device="cuda", dtype="float32", max_num_seqs=8,
                              **KV)
            plain, _ = _generate(args, PROMPTS, params)
            spec, stats = _generate(args.replace(speculative_config=mtp_spec()), PROMPTS, params)
            _, eager = _generate(args.replace(speculative_config=mtp_spec(), enforce_eager=True), PROMPTS, params)
            assert [o.token_ids for o in spec] == [o.token_ids for o in plain], (arch, agree)
            assert stats["spec_verify_chunks"] > 0 and stats["spec_graph_steps"] > 0
            assert [stats[c] for c in counts] == [eager[c] for c in counts], (arch, agree)
            if agree:
                assert stats["spec_accepted_tokens"] > 0
