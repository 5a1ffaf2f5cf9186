"""The native engine's session API beyond prefill/decode_step: ``verify`` (a draft scored in one forward, kept while
the session's sampler draws it) gives exactly the tokens decode steps give, greedy and seeded, on Qwen3, Qwen3.5
(whose recurrent state is restored past a rejection) and a 4-bit GGUF; ``decode`` stops at EOS; ``warmup``
leaves the session, the sampler's stream and the prefix cache alone; bad drafts are refused."""

from __future__ import annotations

import pytest
from test_native_q4 import needs_kernel, tiny_q4_1  # noqa: F401 (a fixture)

PROMPT = [5, 17, 301, 42, 9, 77, 100, 23, 4, 61]
NEW_TOKENS = 30
# Each step's draft: how many tokens of the true continuation it proposes, then whether its last one is wrong.
DRAFTS = [(3, False), (4, True), (1, True), (0, False), (5, False), (2, True), (6, True), (3, False)]

pytestmark = pytest.mark.usefixtures("one_thread")


def _engine(native, path: str, temperature: float = 0.0, seed: int = -1, **fields):
    options = native.QwenEngineOptions()
    options.kv_cache_mb = 16.0
    options.num_threads = 1
    options.sampling.temperature = temperature
    options.sampling.seed = seed
    for name, value in fields.items():
        setattr(options, name, value)
    return native.QwenEngine(path, options)


def _decoded(engine, n: int) -> list[int]:
    return [engine.prefill(PROMPT)] + [engine.decode_step() for _ in range(n - 1)]


def _speculated(engine, reference: list[int], vocab: int) -> tuple[list[int], int]:
    """Tokens of a session driven by ``verify`` with drafts cut from ``reference`` (some with a wrong last token)
    until it has at least as many as ``reference`` less 8, and how many draft tokens were kept."""
    out = [engine.prefill(PROMPT)]
    kept = turn = 0
    while len(out) < len(reference) - 8:
        length, wrong = DRAFTS[turn % len(DRAFTS)]
        turn += 1
        draft = list(reference[len(out):len(out) + length])
        if wrong and draft:
            draft[-1] = (draft[-1] + 1) % vocab
        tokens = engine.verify(draft)
        assert 1 <= len(tokens) <= len(draft) + 1
        assert tokens[:-1] == draft[:len(tokens) - 1]
        kept += len(tokens) - 1
        out += tokens
    return out, kept


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_5_text"])
def test_greedy_verify_equals_decode_steps(native, tiny_checkpoint, arch):
    path = tiny_checkpoint(arch)
    engine = _engine(native, path)
    reference = _decoded(engine, NEW_TOKENS)
    spec, kept = _speculated(engine, reference, engine.vocab_size)
    assert spec == reference[:len(spec)]
    assert kept >= 10   # the right draft tokens were kept, not only re-drawn
    # The session goes on from the kept tokens: KV and recurrent state are those of the accepted text.
    assert engine.decode_step() == reference[len(spec)]


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_5_text"])
def test_seeded_sampling_verify_draws_what_decode_steps_draw(native, tiny_checkpoint, arch):
    """A draft token is kept when the sampler's draw equals it (probability exactly its own), so with one seed
    the tokens equal the decode steps' draws, whatever the drafts."""
    path = tiny_checkpoint(arch)
    reference = _decoded(_engine(native, path, temperature=0.9, seed=7), NEW_TOKENS)
    assert len(set(reference)) > 5   # sampled, not a repeated greedy token
    engine = _engine(native, path, temperature=0.9, seed=7)
    spec, kept = _speculated(engine, reference, engine.vocab_size)
    assert spec == reference[:len(spec)]
    assert kept >= 10
    assert engine.decode_step() == reference[len(spec)]


@needs_kernel
def test_verify_on_4_bit_weights_equals_decode_steps(native, tiny_q4_1):  # noqa: F811 (the fixture)
    engine = _engine(native, tiny_q4_1)
    assert engine.weight_format == "int4"
    reference = _decoded(engine, NEW_TOKENS)
    spec = _speculated(engine, reference, engine.vocab_size)[0]
    assert spec == reference[:len(spec)]


def test_empty_draft_is_a_decode_step_and_bad_drafts_are_refused(native, tiny_checkpoint):
    engine = _engine(native, tiny_checkpoint("qwen3"), max_model_len=24)
    with pytest.raises(RuntimeError, match="prefill"):
        engine.verify([1])
    reference = _decoded(engine, 4)
    engine.prefill(PROMPT)
    assert [engine.verify([])[0] for _ in range(3)] == reference[1:]
    with pytest.raises(ValueError, match="vocabulary"):
        engine.verify([engine.vocab_size])
    length = engine.session_length
    with pytest.raises(ValueError, match="context"):
        engine.verify([0] * (24 - length))
    assert engine.session_length == length
    assert len(engine.verify([0] * (23 - length))) >= 1


def test_decode_stops_at_eos(native, tiny_checkpoint):
    path = tiny_checkpoint("qwen3")
    reference = _decoded(_engine(native, path), 12)
    eos = reference[6]
    first = reference.index(eos)
    engine = _engine(native, path, eos_token_ids=[eos])
    engine.prefill(PROMPT)
    assert engine.decode(50) == reference[1:first + 1]
    assert engine.decode(2) == _decoded(_engine(native, path), first + 3)[first + 1:]


def test_warmup_leaves_the_session_stream_and_prefix_cache(native, tiny_checkpoint):
    path = tiny_checkpoint("qwen3")
    reference = _decoded(_engine(native, path, temperature=0.9, seed=3), 8)
    engine = _engine(native, path, temperature=0.9, seed=3)
    assert engine.warmup() > 0
    tokens = [engine.prefill(PROMPT)] + [engine.decode_step() for _ in range(3)]
    assert engine.warmup() > 0
    tokens += [engine.decode_step() for _ in range(4)]
    assert tokens == reference
    # The scratch prompt registered nothing: a new session of the warm-up's tokens finds no cached prefix.
    engine.prefill([0] * 40)
    assert engine.session_cached_tokens == 0
