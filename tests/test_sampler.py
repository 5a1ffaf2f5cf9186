"""Tests for the batched sampler (pocketllm/runner/sampler.py)."""

from __future__ import annotations

import math

import pytest
import torch

from pocketllm.runner.sampler import ARGMAX_CHUNK, Sampler, SamplingRow, argmax_rows
from pocketllm.sampling_params import SamplingParams
from pocketllm.step.sampled import SampledToken

VOCAB = 64


def _logits(batch: int, vocab: int = VOCAB, seed: int = 0, scale: float = 3.0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(batch, vocab, generator=gen) * scale


def _row(params: SamplingParams, prompt: list[int] | None = None, output: list[int] | None = None,
         generator: torch.Generator | None = None) -> SamplingRow:
    return SamplingRow(params=params, prompt_token_ids=prompt or [], output_token_ids=output or [],
                       generator=generator)


def _tokens(out: list[SampledToken]) -> list[int]:
    return [t.token_id for t in out]


# --------------------------------------------------------------------------------------------------
# greedy


def test_greedy_is_argmax() -> None:
    logits = _logits(5)
    before = logits.clone()
    out = Sampler(seed=0)(logits, [_row(SamplingParams(temperature=0.0)) for _ in range(5)])
    assert _tokens(out) == logits.argmax(-1).tolist()
    assert all(t.logprob is None and t.top_ids == [] and t.top_logprobs == [] for t in out)
    assert torch.equal(logits, before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunked_argmax_equals_torch_argmax(dtype: torch.dtype) -> None:
    """The CPU argmax through chunk maxima picks torch's index: the first of tied maxima (ties within and
    across chunks), NaN counted as largest, all -inf rows, padded (non-contiguous) rows."""
    gen = torch.Generator().manual_seed(7)
    vocab = 6 * ARGMAX_CHUNK
    x = torch.randn(6, vocab + 5, generator=gen)[:, :vocab].round().to(dtype)  # rounded: many ties
    x[1, 3 * ARGMAX_CHUNK + 17] = x[1, ARGMAX_CHUNK + 4] = 100.0
    x[2, [40, 5000, 9]] = float("nan")
    x[3] = float("-inf")
    x[4, vocab - 1] = 50.0
    assert torch.equal(argmax_rows(x), x.argmax(dim=-1))
    assert argmax_rows(x).tolist()[1:5] == [ARGMAX_CHUNK + 4, 9, 0, vocab - 1]
    for seed in range(20):
        y = torch.randn(seed % 5 + 1, vocab, generator=gen.manual_seed(seed)).to(dtype)
        assert torch.equal(argmax_rows(y), y.argmax(dim=-1))


def test_empty_batch() -> None:
    assert Sampler()(torch.zeros(0, VOCAB), []) == []


def test_logits_not_modified_by_processing() -> None:
    logits = _logits(3)
    before = logits.clone()
    rows = [
        _row(SamplingParams(temperature=0.0, logit_bias={1: 50.0}, logprobs=3)),
        _row(SamplingParams(temperature=0.7, top_k=5, top_p=0.9, min_p=0.05), prompt=[1, 2], output=[3]),
        _row(SamplingParams(repetition_penalty=1.3, frequency_penalty=0.5), prompt=[4], output=[4, 5]),
    ]
    Sampler(seed=0)(logits, rows)
    assert torch.equal(logits, before)


def test_bfloat16_logits() -> None:
    logits = _logits(2).to(torch.bfloat16)
    rows = [_row(SamplingParams(temperature=0.0, logprobs=2)), _row(SamplingParams(temperature=0.0))]
    out = Sampler()(logits, rows)
    assert _tokens(out) == logits.float().argmax(-1).tolist()
    assert out[0].logprob == pytest.approx(torch.log_softmax(logits[0].float(), -1).max().item(), abs=1e-5)


# --------------------------------------------------------------------------------------------------
# log-probabilities


def test_logprobs_are_raw_log_softmax() -> None:
    logits = _logits(4)
    ref = torch.log_softmax(logits, dim=-1)
    params = [
        SamplingParams(temperature=0.0, logprobs=5),
        SamplingParams(temperature=0.5, top_k=3, logprobs=20, logit_bias={7: 30.0}),
        SamplingParams(temperature=1.3, top_p=0.5, min_p=0.1, logprobs=0, repetition_penalty=2.0),
        SamplingParams(temperature=0.0),
    ]
    out = Sampler(seed=1)(logits, [_row(p, prompt=[1, 2, 3], output=[4]) for p in params])
    for i, (p, tok) in enumerate(zip(params, out, strict=True)):
        if p.logprobs is None:
            assert tok.logprob is None and tok.top_ids == [] and tok.top_logprobs == []
            continue
        assert tok.logprob == pytest.approx(ref[i, tok.token_id].item(), abs=1e-5)
        vals, ids = ref[i].topk(p.logprobs) if p.logprobs else (torch.empty(0), torch.empty(0))
        assert tok.top_ids == ids.tolist()
        assert tok.top_logprobs == pytest.approx(vals.tolist(), abs=1e-5)
        assert len(tok.top_ids) == p.logprobs
    # The greedy row's token is the first alternative, with the same log-prob.
    assert out[0].token_id == out[0].top_ids[0]
    assert out[0].logprob == pytest.approx(out[0].top_logprobs[0], abs=1e-7)
    # The biased row is forced onto token 7; its logprob is still the raw one.
    assert out[1].token_id == 7
    assert out[1].logprob == pytest.approx(ref[1, 7].item(), abs=1e-5)


def test_sampled_token_logprob_reported_outside_top() -> None:
    logits = _logits(1)
    low = int(logits[0].argmin())
    params = SamplingParams(temperature=0.0, logprobs=2, logit_bias={low: 100.0})
    out = Sampler()(logits, [_row(params)])[0]
    assert out.token_id == low
    assert low not in out.top_ids
    assert out.logprob == pytest.approx(torch.log_softmax(logits[0], -1)[low].item(), abs=1e-5)


# --------------------------------------------------------------------------------------------------
# truncation equivalences with greedy


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0, top_k=1),
    SamplingParams(temperature=2.0, top_p=1e-6),
    SamplingParams(temperature=1.0, min_p=0.999999),
    SamplingParams(temperature=0.8, top_k=1, top_p=0.3),
])
def test_truncations_equal_greedy(params: SamplingParams) -> None:
    logits = _logits(8, scale=1.0, seed=3)
    sampler = Sampler(seed=5)
    for _ in range(5):
        assert _tokens(sampler(logits, [_row(params) for _ in range(8)])) == logits.argmax(-1).tolist()


def test_top_k_restricts_support() -> None:
    logits = _logits(1, scale=0.1)  # nearly flat, so every kept token is likely to show up
    top3 = set(logits[0].topk(3).indices.tolist())
    sampler = Sampler(seed=0)
    seen = set(_tokens(sampler(logits.expand(400, -1), [_row(SamplingParams(top_k=3))] * 400)))
    assert seen == top3


def test_top_p_keeps_smallest_nucleus() -> None:
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    logits = probs.log()
    sampler = Sampler(seed=0)
    seen = set(_tokens(sampler(logits.expand(500, -1), [_row(SamplingParams(top_p=0.75))] * 500)))
    assert seen == {0, 1}  # 0.5 < 0.75 <= 0.8
    seen = set(_tokens(sampler(logits.expand(500, -1), [_row(SamplingParams(top_p=0.79))] * 500)))
    assert seen == {0, 1}  # 0.8 >= 0.79 after two tokens
    seen = set(_tokens(sampler(logits.expand(800, -1), [_row(SamplingParams(top_p=0.81))] * 800)))
    assert seen == {0, 1, 2}
    seen = set(_tokens(sampler(logits.expand(500, -1), [_row(SamplingParams(top_p=0.5))] * 500)))
    assert seen == {0}


def test_min_p_threshold() -> None:
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    logits = probs.log()
    sampler = Sampler(seed=0)
    # min_p 0.25 → threshold 0.125: tokens 0, 1, 2 kept, token 3 dropped.
    seen = set(_tokens(sampler(logits.expand(800, -1), [_row(SamplingParams(min_p=0.25))] * 800)))
    assert seen == {0, 1, 2}


# --------------------------------------------------------------------------------------------------
# logit bias and penalties


def test_logit_bias_forces_and_forbids() -> None:
    logits = _logits(2)
    target = int(logits[0].argmin())
    top = int(logits[1].argmax())
    sampler = Sampler(seed=0)
    for _ in range(20):
        out = sampler(logits, [
            _row(SamplingParams(temperature=1.0, logit_bias={target: 100.0})),
            _row(SamplingParams(temperature=0.0, logit_bias={top: -100.0})),
        ])
        assert out[0].token_id == target
        assert out[1].token_id != top
    # -100 also removes a token from sampling.
    flat = torch.zeros(1, 4).expand(300, -1)
    seen = set(_tokens(sampler(flat, [_row(SamplingParams(logit_bias={2: -100.0}))] * 300)))
    assert seen == {0, 1, 3}


def test_logit_bias_out_of_vocab_ignored() -> None:
    logits = _logits(1)
    out = Sampler()(logits, [_row(SamplingParams(temperature=0.0, logit_bias={VOCAB + 5: 100.0}))])
    assert out[0].token_id == int(logits[0].argmax())


def test_repetition_penalty_matches_transformers() -> None:
    from transformers import RepetitionPenaltyLogitsProcessor

    sampler = Sampler()
    logits = _logits(3, seed=11)
    prompts = [[1, 2, 3, 5], [10, 11, 10], []]
    outputs = [[5, 7], [12], [20, 21, 20]]
    penalty = 1.7
    rows = [_row(SamplingParams(repetition_penalty=penalty), p, o)
            for p, o in zip(prompts, outputs, strict=True)]
    processor = RepetitionPenaltyLogitsProcessor(penalty=penalty)
    for i in range(len(rows)):
        ids = torch.tensor([prompts[i] + outputs[i]], dtype=torch.long)
        expected = processor(ids, logits[i:i + 1].clone())[0]
        x = logits.clone()
        sampler._apply_penalties(x, rows)
        assert torch.equal(x[i], expected), i
        # And end to end: with every token but the penalised ones forbidden, greedy picks HF's argmax
        # among them.
        ids_set = sorted(set(prompts[i] + outputs[i]))
        bias = {t: -100.0 for t in range(VOCAB) if t not in ids_set}
        params = SamplingParams(temperature=0.0, repetition_penalty=penalty, logit_bias=bias)
        out = sampler(logits[i:i + 1], [_row(params, prompts[i], outputs[i])])[0]
        assert out.token_id == ids_set[int(expected[ids_set].argmax())]


def test_repetition_penalty_rule_both_signs() -> None:
    logits = torch.tensor([[2.0, -2.0, 1.0, -1.0, 0.5]])
    rows = [_row(SamplingParams(repetition_penalty=2.0), prompt=[0], output=[1, 1])]
    x = logits.clone()
    Sampler()._apply_penalties(x, rows)
    assert x.tolist() == [[1.0, -4.0, 1.0, -1.0, 0.5]]


def test_frequency_presence_exact() -> None:
    logits = torch.tensor([[1.0, 2.0, 3.0, 4.0, 5.0], [1.0, 2.0, 3.0, 4.0, 5.0]])
    rows = [
        # prompt tokens are not counted by frequency/presence
        _row(SamplingParams(frequency_penalty=0.5, presence_penalty=0.25), prompt=[0, 0, 4],
             output=[1, 1, 1, 3]),
        _row(SamplingParams(frequency_penalty=-1.0), output=[2]),
    ]
    x = logits.clone()
    Sampler()._apply_penalties(x, rows)
    assert x[0].tolist() == [1.0, 2.0 - 1.5 - 0.25, 3.0, 4.0 - 0.5 - 0.25, 5.0]
    assert x[1].tolist() == [1.0, 2.0, 4.0, 4.0, 5.0]


def test_penalties_change_greedy_choice() -> None:
    logits = torch.tensor([[0.0, 3.0, 2.9, 0.0]])
    sampler = Sampler()
    assert sampler(logits, [_row(SamplingParams(temperature=0.0))])[0].token_id == 1
    for params in (SamplingParams(temperature=0.0, presence_penalty=0.2),
                   SamplingParams(temperature=0.0, frequency_penalty=0.2),
                   SamplingParams(temperature=0.0, repetition_penalty=1.1)):
        assert sampler(logits, [_row(params, output=[1])])[0].token_id == 2


def test_penalty_in_mixed_batch_only_affects_own_row() -> None:
    logits = torch.tensor([[0.0, 3.0, 2.9, 0.0]]).expand(3, -1).contiguous()
    rows = [
        _row(SamplingParams(temperature=0.0), output=[1]),
        _row(SamplingParams(temperature=0.0, presence_penalty=1.0), output=[1]),
        _row(SamplingParams(temperature=0.0, logit_bias={3: 10.0})),
    ]
    assert _tokens(Sampler()(logits, rows)) == [1, 2, 3]


# --------------------------------------------------------------------------------------------------
# seeding and distribution


def _run_seeded(params: SamplingParams, seed: int, steps: int, batch_builder) -> list[int]:
    """Run ``steps`` sampling steps for one seeded row placed into batches from ``batch_builder``."""
    gen = torch.Generator().manual_seed(seed)
    sampler = Sampler(seed=None)  # the shared generator is random: it must not influence the row
    produced: list[int] = []
    for step in range(steps):
        row_logits = _logits(1, seed=100 + step, scale=0.5)
        row = _row(params, prompt=[1, 2, 3], output=list(produced), generator=gen)
        logits, rows, pos = batch_builder(row_logits, row, step)
        produced.append(sampler(logits, rows)[pos].token_id)
    return produced


def test_seeded_row_reproducible_across_batches() -> None:
    params = SamplingParams(temperature=1.0, top_p=0.95, seed=1234, repetition_penalty=1.1)

    def alone(row_logits, row, step):
        return row_logits, [row], 0

    def mixed(row_logits, row, step):
        others = _logits(4, seed=500 + step)
        other_rows = [
            _row(SamplingParams(temperature=0.7, top_k=5)),
            _row(SamplingParams(temperature=0.0, logprobs=3, logit_bias={0: 5.0})),
            _row(SamplingParams(temperature=1.5, min_p=0.1, seed=9),
                 generator=torch.Generator().manual_seed(9)),
            _row(SamplingParams(temperature=1.0, frequency_penalty=1.0), output=[1, 2, 2]),
        ]
        pos = 1 + step % 4
        logits = torch.cat([others[:pos], row_logits, others[pos:]])
        return logits, other_rows[:pos] + [row] + other_rows[pos:], pos

    a = _run_seeded(params, 1234, 12, alone)
    b = _run_seeded(params, 1234, 12, mixed)
    c = _run_seeded(params, 4321, 12, alone)
    assert a == b
    assert a != c  # a different seed gives a different stream (overwhelmingly likely over 12 steps)


def test_shared_generator_seed_reproducible() -> None:
    logits = _logits(6, scale=0.3)
    rows = [_row(SamplingParams(temperature=1.0)) for _ in range(6)]
    a = [_tokens(s(logits, rows)) for s in [Sampler(seed=7)] for _ in range(5)]
    b = [_tokens(s(logits, rows)) for s in [Sampler(seed=7)] for _ in range(5)]
    assert a == b


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_sampling_matches_softmax(temperature: float) -> None:
    torch.manual_seed(0)
    logits = torch.tensor([[1.0, 0.5, 0.0, -0.5, -1.0, 2.0, -3.0, 0.2]])
    expected = torch.softmax(logits[0] / temperature, dim=-1)
    n = 8000
    sampler = Sampler(seed=123)
    # half drawn batched from the shared generator, half from one per-row generator one at a time
    shared = _tokens(sampler(logits.expand(n // 2, -1), [_row(SamplingParams(temperature=temperature))]
                             * (n // 2)))
    gen = torch.Generator().manual_seed(99)
    params = SamplingParams(temperature=temperature, seed=99)
    own = []
    for _ in range(n // 2 // 100):
        own += _tokens(sampler(logits.expand(100, -1), [_row(params, generator=gen)] * 100))
    for draws in (shared, own):
        counts = torch.bincount(torch.tensor(draws), minlength=logits.shape[1]).double()
        exp = expected.double() * len(draws)
        chi2 = float(((counts - exp) ** 2 / exp).sum())
        # 7 degrees of freedom: the 99.9th percentile is about 24.3.
        assert chi2 < 24.3, (chi2, counts.tolist(), exp.tolist())


def test_top_k_top_p_distribution_renormalised() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, -2.0]])
    n = 6000
    sampler = Sampler(seed=3)
    draws = _tokens(sampler(logits.expand(n, -1), [_row(SamplingParams(top_k=3))] * n))
    expected = torch.softmax(logits[0, :3], -1).double() * n
    counts = torch.bincount(torch.tensor(draws), minlength=5).double()
    assert counts[3:].sum() == 0
    chi2 = float(((counts[:3] - expected) ** 2 / expected).sum())
    assert chi2 < 13.8  # 2 degrees of freedom, 99.9th percentile


def test_fast_path_no_copy_for_plain_greedy(monkeypatch: pytest.MonkeyPatch) -> None:
    logits = _logits(4)
    calls = {"n": 0}
    original = torch.Tensor.clone

    def counting_clone(self, *args, **kwargs):
        calls["n"] += 1
        return original(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "clone", counting_clone)
    out = Sampler()(logits, [_row(SamplingParams(temperature=0.0, seed=3)) for _ in range(4)])
    assert _tokens(out) == logits.argmax(-1).tolist()
    assert calls["n"] == 0


def test_seeded_greedy_rows_draw_nothing() -> None:
    gen = torch.Generator().manual_seed(5)
    state = gen.get_state()
    logits = _logits(2)
    rows = [_row(SamplingParams(temperature=0.0, seed=5), generator=gen),
            _row(SamplingParams(temperature=1.0))]
    Sampler(seed=0)(logits, rows)
    assert torch.equal(gen.get_state(), state)


def test_large_vocab_mixed_batch_smoke() -> None:
    vocab = 32000
    logits = _logits(6, vocab=vocab, seed=2)
    rows = [
        _row(SamplingParams(temperature=0.0)),
        _row(SamplingParams(temperature=0.8, top_k=50, top_p=0.9)),
        _row(SamplingParams(temperature=1.0, top_k=40)),
        _row(SamplingParams(temperature=1.0, min_p=0.05, logprobs=20)),
        _row(SamplingParams(temperature=1.0, seed=1), generator=torch.Generator().manual_seed(1)),
        _row(SamplingParams(temperature=0.5, repetition_penalty=1.2, presence_penalty=0.5),
             prompt=list(range(100)), output=[5, 6, 7]),
    ]
    out = Sampler(seed=0)(logits, rows)
    assert all(0 <= t.token_id < vocab for t in out)
    assert out[0].token_id == int(logits[0].argmax())
    assert out[2].token_id in set(logits[2].topk(40).indices.tolist())
    assert len(out[3].top_ids) == 20
    assert not math.isnan(out[3].logprob)
