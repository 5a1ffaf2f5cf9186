"""The structured-output token mask in the sampler on CUDA (marked ``gpu``; matchers are stand-ins).

Run on a CUDA machine with ``pytest -m gpu tests/test_structured_outputs_gpu.py``; xgrammar is not needed.
"""

from __future__ import annotations

import pytest
import torch

from pocketllm.runner.grammar import apply_bitmask
from pocketllm.runner.sampler import Sampler, SamplingRow
from pocketllm.sampling_params import SamplingParams

pytestmark = pytest.mark.gpu



class _FixedSet:
    """A stand-in matcher allowing a fixed set of tokens (xgrammar's packing: bit t%32 of word t//32)."""

    def __init__(self, allowed: set[int], vocab_size: int) -> None:
        self.allowed = allowed
        self.vocab_size = vocab_size

    def fill(self, bitmask: torch.Tensor, row: int) -> bool:
        words = [0] * bitmask.shape[1]
        for t in self.allowed:
            words[t // 32] |= 1 << (t % 32)
        bitmask[row] = torch.tensor([w - (1 << 32) if w >= 1 << 31 else w for w in words], dtype=torch.int32)
        return True


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_sampler_grammar_mask_on_cuda():
    vocab = 49152
    allowed = {5, 31, 32, 1000, 49151}
    logits = torch.randn(4, vocab, device="cuda")
    cpu = logits.cpu()
    bitmask = torch.full((2, vocab // 32), -1, dtype=torch.int32)
    _FixedSet(allowed, vocab).fill(bitmask, 1)
    on_gpu, on_cpu = logits.clone(), cpu.clone()
    apply_bitmask(on_gpu, bitmask, [3, 0])
    apply_bitmask(on_cpu, bitmask, [3, 0])
    assert torch.equal(on_gpu.cpu(), on_cpu)
    rows = []
    for i, temperature in enumerate((0.0, 1.0, 0.0, 0.7)):
        params = SamplingParams(temperature=temperature, logprobs=1, seed=i if temperature else None,
                                repetition_penalty=1.2 if i == 3 else 1.0)
        gen = torch.Generator(device="cuda").manual_seed(i) if temperature else None
        grammar = _FixedSet(allowed, vocab) if i != 2 else None
        rows.append(SamplingRow(params, [1, 2], [5], gen, grammar))
    out = Sampler(seed=0)(logits, rows)
    raw = torch.log_softmax(logits.float(), dim=-1)
    for i, token in enumerate(out):
        if i != 2:
            assert token.token_id in allowed
        assert token.logprob == pytest.approx(float(raw[i, token.token_id]), abs=1e-4)
    assert out[0].token_id == max(allowed, key=lambda t: float(logits[0, t]))
    assert out[2].token_id == int(logits[2].argmax())
