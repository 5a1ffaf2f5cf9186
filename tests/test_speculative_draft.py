"""Speculative decoding with a draft model (``method="draft_model"``): the acceptance rule with the draft's
distributions, refusals at load, greedy outputs equal to the engine's without speculation (a draft that agrees
with the target, one that mostly does not, batched with mixed lengths, preemption, penalties, prefix caching,
stop strings), seeded sampling in distribution, the default model drafting for itself, and the benchmark's
forced-acceptance mode."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os

import pytest
import torch
from conftest import write_checkpoint
from test_speculative import (
    _chi_square_bound,
    _first_tokens,
    _generate,
    assert_chained_on_the_device_equal,
    assert_same_distribution,
)

from pocketllm import LLM, AsyncLLM, EngineArgs, SamplingParams
from pocketllm.engine.draft_proposer import DraftProposer
from pocketllm.errors import InvalidRequestError, UnsupportedFeatureError
from pocketllm.runner.sampler import Sampler
from pocketllm.runner.spec_verify import accept

TINY_PROMPTS = [[7, 8, 9, 10, 7, 8, 9, 10, 7, 8], [300, 301, 302, 303, 304], [5, 6, 7, 8] * 6, [901, 17, 901, 17],
                list(range(1000, 1037))]


def draft(path: str, k: int = 3, **extra: object) -> dict:
    return {"method": "draft_model", "model": path, "num_speculative_tokens": k, **extra}


def _copy_with(source: str, out_dir: str, config_changes: dict | None = None, noise: float = 0.0,
               tokenizer_swap: tuple[str, str] | None = None) -> str:
    """A copy of the tiny checkpoint ``source``: its config changed, its weights perturbed by ``noise`` (relative,
    seeded), or two tokens' ids swapped in its tokenizer."""
    from safetensors.torch import load_file

    weights = load_file(os.path.join(source, "model.safetensors"))
    generator = torch.Generator().manual_seed(3)
    if noise:
        weights = {name: w + noise * w.std() * torch.randn(w.shape, generator=generator) if w.dim() > 1 else w
                   for name, w in weights.items()}
    with open(os.path.join(source, "config.json"), encoding="utf-8") as handle:
        config = {**json.load(handle), **(config_changes or {})}
    if "vocab_size" in (config_changes or {}):
        rows = config["vocab_size"]
        weights = {name: torch.cat([w, w[:rows - w.shape[0]]]) if w.shape[0] == 49152 else w
                   for name, w in weights.items()}
    write_checkpoint(out_dir, config, weights, source)
    if tokenizer_swap is not None:
        path = os.path.join(out_dir, "tokenizer.json")
        with open(path, encoding="utf-8") as handle:
            tokenizer = json.load(handle)
        vocab = tokenizer["model"]["vocab"]
        a, b = tokenizer_swap
        vocab[a], vocab[b] = vocab[b], vocab[a]
        with open(path, "w", encoding="utf-8") as handle:
            json.dump(tokenizer, handle)
    return out_dir


@pytest.fixture(scope="module")
def near_llama(tiny_checkpoint, tmp_path_factory) -> str:
    """The tiny Llama with every matrix perturbed: a draft that agrees with it often, not always."""
    return _copy_with(tiny_checkpoint("llama"), str(tmp_path_factory.mktemp("near-llama")), noise=0.05)


# ---------------------------------------------------------------------------------------------------------------
# configuration and refusals


def test_forced_acceptance_needs_dummy_weights():
    with pytest.raises(InvalidRequestError, match="forced_acceptance") as info:
        EngineArgs(speculative_config=draft("x", forced_acceptance=True))
    assert info.value.param == "speculative_config"
    with pytest.raises(InvalidRequestError, match="forced_acceptance"):
        EngineArgs(load_format="dummy", speculative_config=draft("x", forced_acceptance=1))
    spec = EngineArgs(load_format="dummy", speculative_config=draft("x", forced_acceptance=True)).speculative_config
    assert spec.forced_acceptance and spec.to_dict()["forced_acceptance"] is True
    assert "forced_acceptance" not in EngineArgs(speculative_config=draft("x")).speculative_config.to_dict()


def test_other_vocabulary_or_tokenizer_is_refused(tiny_checkpoint, tmp_path):
    llama = tiny_checkpoint("llama")
    wider = _copy_with(llama, str(tmp_path / "wider"), {"vocab_size": 49216})
    with pytest.raises(InvalidRequestError, match="vocabulary has 49216 tokens and the target's 49152") as info:
        LLM(EngineArgs(model=llama, speculative_config=draft(wider)))
    assert info.value.param == "speculative_config"
    swapped = _copy_with(llama, str(tmp_path / "swapped"), tokenizer_swap=("hello", "world"))
    with pytest.raises(InvalidRequestError, match="tokenizer differs from the target's"):
        LLM(EngineArgs(model=llama, speculative_config=draft(swapped)))


def test_recurrent_draft_and_tensor_parallel_are_refused(tiny_checkpoint):
    with pytest.raises(UnsupportedFeatureError, match="recurrent state"):
        LLM(EngineArgs(model=tiny_checkpoint("llama"), speculative_config=draft(tiny_checkpoint("qwen3_5_text"))))
    with pytest.raises(UnsupportedFeatureError, match="one rank"):
        LLM(EngineArgs(model=tiny_checkpoint("llama"), tensor_parallel_size=2,
                       speculative_config=draft(tiny_checkpoint("llama"))))


# ---------------------------------------------------------------------------------------------------------------
# the acceptance rule with a draft distribution


def test_acceptance_with_draft_distribution_preserves_the_target_distribution():
    """A proposal drawn from the draft's q and accepted with min(1, p/q), else replaced by a draw from
    normalize(max(0, p - q)): the first emitted token is distributed as p (chi-square test), for a q close to p,
    one far from it, and q = p (every proposal kept)."""
    torch.manual_seed(0)
    vocab, draws = 6, 20000
    scores = torch.randn(2, vocab)
    p = torch.softmax(scores[0].double(), dim=-1)
    sampler = Sampler(0)
    generator = torch.Generator().manual_seed(7)
    for q in (torch.softmax(scores[0].double() + 0.5 * torch.randn(vocab).double(), -1),
              torch.softmax(torch.randn(vocab).double() * 2, -1), p.clone()):
        counts = torch.zeros(vocab)
        kept = 0
        proposals = torch.multinomial(q, draws, replacement=True, generator=generator).tolist()
        for proposal in proposals:
            tokens = accept(scores, [proposal], False, sampler, generator, torch.device("cpu"), q.unsqueeze(0))
            counts[tokens[0]] += 1
            kept += len(tokens) == 2
        expected = p * draws
        chi2 = float(((counts - expected) ** 2 / expected).sum())
        assert chi2 < _chi_square_bound(vocab - 1), (q.tolist(), counts.tolist(), expected.tolist())
        # The acceptance rate is sum(min(p, q)).
        assert abs(kept / draws - float(torch.minimum(p, q).sum())) < 0.02
    assert kept == draws


# ---------------------------------------------------------------------------------------------------------------
# greedy: token for token


REGIMES = {
    "default": ({}, {}),
    "preemption": ({"num_kv_blocks": 20, "block_size": 4, "max_num_batched_tokens": 24}, {}),
    "penalties": ({}, {"repetition_penalty": 1.3, "frequency_penalty": 0.4}),
}


# Targets whose recurrent state a rejected proposal rolls back; none of them can be a draft.
STATEFUL = {"qwen3_5_text", "qwen3_5_moe_text", "deepseek_v4"}


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "qwen3_moe", "mistral", "gemma3", "qwen3_5_text",
                                  "qwen3_5_moe_text", "deepseek_v4"])
@pytest.mark.parametrize("regime", sorted(REGIMES))
def test_tiny_greedy_equal_with_a_draft_model(arch, regime, tiny_checkpoint, near_llama):
    """Batched prompts of mixed lengths, greedy, with the target itself as the draft (every proposal kept), another
    architecture's random model (hardly any kept) and, for the Llama, a perturbed copy (some kept): the tokens
    of the engine without speculation, every time. A model with recurrent state (Qwen3.5, DeepSeek-V4) cannot
    draft (refused at load), so it is drafted by the Llama only."""
    engine_extra, sampling_extra = REGIMES[regime]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, **sampling_extra)
    args = EngineArgs(model=tiny_checkpoint(arch), **engine_extra)
    plain, _ = _generate(args, TINY_PROMPTS, params)
    other = tiny_checkpoint("qwen3" if arch == "llama" else "llama")
    drafts = {"other": other} if arch in STATEFUL else {"self": tiny_checkpoint(arch), "other": other}
    if arch == "llama":
        drafts["near"] = near_llama
    for name, path in drafts.items():
        spec, stats = _generate(args.replace(speculative_config=draft(path)), TINY_PROMPTS, params)
        assert [o.token_ids for o in spec] == [o.token_ids for o in plain], name
        assert stats["spec_verify_chunks"] > 0
        if name == "self":
            assert stats["spec_accepted_tokens"] == stats["spec_proposed_tokens"]
        elif name == "near":
            assert 0 < stats["spec_accepted_tokens"] < stats["spec_proposed_tokens"]
        if regime == "preemption":
            assert stats["num_preemptions"] > 0, name


@pytest.mark.parametrize("regime", ["default", "preemption"])
def test_tiny_greedy_proposals_chained_on_the_device(regime, tiny_checkpoint, near_llama, monkeypatch):
    """The draft loop CUDA takes by default (each draft forward's input the previous one's argmax, left on the
    device and read back once), forced on for the CPU: the tokens of the engine without speculation, and of the
    loop that reads every proposal back, and its very proposals."""
    engine_extra, _ = REGIMES[regime]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    args = EngineArgs(model=tiny_checkpoint("llama"), **engine_extra)
    stats = assert_chained_on_the_device_equal(DraftProposer, args, draft(near_llama, k=4), TINY_PROMPTS, params,
                                               monkeypatch)
    assert 0 < stats["spec_accepted_tokens"] < stats["spec_proposed_tokens"]
    if regime == "preemption":
        assert stats["num_preemptions"] > 0


def test_tiny_prefix_cache_hits_keep_the_draft_cache(tiny_checkpoint):
    """A prompt whose blocks come from the prefix cache: the draft's cache holds its keys and values there too
    (the draft ran every chunk the target ran), so the target drafting for itself keeps every proposal."""
    llama = tiny_checkpoint("llama")
    prompt = list(range(2000, 2050))
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    with LLM(EngineArgs(model=llama, block_size=8, speculative_config=draft(llama))) as llm:
        first = llm.generate([prompt], params)[0].token_ids
        again = llm.generate([prompt + [5]], params)[0].token_ids
        stats = llm.stats()
    assert stats["prefix_cache_hits"] >= 48
    assert stats["spec_accepted_tokens"] == stats["spec_proposed_tokens"] > 0
    plain, _ = _generate(EngineArgs(model=llama, block_size=8), [prompt, prompt + [5]], params)
    assert [first, again] == [o.token_ids for o in plain]


def test_tiny_budget_logprobs_and_stop_tokens(tiny_checkpoint):
    """However many proposals are right, a request emits at most max_tokens, stops at a stop token (inside a
    verify step's accepted run), and its log-probabilities are those of the engine without speculation."""
    llama = tiny_checkpoint("llama")
    args = EngineArgs(model=llama)
    long = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, logprobs=2)
    plain, _ = _generate(args, TINY_PROMPTS, long)
    stop_at = plain[0].token_ids[9]
    cases = [dataclasses.replace(long, max_tokens=n) for n in (1, 2, 5, 9)]
    cases.append(dataclasses.replace(long, stop_token_ids=[stop_at]))
    with LLM(args.replace(speculative_config=draft(llama, k=4))) as llm:
        for params in cases:
            outputs = llm.generate(TINY_PROMPTS, params)
            for out, ref in zip(outputs, plain):
                expected = ref.token_ids[:params.max_tokens]
                if stop_at in expected and params.stop_token_ids:
                    expected = expected[:expected.index(stop_at)]   # (a stop token is not returned)
                assert out.token_ids == expected
                for a, b in zip(out.logprobs, ref.logprobs):
                    assert a.token_id == b.token_id and abs(a.logprob - b.logprob) < 1e-4
            assert outputs[0].finish_reason == ("stop" if params.stop_token_ids else "length")


def test_tiny_structured_output_next_to_draft_speculation(tiny_checkpoint):
    """A constrained request does not speculate; in the same steps as requests that do, every output equals the
    engine's without speculation, and the constrained one keeps to its grammar."""
    from pocketllm.runner.grammar import xgrammar_available
    from pocketllm.sampling_params import StructuredOutput

    if not xgrammar_available():
        pytest.skip("xgrammar is not installed")
    llama = tiny_checkpoint("llama")
    free = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    schema = {"type": "string", "enum": ["lighthouse", "castle keep"]}
    constrained = SamplingParams(max_tokens=20, temperature=0.0, structured_output=StructuredOutput(schema))
    jobs = [(TINY_PROMPTS[0], free), (TINY_PROMPTS[1], constrained), (TINY_PROMPTS[2], free)]

    def run(args: EngineArgs) -> tuple[list, dict]:
        async def main() -> tuple[list, dict]:
            async with AsyncLLM(args) as llm:
                outputs = await asyncio.gather(*(llm.generate([prompt], params) for prompt, params in jobs))
                return [o[0] for o in outputs], llm.stats()

        return asyncio.run(main())

    plain, _ = run(EngineArgs(model=llama))
    spec, stats = run(EngineArgs(model=llama, speculative_config=draft(llama)))
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    assert json.loads(spec[1].text) in ("lighthouse", "castle keep")
    assert stats["spec_accepted_tokens"] > 0


# ---------------------------------------------------------------------------------------------------------------
# sampling: in distribution against the plain sampler


def test_seeded_sampling_with_a_draft_model_is_distribution_correct(tiny_checkpoint, near_llama):
    """The first three tokens of many seeded draws with and without a draft model (the perturbed copy: its q
    differs from p, so proposals are kept, rejected with a residual draw, and kept in full with a bonus token)
    come from one distribution: a chi-square two-sample test, rare outcomes pooled, at about 1e-4."""
    prompt = [5, 6, 7, 8] * 6
    params = SamplingParams(max_tokens=3, temperature=1.0, top_k=4, ignore_eos=True)
    args = EngineArgs(model=tiny_checkpoint("llama"), max_num_seqs=64)
    draws = 1500
    plain, _ = _first_tokens(args, prompt, draws, params)
    spec, stats = _first_tokens(args.replace(speculative_config=draft(near_llama, k=2)), prompt, draws, params)
    assert stats["spec_verify_chunks"] > 0 and 0 < stats["spec_accepted_tokens"] < stats["spec_proposed_tokens"]
    assert_same_distribution(plain, spec)


# ---------------------------------------------------------------------------------------------------------------
# the default model drafting for itself


def test_default_model_drafting_for_itself_is_greedy_equal(smollm2_gguf):
    """SmolLM2 (Q4_1 GGUF, int4 on the CPU) as its own draft: greedy output equals the engine's without
    speculation, prompt by prompt, and most proposals are kept (the draft's one-row steps and the verify step's
    rows round alike, not identically). One prompt at a time: batched, this model's greedy tokens depend on the
    batch's steps even without speculation (these prompts batched and alone part at a near-tie after EOS), and
    verify steps change the steps; batched equality is tested on the float32 tiny models."""
    prompts = ["Repeat the following sentence exactly: The old lighthouse keeper climbed the stairs.",
               "Write a short poem about the autumn wind.", "Count from one to twenty: one,"]
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    with LLM(EngineArgs(model=smollm2_gguf)) as llm:
        plain = [llm.generate([prompt], params)[0].token_ids for prompt in prompts]
    with LLM(EngineArgs(model=smollm2_gguf, speculative_config=draft(smollm2_gguf, k=4))) as llm:
        spec = [llm.generate([prompt], params)[0].token_ids for prompt in prompts]
        stats = llm.stats()
    assert spec == plain
    assert stats["spec_accepted_tokens"] >= 0.8 * stats["spec_proposed_tokens"] > 0


def test_default_model_with_a_safetensors_draft(smollm2_gguf, tiny_checkpoint):
    """A GGUF target and an HF safetensors draft (the tiny random Llama, saved with SmolLM2's tokenizer): the
    tokenizers compare equal across the two formats, and greedy output is the target's own."""
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    prompt = "Count from one to twenty: one,"
    with LLM(EngineArgs(model=smollm2_gguf)) as llm:
        plain = llm.generate([prompt], params)[0].token_ids
    with LLM(EngineArgs(model=smollm2_gguf, speculative_config=draft(tiny_checkpoint("llama"), k=2))) as llm:
        spec = llm.generate([prompt], params)[0].token_ids
        stats = llm.stats()
    assert spec == plain and stats["spec_verify_chunks"] > 0


def test_default_model_stop_strings_with_a_draft_model(smollm2_gguf):
    params = [SamplingParams(max_tokens=60, temperature=0.0, stop=["lamp"]), SamplingParams(max_tokens=200,
                                                                                              temperature=0.0)]
    prompt = ("Repeat the following sentence exactly, then stop.\nSentence: The old lighthouse keeper climbed the "
              "narrow stairs every evening to light the great lamp.\nRepeated: The old")
    with LLM(EngineArgs(model=smollm2_gguf)) as llm:
        plain = [llm.generate([prompt], p)[0] for p in params]
    with LLM(EngineArgs(model=smollm2_gguf, speculative_config=draft(smollm2_gguf, k=4))) as llm:
        spec = [llm.generate([prompt], p)[0] for p in params]
        caps = llm.engine_caps()
    assert [(o.token_ids, o.text, o.finish_reason) for o in spec] == [(o.token_ids, o.text, o.finish_reason)
                                                                     for o in plain]
    assert spec[0].finish_reason == "stop" and "lamp" not in spec[0].text
    assert caps.speculative == ("draft_model",)


# ---------------------------------------------------------------------------------------------------------------
# the benchmark: forced acceptance with random weights


def test_bench_forced_acceptance_with_dummy_weights(tiny_checkpoint, monkeypatch, capsys):
    """The mechanics' benchmark: random weights, the target drafting for itself, every proposal kept, so that the
    acceptance length is exactly k + 1."""
    from argparse import Namespace

    from pocketllm.bench import speculative

    monkeypatch.setattr(speculative, "PROMPT_SETS", {"chat": ("Hello",)})
    llama = tiny_checkpoint("llama")
    args = Namespace(output_len=13, num_iters=1, output_json=None)
    spec = draft(llama, k=2, forced_acceptance=True)
    result = speculative.run(args, EngineArgs(model=llama, load_format="dummy", speculative_config=spec))
    entry = result["sets"]["chat"]
    assert entry["with"]["mean_acceptance_length"] == 3.0
    assert entry["with"]["ms_per_step"] > 0 and entry["without"]["ms_per_step"] > 0
    assert result["speculative_config"].items() >= spec.items()
    assert "mean acceptance length 3.00" in capsys.readouterr().out


@pytest.mark.gpu
def test_draft_model_on_cuda_greedy_equal(tiny_checkpoint, near_llama):
    """On CUDA (float32, captured decode graphs and eager): a draft model's greedy output equals the engine's
    without speculation; the target drafting for itself in bfloat16 with forced acceptance runs (the mechanics'
    benchmark)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    for eager in (False, True):
        args = EngineArgs(model=tiny_checkpoint("llama"), device="cuda", dtype="float32", enforce_eager=eager,
                          num_kv_blocks=256, max_num_seqs=8)
        plain, _ = _generate(args, TINY_PROMPTS, params)
        for path in (tiny_checkpoint("llama"), near_llama, tiny_checkpoint("qwen3")):
            spec, stats = _generate(args.replace(speculative_config=draft(path)), TINY_PROMPTS, params)
            assert [o.token_ids for o in spec] == [o.token_ids for o in plain], (eager, path)
            assert stats["spec_verify_chunks"] > 0
            assert (stats["spec_graph_steps"] > 0) != eager
    forced = EngineArgs(model=tiny_checkpoint("llama"), device="cuda", dtype="bfloat16", load_format="dummy",
                        num_kv_blocks=256, max_num_seqs=8,
                        speculative_config=draft(tiny_checkpoint("llama"), k=3, forced_acceptance=True))
    outputs, stats = _generate(forced, TINY_PROMPTS[:1], params)
    assert len(outputs[0].token_ids) == 24
    assert stats["spec_accepted_tokens"] == stats["spec_proposed_tokens"] > 0
