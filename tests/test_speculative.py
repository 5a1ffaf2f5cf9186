"""Speculative decoding (``speculative_config``, method ngram): the config, the proposer, the KV rollback, and
outputs equal to the same engine without speculation (greedy: token for token; seeded sampling: in
distribution)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import random
import threading
from functools import partialmethod

import pytest
import torch

from pocketllm import LLM, AsyncLLM, EngineArgs, SamplingParams
from pocketllm.config import SpeculativeConfig, parse_field
from pocketllm.engine.block_manager import BlockManager
from pocketllm.engine.ngram_proposer import NgramProposer
from pocketllm.engine.proposer import Proposer
from pocketllm.engine.request import Request
from pocketllm.errors import InvalidRequestError, UnsupportedFeatureError
from pocketllm.runner.sampler import Sampler
from pocketllm.runner.spec_verify import accept
from pocketllm.scheduler_api import BatchScheduler

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}

# A prompt the model copies from (a passage to repeat with an edit), and one it does not.
COPY_TEXT = ("Repeat the following sentence exactly, then stop.\nSentence: The old lighthouse keeper climbed the "
             "narrow stairs every evening to light the great lamp for the ships at sea.\nRepeated: The old")
CHAT_TEXT = "Write a short poem about the autumn wind."


# ---------------------------------------------------------------------------------------------------------------
# configuration


def test_config_is_built_once_and_validated():
    args = EngineArgs(speculative_config=NGRAM)
    spec = args.speculative_config
    assert isinstance(spec, SpeculativeConfig)
    assert (spec.method, spec.num_speculative_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max) == \
        ("ngram", 4, 1, 3)
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.num_speculative_tokens = 8
    assert args.replace(seed=3).speculative_config == spec
    assert EngineArgs(speculative_config=spec).speculative_config is spec
    assert parse_field("speculative_config", '{"method": "ngram", "num_speculative_tokens": 2}') == \
        {"method": "ngram", "num_speculative_tokens": 2}


@pytest.mark.parametrize("bad", [
    {"method": "medusa", "num_speculative_tokens": 2},
    {"method": "ngram", "num_speculative_tokens": 0},
    {"method": "ngram", "num_speculative_tokens": True},
    {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
    {"method": "ngram", "num_speculative_tokens": 2, "lookahead": 3},
    {"method": "ngram"},
    {"method": "ngram", "num_speculative_tokens": 2, "model": "draft.gguf"},
    {"method": "draft_model", "num_speculative_tokens": 2},
    "ngram",
])
def test_bad_config_is_refused(bad):
    with pytest.raises(InvalidRequestError) as info:
        EngineArgs(speculative_config=bad)
    assert info.value.param == "speculative_config"


def test_mtp_without_a_head_and_async_scheduling_with_a_draft_are_refused(tiny_checkpoint):
    with pytest.raises(UnsupportedFeatureError, match="'mtp' runs the MTP head of a Qwen3.5"):
        LLM(EngineArgs(model=tiny_checkpoint("llama"), speculative_config={"method": "mtp",
                                                                           "num_speculative_tokens": 2}))
    draft = {"method": "draft_model", "model": tiny_checkpoint("llama"), "num_speculative_tokens": 2}
    with pytest.raises(UnsupportedFeatureError, match="async_scheduling"):
        LLM(EngineArgs(model=tiny_checkpoint("llama"), speculative_config=draft, async_scheduling="on"))


# ---------------------------------------------------------------------------------------------------------------
# proposer and rollback


def _scanned(tokens: list[int], min_n: int, max_n: int, limit: int) -> list[int]:
    """Prompt lookup by a scan of the whole context (the definition the incremental index must meet): the tokens
    after the most recent earlier occurrence of the longest recurring suffix of ``min_n``..``max_n`` tokens."""
    length = len(tokens)
    if limit < 1 or length < min_n + 1:
        return []
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        starts = [s for s in range(length - n) if tokens[s:s + n] == tokens[length - n:]]
        if starts:
            return tokens[starts[-1] + n:starts[-1] + n + limit]
    return []


def _lookup_request(tokens: list[int], prompt: int | None = None) -> Request:
    prompt = len(tokens) if prompt is None else prompt
    request = Request("r", tokens[:prompt], SamplingParams(max_tokens=8), frozenset())
    request.output_token_ids = tokens[prompt:]
    return request


def test_ngram_proposer_takes_the_longest_most_recent_match():
    proposer = NgramProposer(min_n=1, max_n=3, k=3)
    #            0  1  2  3  4  5  6  7  8  9 10
    tokens = [5, 6, 7, 8, 9, 1, 6, 7, 2, 5, 6, 7]
    # "5 6 7" occurs at 0 (followed by 8 9 1); "6 7" alone also at 6 (followed by 2): the longer n-gram wins.
    assert proposer.propose(_lookup_request(tokens), 10) == [8, 9, 1]
    assert proposer.propose(_lookup_request(tokens, 5), 2) == [8, 9]
    assert proposer.propose(_lookup_request([1, 2, 3, 4]), 5) == []
    # The most recent earlier occurrence of "3" (index 4) is followed by 9.
    assert NgramProposer(1, 1, 2).propose(_lookup_request([3, 1, 2, 0, 3, 9, 3]), 5) == [9, 3]
    assert proposer.propose(_lookup_request(tokens), 0) == []
    # With a token pending after the known ones: what followed the match, less its first token (the guess for
    # the pending one). "5 6 7" is followed by 8 9 1 6: 8 is the guess, 9 1 6 the proposals.
    assert proposer.propose_after_pending(_lookup_request(tokens), 10) == [9, 1, 6]
    assert proposer.propose_after_pending(_lookup_request(tokens), 1) == [9]
    assert proposer.propose_after_pending(_lookup_request([1, 2, 3, 4]), 5) == []
    assert Proposer().propose_after_pending(_lookup_request(tokens), 5) == []


@pytest.mark.parametrize("min_n,max_n", [(1, 4), (2, 3), (3, 3)])
def test_ngram_index_follows_appended_tokens_as_a_full_scan_does(min_n, max_n):
    """The request's n-gram index, brought up to date as tokens arrive one or several at a time (a prompt, then
    decode steps and verify steps), proposes what a scan of the whole context does after every append; a request
    whose tokens were cut back is indexed again."""
    generator = random.Random(min_n * 10 + max_n)
    proposer = NgramProposer(min_n, max_n, k=5)
    for _ in range(20):
        alphabet = generator.randint(2, 6)
        prompt = [generator.randrange(alphabet) for _ in range(generator.randint(1, 12))]
        request = _lookup_request(prompt)
        proposals = 0
        while request.num_tokens < 80:
            limit = generator.randint(0, 6)
            expected = _scanned(request.all_token_ids, min_n, max_n, min(5, limit))
            assert proposer.propose(request, limit) == expected
            proposals += bool(expected)
            request.output_token_ids.extend(generator.randrange(alphabet) for _ in range(generator.randint(1, 4)))
        assert proposals > 0
        del request.output_token_ids[10:]
        assert proposer.propose(request, 5) == _scanned(request.all_token_ids, min_n, max_n, 5)


def _request(tokens: int) -> Request:
    return Request("r", list(range(tokens)), SamplingParams(max_tokens=8), frozenset())


def test_truncate_gives_back_unhashed_blocks_first():
    blocks = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=True)
    request = _request(6)
    blocks.allocate(request, 6 + 5)              # 11 slots: 3 blocks
    request.num_computed_tokens = 7
    blocks.cache_full_blocks(request)            # only the first block holds computed, known tokens
    kept, dropped = request.block_table[:2], request.block_table[2]
    blocks.truncate(request, 7)
    assert request.block_table == kept
    assert next(iter(blocks.free)) == dropped    # reused first
    assert len(blocks.cached) == 1 and blocks.blocks[dropped].key is None


# ---------------------------------------------------------------------------------------------------------------
# the acceptance rule


def test_greedy_acceptance_stops_at_the_first_mismatch():
    scores = torch.full((4, 10), -1.0)
    for row, best in enumerate([3, 4, 7, 2]):
        scores[row, best] = 1.0
    sampler = Sampler(0)
    assert accept(scores, [3, 4, 5], True, sampler, None, torch.device("cpu")) == [3, 4, 7]
    assert accept(scores, [3, 4, 7], True, sampler, None, torch.device("cpu")) == [3, 4, 7, 2]
    assert accept(scores, [0, 4, 7], True, sampler, None, torch.device("cpu")) == [3]


def _chi_square_bound(dof: int) -> float:
    """An upper quantile of chi-square with ``dof`` degrees of freedom at about 1e-4 (Wilson-Hilferty)."""
    z = 3.72
    return dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3


def test_sampling_acceptance_preserves_the_distribution():
    """Whatever the proposal, the first emitted token is distributed as the target's p (chi-square test)."""
    torch.manual_seed(0)
    vocab, draws = 6, 20000
    scores = torch.randn(2, vocab)
    p = torch.softmax(scores[0].double(), dim=-1)
    sampler = Sampler(0)
    generator = torch.Generator().manual_seed(7)
    for proposal in (int(p.argmax()), int(p.argmin())):
        counts = torch.zeros(vocab)
        for _ in range(draws):
            counts[accept(scores, [proposal], False, sampler, generator, torch.device("cpu"))[0]] += 1
        expected = p * draws
        chi2 = float(((counts - expected) ** 2 / expected).sum())
        assert chi2 < _chi_square_bound(vocab - 1), (proposal, counts.tolist(), expected.tolist())


# ---------------------------------------------------------------------------------------------------------------
# the engine: greedy token for token


def _generate(args: EngineArgs, prompts: list, params: SamplingParams | list[SamplingParams]
              ) -> tuple[list, dict]:
    with LLM(args) as llm:
        outputs = llm.generate(prompts, params)
        return outputs, llm.stats()


def recorded_drafts(proposer_class, monkeypatch) -> list:
    """Every verify chunk's proposals ``proposer_class.fill`` puts in, in order, from now on."""
    drafts: list = []
    fill = proposer_class.fill

    def recording(self, chunks):
        filled = fill(self, chunks)
        drafts.extend(c.draft for c in filled if c.draft)
        return filled

    monkeypatch.setattr(proposer_class, "fill", recording)
    return drafts


def assert_chained_on_the_device_equal(proposer_class, args: EngineArgs, speculative_config: dict, prompts: list,
                                       params: SamplingParams, monkeypatch) -> dict:
    """The chain CUDA takes by default (each drafter forward's input the previous one's argmax, left on the device
    and read back once), forced on for the CPU: the tokens of the engine without speculation, and the very
    proposals of the loop that reads every proposal back. Returns the chained run's stats."""
    calls = []
    chain = proposer_class._greedy_chain

    def counted(self, *args):
        calls.append(len(args[1]))
        return chain(self, *args)

    plain, _ = _generate(args, prompts, params)
    spec = args.replace(speculative_config=speculative_config)
    with monkeypatch.context() as patch:
        host_drafts = recorded_drafts(proposer_class, patch)
        host, _ = _generate(spec, prompts, params)
    monkeypatch.setattr(proposer_class, "__init__", partialmethod(proposer_class.__init__, chain_on_device=True))
    monkeypatch.setattr(proposer_class, "_greedy_chain", counted)
    drafts = recorded_drafts(proposer_class, monkeypatch)
    chained, stats = _generate(spec, prompts, params)
    assert [o.token_ids for o in chained] == [o.token_ids for o in plain] == [o.token_ids for o in host]
    assert calls and max(calls) > 1     # chained steps ran, some with several requests
    assert drafts == host_drafts and max(len(d) for d in drafts) > 1
    return stats


def _cached_keys_are_real(llm: LLM, sequences: list[list[int]]) -> None:
    """Every block the prefix cache holds is a block of one of ``sequences`` (never one with rejected tokens)."""
    blocks = llm._client.backend.core.blocks
    real = {key for seq in sequences for key, _ in blocks.chain_keys(seq, len(seq) // blocks.block_size)}
    assert blocks.cached and set(blocks.cached) <= real


def test_default_model_greedy_equal_with_ngram(smollm2_gguf):
    params = SamplingParams(max_tokens=48, temperature=0.0)
    plain, _ = _generate(EngineArgs(model=smollm2_gguf), [COPY_TEXT, CHAT_TEXT], params)
    with LLM(EngineArgs(model=smollm2_gguf, speculative_config=NGRAM)) as llm:
        spec = llm.generate([COPY_TEXT, CHAT_TEXT], params)
        alone = llm.generate([COPY_TEXT], params)
        stats = llm.stats()
        _cached_keys_are_real(llm, [list(o.prompt_token_ids) + o.token_ids for o in spec])
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    assert [o.text for o in spec] == [o.text for o in plain]
    assert alone[0].token_ids == plain[0].token_ids
    assert stats["spec_verify_chunks"] > 0 and stats["spec_accepted_tokens"] > 0
    assert stats["spec_accepted_tokens"] < stats["spec_proposed_tokens"]


@pytest.mark.usefixtures("one_thread")
def test_default_model_greedy_equal_with_ngram_at_one_thread(smollm2_gguf):
    """At one intra-op thread too (a one-core deployment): with and without speculation, batched and alone. The
    second prompt arrives while the first decodes, and that step's decode rows once ran the reference forward:
    the first request's greedy tokens then changed at token 31."""
    params = SamplingParams(max_tokens=40, temperature=0.0)
    with LLM(EngineArgs(model=smollm2_gguf)) as llm:
        plain = [o.token_ids for o in llm.generate([COPY_TEXT, CHAT_TEXT], params)]
        alone = llm.generate([COPY_TEXT], params)[0].token_ids
    with LLM(EngineArgs(model=smollm2_gguf, speculative_config=NGRAM)) as llm:
        spec = [o.token_ids for o in llm.generate([COPY_TEXT, CHAT_TEXT], params)]
    assert plain[0] == alone
    assert spec == plain


def test_default_model_budget_stop_strings_and_eos(smollm2_gguf):
    prompts = [COPY_TEXT, CHAT_TEXT]
    budgets = [SamplingParams(max_tokens=n, temperature=0.0) for n in (1, 2, 7, 13)]
    stops = SamplingParams(max_tokens=40, temperature=0.0, stop=["lamp"])
    eos = SamplingParams(max_tokens=200, temperature=0.0)
    with LLM(EngineArgs(model=smollm2_gguf)) as llm:
        plain = [llm.generate(prompts, p) for p in (*budgets, stops, eos)]
    with LLM(EngineArgs(model=smollm2_gguf, speculative_config=NGRAM)) as llm:
        spec = [llm.generate(prompts, p) for p in (*budgets, stops, eos)]
    for params, a, b in zip((*budgets, stops, eos), plain, spec):
        assert [(o.token_ids, o.text, o.finish_reason) for o in b] == [(o.token_ids, o.text, o.finish_reason)
                                                                      for o in a]
        assert all(len(o.token_ids) <= params.max_tokens for o in b)
        assert [o.usage.completion_tokens for o in b] == [o.usage.completion_tokens for o in a]
    assert spec[-2][0].finish_reason == "stop" and "lamp" not in spec[-2][0].text
    assert any(o.finish_reason == "stop" for o in spec[-1]), "some request ends on EOS"


def test_default_model_streamed_tokens_equal(smollm2_gguf):
    params = SamplingParams(max_tokens=32, temperature=0.0)
    with LLM(EngineArgs(model=smollm2_gguf, speculative_config=NGRAM)) as llm:
        streamed = [i for event in llm.generate_stream(COPY_TEXT, params) for i in event.token_ids]
        whole = llm.generate([COPY_TEXT], params)[0].token_ids
    assert streamed == whole


def test_default_model_batched_with_other_requests(smollm2_gguf):
    """Speculating requests batched together (verify chunks of several requests in one step) keep their greedy
    tokens. Every prompt is prefilled in the first step, so that both engines run the same steps' kinds: the
    default model's decode steps (native int4) and its prefill steps (PyTorch reference) round differently, and a
    preempted request's recomputed KV would come from the latter (preemption is tested on the float32 models)."""
    prompts = [COPY_TEXT, CHAT_TEXT, COPY_TEXT.replace("lighthouse", "castle"), "Count from one to twenty: one,"]
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    plain, _ = _generate(EngineArgs(model=smollm2_gguf), prompts, params)
    spec, stats = _generate(EngineArgs(model=smollm2_gguf, speculative_config=NGRAM), prompts, params)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    assert stats["spec_verify_chunks"] > 0 and stats["spec_accepted_tokens"] > 0


def test_default_model_structured_output_next_to_speculating_requests(smollm2_gguf):
    """A constrained request does not speculate (its proposals are not grammar-checked); next to speculating
    requests in the same steps, every output equals the engine's without speculation."""
    from pocketllm.runner.grammar import xgrammar_available
    from pocketllm.sampling_params import StructuredOutput

    if not xgrammar_available():
        pytest.skip("xgrammar is not installed")
    constrained = SamplingParams(max_tokens=40, temperature=0.0, structured_output=StructuredOutput(json_object=True))
    free = SamplingParams(max_tokens=40, temperature=0.0)
    jobs = [(COPY_TEXT, free), ('Reply with a JSON object describing "The old lighthouse keeper".', constrained),
            (COPY_TEXT.replace("lighthouse", "castle"), free)]

    def run(args: EngineArgs) -> tuple[list, dict]:
        # The three requests are submitted from one event-loop turn, so that both engines see them arrive
        # together and prefill them in the same steps (threads would race the engine for each submission, and
        # a prompt prefilled beside a different batch may round differently).
        async def together(llm: AsyncLLM) -> list:
            return list(await asyncio.gather(*(llm.generate([text], params) for text, params in jobs)))

        async def main() -> tuple[list, dict]:
            async with AsyncLLM(args) as llm:
                outputs = await together(llm)
                return [o[0] for o in outputs], llm.stats()

        return asyncio.run(main())

    plain, _ = run(EngineArgs(model=smollm2_gguf))
    spec, stats = run(EngineArgs(model=smollm2_gguf, speculative_config=NGRAM))
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    assert stats["spec_accepted_tokens"] > 0
    json.loads(spec[1].text)


# ---------------------------------------------------------------------------------------------------------------
# tiny checkpoints (float32, the reference forward verifies)

TINY_PROMPTS = [[7, 8, 9, 10, 7, 8, 9, 10, 7, 8], [300, 301, 302, 303, 304], [5, 6, 7, 8] * 6, [901, 17, 901, 17]]


class OracleProposer(Proposer):
    """Proposes each request's known continuation (from a run without speculation), with the second proposal of
    every third step made wrong: random tiny models never repeat themselves, so prompt lookup alone would
    never have a proposal accepted there. Proposals are any tokens to the acceptance rule, which this exercises
    with accepted runs, rejections at every position, and all-accepted steps with a bonus token."""

    pipelines = True    # with the engine's steps pipelined, it proposes after the pending token too

    def __init__(self, continuations: dict[tuple[int, ...], list[int]], k: int = 4, pause_every: int = 0) -> None:
        self.continuations = continuations
        self.k = k
        self.pause_every = pause_every  # > 0: every that many calls, nothing (a plain step, which pipelines)
        self.calls = 0
        self.after_pending = 0      # non-empty proposals made while the request's last token was pending

    def propose(self, request: Request, limit: int) -> list[int]:
        if self.pause_every and self.calls % self.pause_every == 0:
            self.calls += 1
            return []
        return self._continuation(request, 0, limit)

    def propose_after_pending(self, request: Request, limit: int) -> list[int]:
        draft = self._continuation(request, 1, limit)
        self.after_pending += bool(draft)
        return draft

    def _continuation(self, request: Request, skip: int, limit: int) -> list[int]:
        self.calls += 1
        tokens = request.all_token_ids
        for prompt, expected in self.continuations.items():
            if tuple(tokens[:len(prompt)]) == prompt:
                done = len(tokens) - len(prompt) + skip
                draft = list(expected[done:done + min(self.k, limit)])
                if self.calls % 3 == 0 and len(draft) > 1:
                    draft[1] = (draft[1] + 1) % 1000
                return draft
        return []


def _with_proposer(llm: LLM, proposer: object) -> None:
    llm._client.backend.core.scheduler.proposer = proposer


def _assert_oracle_equal(args: EngineArgs, params: SamplingParams, plain: list, pause_every: int = 0) -> dict:
    """Speculating with ``OracleProposer`` over ``TINY_PROMPTS`` gives ``plain``'s tokens, some proposals kept and
    some rejected; returns the engine's stats, with ``after_pending``: the proposals made while a step ran."""
    with LLM(args.replace(speculative_config=NGRAM)) as llm:
        oracle_proposer = OracleProposer({tuple(p): o.token_ids for p, o in zip(TINY_PROMPTS, plain)},
                                         pause_every=pause_every)
        _with_proposer(llm, oracle_proposer)
        oracle = llm.generate(TINY_PROMPTS, params)
        stats = llm.stats()
    assert [o.token_ids for o in oracle] == [o.token_ids for o in plain]
    assert 0 < stats["spec_accepted_tokens"] < stats["spec_proposed_tokens"]
    return {**stats, "after_pending": oracle_proposer.after_pending}


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "qwen3_moe", "mistral", "gemma3", "qwen3_5_text",
                                  "qwen3_5_moe_text", "deepseek_v4"])
@pytest.mark.parametrize("regime", ["default", "preemption", "penalties"])
def test_tiny_greedy_equal_with_speculation(arch, regime, tiny_checkpoint):
    """Qwen3.5 (recurrent Gated DeltaNet state beside the KV cache): a rejected proposal rolls the request's state
    slot back to the verify step's checkpoint after its last accepted position."""
    extra = {"num_kv_blocks": 16, "block_size": 4, "max_num_batched_tokens": 24} if regime == "preemption" else {}
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True,
                            **({"repetition_penalty": 1.3, "frequency_penalty": 0.4} if regime == "penalties"
                               else {}))
    args = EngineArgs(model=tiny_checkpoint(arch), backend="torch", **extra)   # Torch: auto runs Qwen3.5 natively
    plain, _ = _generate(args, TINY_PROMPTS, params)
    # Prompt lookup (random tiny models reject what it proposes, when it finds a repeated n-gram at all).
    spec, _ = _generate(args.replace(speculative_config=NGRAM), TINY_PROMPTS, params)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    # Proposals that are often right.
    stats = _assert_oracle_equal(args, params, plain)
    if regime == "preemption":
        assert stats["num_preemptions"] > 0


@pytest.mark.parametrize("arch", ["llama", "qwen3_5_text"])
@pytest.mark.parametrize("regime", ["default", "preemption"])
def test_tiny_greedy_equal_with_pipelined_speculation(arch, regime, tiny_checkpoint):
    """Steps pipelined (``async_scheduling="on"``, the CUDA default): prompt lookup proposes while a plain step
    runs, after its still pending token, and a verify step is read back before the next step is scheduled.
    Greedy tokens equal the pipelined engine's without speculation."""
    extra = {"num_kv_blocks": 16, "block_size": 4, "max_num_batched_tokens": 24} if regime == "preemption" else {}
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    args = EngineArgs(model=tiny_checkpoint(arch), backend="torch", async_scheduling="on", **extra)
    plain, _ = _generate(args, TINY_PROMPTS, params)
    spec, _ = _generate(args.replace(speculative_config=NGRAM), TINY_PROMPTS, params)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    stats = _assert_oracle_equal(args, params, plain, pause_every=2)
    assert 0 < stats["spec_pipelined_verify_chunks"] <= stats["after_pending"]
    if regime == "preemption":
        assert stats["num_preemptions"] > 0


@pytest.mark.parametrize("arch", ["llama", "qwen3_5_text"])
def test_tiny_one_request_pipelined_verify_steps(arch, tiny_checkpoint):
    """One request, steps pipelined, proposals every other step: most verify chunks start with a pending token,
    with proposals kept, rejected part way and all kept (Qwen3.5: its state rolled back after a pending first
    token); the tokens are those without speculation."""
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    args = EngineArgs(model=tiny_checkpoint(arch), backend="torch", async_scheduling="on")
    prompt = TINY_PROMPTS[2]
    plain, _ = _generate(args, [prompt], params)
    with LLM(args.replace(speculative_config=NGRAM)) as llm:
        proposer = OracleProposer({tuple(prompt): plain[0].token_ids}, pause_every=2)
        _with_proposer(llm, proposer)
        spec = llm.generate([prompt], params)
        stats = llm.stats()
    assert spec[0].token_ids == plain[0].token_ids
    assert 5 <= stats["spec_pipelined_verify_chunks"] <= proposer.after_pending
    assert 0 < stats["spec_accepted_tokens"] < stats["spec_proposed_tokens"]


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["llama", "qwen3_5_text", "qwen3_5_moe_text", "deepseek_v4"])
def test_cuda_greedy_equal_with_speculation(arch, tiny_checkpoint):
    """On CUDA (float32, the kernel path: verify steps replayed from graphs as decode rows; on Qwen3.5 a verify
    chunk's rows run the recurrent state in order and checkpoint it after each position; DeepSeek-V4: the
    reference step's graphs of grids), speculating with often-right proposals gives the tokens of the same engine
    without speculation."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    args = EngineArgs(model=tiny_checkpoint(arch), device="cuda", dtype="float32", num_kv_blocks=256)
    plain, _ = _generate(args, TINY_PROMPTS, params)
    stats = _assert_oracle_equal(args, params, plain, pause_every=2)
    assert stats["spec_graph_steps"] > 0 and stats["after_pending"] > 0     # pipelined by default on CUDA


def test_tiny_budget_is_never_exceeded(tiny_checkpoint):
    """However many proposals would be right, a request emits at most max_tokens tokens."""
    args = EngineArgs(model=tiny_checkpoint("llama"))
    long = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    plain, _ = _generate(args, TINY_PROMPTS, long)
    with LLM(args.replace(speculative_config=NGRAM)) as llm:
        _with_proposer(llm, OracleProposer({tuple(p): o.token_ids for p, o in zip(TINY_PROMPTS, plain)}, k=8))
        for budget in (1, 2, 3, 5, 9):
            params = dataclasses.replace(long, max_tokens=budget)
            outputs = llm.generate(TINY_PROMPTS, params)
            assert [o.token_ids for o in outputs] == [o.token_ids[:budget] for o in plain]
            assert all(o.finish_reason == "length" for o in outputs)


def test_tiny_logprobs_from_the_verify_logits(tiny_checkpoint):
    """Log-probabilities of accepted tokens come from the verify step's raw logits, ranked as the plain step's."""
    params = SamplingParams(max_tokens=24, temperature=0.0, logprobs=3, ignore_eos=True)
    args = EngineArgs(model=tiny_checkpoint("llama"))
    plain, _ = _generate(args, [TINY_PROMPTS[2]], params)
    with LLM(args.replace(speculative_config=NGRAM)) as llm:
        _with_proposer(llm, OracleProposer({tuple(TINY_PROMPTS[2]): plain[0].token_ids}))
        spec = llm.generate([TINY_PROMPTS[2]], params)
        stats = llm.stats()
    assert stats["spec_accepted_tokens"] > 0
    assert spec[0].token_ids == plain[0].token_ids and len(spec[0].logprobs) == 24
    for a, b in zip(plain[0].logprobs, spec[0].logprobs):
        assert a.token_id == b.token_id and math.isclose(a.logprob, b.logprob, abs_tol=1e-4)
        assert [t.token_id for t in a.top] == [t.token_id for t in b.top]


def test_tiny_mixed_batch_with_seeded_and_greedy_requests(tiny_checkpoint):
    """Speculating greedy requests next to seeded sampling ones: the greedy tokens are unchanged, and a seeded
    request gives the same tokens every time it runs in the speculating engine."""
    greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    seeded = SamplingParams(max_tokens=24, temperature=0.9, seed=11, ignore_eos=True)
    args = EngineArgs(model=tiny_checkpoint("llama"))
    plain, _ = _generate(args, TINY_PROMPTS, greedy)
    with LLM(args.replace(speculative_config=NGRAM)) as llm:
        _with_proposer(llm, OracleProposer({tuple(p): o.token_ids for p, o in zip(TINY_PROMPTS, plain)}))
        results: dict[int, list[int]] = {}

        def run(i: int, prompt: list[int], params: SamplingParams) -> None:
            results[i] = llm.generate([prompt], params)[0].token_ids

        jobs = [(i, p, greedy) for i, p in enumerate(TINY_PROMPTS)] + [(9, TINY_PROMPTS[2], seeded)]
        threads = [threading.Thread(target=run, args=job) for job in jobs]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        again = llm.generate([TINY_PROMPTS[2]], seeded)[0].token_ids
    assert [results[i] for i in range(len(TINY_PROMPTS))] == [o.token_ids for o in plain]
    assert results[9] == again


# ---------------------------------------------------------------------------------------------------------------
# sampling: in distribution against the plain sampler


def _first_tokens(args: EngineArgs, prompt: list[int], draws: int, params: SamplingParams,
                  proposer: object = None) -> tuple[list[tuple[int, ...]], dict]:
    with LLM(args) as llm:
        if proposer is not None:
            _with_proposer(llm, proposer)
        batch = BatchScheduler(llm, max_batch_size=64)
        ids = [batch.submit_request(prompt, dataclasses.replace(params, seed=s), request_id=f"draw-{s}")
               for s in range(draws)]
        outputs = [batch.poll_result(request_id, timeout_ms=600_000) for request_id in ids]
        return [tuple(o.token_ids) for o in outputs], llm.stats()


def assert_same_distribution(plain: list, spec: list) -> None:
    """``plain`` and ``spec`` (outcomes of many draws) come from one distribution: a chi-square two-sample test
    at about 1e-4 false-alarm rate."""
    outcomes = sorted(set(plain) | set(spec))
    a = torch.tensor([plain.count(o) for o in outcomes], dtype=torch.float64)
    b = torch.tensor([spec.count(o) for o in outcomes], dtype=torch.float64)
    frequent = (a + b) >= 10
    # Rare outcomes pooled into one cell, so that every expected count is large enough for the test.
    a = torch.cat([a[frequent], a[~frequent].sum().unsqueeze(0)])
    b = torch.cat([b[frequent], b[~frequent].sum().unsqueeze(0)])
    keep = (a + b) > 0
    a, b = a[keep], b[keep]
    assert len(a) >= 3, "the test needs several outcomes"
    total = a + b
    expected_a, expected_b = total * a.sum() / total.sum(), total * b.sum() / total.sum()
    chi2 = float(((a - expected_a) ** 2 / expected_a + (b - expected_b) ** 2 / expected_b).sum())
    assert chi2 < _chi_square_bound(len(a) - 1), (chi2, outcomes)


def test_seeded_sampling_is_distribution_correct(tiny_checkpoint):
    """The first three tokens of many seeded draws (the first from the prefill step, the next ones from verify
    steps), with and without speculation, come from one distribution: a chi-square two-sample test over the
    outcomes seen often enough (the rare ones pooled), at about 1e-4 false-alarm rate. The proposals are the
    most frequent outcome of the run without speculation (sometimes altered), so that they are often accepted,
    sometimes rejected, and accepted in full with a bonus token."""
    prompt = [5, 6, 7, 8] * 6
    params = SamplingParams(max_tokens=3, temperature=1.0, top_k=4, ignore_eos=True)
    args = EngineArgs(model=tiny_checkpoint("llama"), max_num_seqs=64)
    draws = 1500
    plain, _ = _first_tokens(args, prompt, draws, params)
    mode = max(set(plain), key=plain.count)
    spec, stats = _first_tokens(args.replace(speculative_config=NGRAM), prompt, draws, params,
                                OracleProposer({tuple(prompt): list(mode)}))
    assert stats["spec_verify_chunks"] > 0 and 0 < stats["spec_accepted_tokens"] < stats["spec_proposed_tokens"]
    assert_same_distribution(plain, spec)


# ---------------------------------------------------------------------------------------------------------------
# the benchmark


def test_bench_compares_with_and_without_speculation(tiny_checkpoint, monkeypatch, capsys):
    from argparse import Namespace

    from pocketllm.bench import speculative

    monkeypatch.setattr(speculative, "PROMPT_SETS", {"editing": ("Repeat: a b c a b c",), "chat": ("Hello",)})
    args = Namespace(output_len=12, num_iters=1, output_json=None)
    result = speculative.run(args, EngineArgs(model=tiny_checkpoint("llama"), speculative_config=NGRAM))
    assert set(result["sets"]) == {"editing", "chat"}
    for entry in result["sets"].values():
        assert entry["same_tokens"]
        assert entry["with"]["decode_tokens"] == entry["without"]["decode_tokens"] > 0
        assert entry["without"]["verify_steps"] == 0
        assert "verify_step_ms_estimate" in entry
    assert result["speculative_config"] == NGRAM
    printed = capsys.readouterr().out
    assert "mean acceptance length" in printed and "a verify step about" in printed


def test_bench_estimates_a_verify_step_from_the_steps_around_it():
    """30 ms of decoding in 10 steps, 4 of them verify steps, where a plain step takes 2 ms: 6 plain steps take
    12 ms, so a verify step 4.5 ms; no verify step (or no plain rate) gives no estimate."""
    from pocketllm.bench.speculative import _verify_step_ms

    without = {"ms_per_step": 2.0}
    assert _verify_step_ms(without, {"decode_s": 0.030, "decode_steps": 10, "verify_steps": 4}) == pytest.approx(4.5)
    assert _verify_step_ms(without, {"decode_s": 0.030, "decode_steps": 10, "verify_steps": 0}) is None
    assert _verify_step_ms({"ms_per_step": None}, {"decode_s": 0.030, "decode_steps": 10, "verify_steps": 4}) is None
