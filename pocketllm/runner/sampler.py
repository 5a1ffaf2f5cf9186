"""Batched token sampler: logit processing, greedy / stochastic selection and raw log-probabilities.

The model runner hands the sampler one ``[B, V]`` float32 logits tensor per step together with one
:class:`SamplingRow` per batch row, and gets back one :class:`SampledToken` per row.

Processing order (on a float32 copy, only made when something has to be modified):

0. rows with a grammar (structured outputs) get every token the grammar does not allow set to ``-inf``;
1. ``logit_bias`` is added;
2. ``repetition_penalty`` over prompt + output tokens (a positive logit is divided by the penalty, any
   other logit multiplied by it);
3. ``frequency_penalty`` / ``presence_penalty`` over output tokens (OpenAI's definition:
   ``logit -= count * frequency + (count > 0) * presence``);
4. greedy rows (``temperature == 0``) take the argmax of the processed logits;
5. sampling rows are divided by their temperature, then ``min_p``, ``top_k`` and ``top_p`` mask tokens
   out, and the token is drawn: on CPU by inverting the row's cumulative distribution at one uniform
   ``u ~ U[0, 1)``; on CUDA with an exponential race: ``q ~ Exp(1)`` of shape ``[V]`` and
   ``token = argmax(probs / q)`` (computed as ``argmax(logits - log q)``, which needs no softmax), or its
   fused Gumbel-max form (``kernels/sampling.py``).

A row that owns a :class:`torch.Generator` draws the same amount from it every sampled step (one uniform
on CPU, one ``[V]`` vector or one seed on CUDA) and nothing else, and every operation applied to a row
depends only on that row, so a seeded request produces the same tokens whatever else is in the batch and
wherever it sits. Rows without a generator
share the sampler's generator and are drawn together.

Log-probabilities are ``log_softmax`` of the *raw* logits over the whole vocabulary, before any of the
processing above, so they describe the model's distribution rather than the sampler's candidate set.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from pocketllm.kernels import available as kernels_available
from pocketllm.runner.grammar import apply_bitmask, fill_bitmask
from pocketllm.sampling_params import SamplingParams
from pocketllm.step.host_to_device import device_tensor
from pocketllm.step.sampled import SampledToken, SampleResult

__all__ = ["Sampler", "SamplingRow"]


@dataclass
class SamplingRow:
    """One request's row in this step's batch."""

    params: SamplingParams
    # For repetition_penalty (applied over prompt + output, as HF does).
    prompt_token_ids: Sequence[int]
    # Generated so far (frequency/presence penalties count these, OpenAI's definition).
    output_token_ids: Sequence[int]
    # Per-request generator when params.seed is set (created and owned by the engine, seeded once with
    # the seed); None -> the sampler's shared generator.
    generator: torch.Generator | None = None
    # The request's grammar matcher (runner.grammar.GrammarMatcher) when its output is constrained; the
    # engine advances it after each appended token, the sampler only reads the allowed set.
    grammar: Any = None


def _needs_processing(params: SamplingParams) -> bool:
    return bool(params.logit_bias) or params.needs_penalties


ARGMAX_CHUNK = 1024


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """``x.argmax(dim=-1)`` of a ``[B, V]`` tensor, the same index (first of equal maxima, NaN counting as
    largest). On CPU through the maxima of chunks of ``ARGMAX_CHUNK``: torch's CPU argmax of a long row runs
    ~10x slower than its max (measured 100 µs against 10 µs for 49,152 logits), so this takes the max of
    every chunk, the argmax over those few maxima, and the argmax inside the one chunk that won."""
    rows, vocab = x.shape
    if x.device.type != "cpu" or vocab % ARGMAX_CHUNK or vocab < 4 * ARGMAX_CHUNK:
        return x.argmax(dim=-1)
    chunks = x.reshape(rows, vocab // ARGMAX_CHUNK, ARGMAX_CHUNK)
    best = chunks.amax(dim=-1).argmax(dim=-1)
    inside = chunks[torch.arange(rows), best].argmax(dim=-1)
    return best * ARGMAX_CHUNK + inside


class Sampler:
    """Turns a batch of logits into one token per row according to each row's :class:`SamplingParams`."""

    def __init__(self, seed: int | None = None) -> None:
        """Create a sampler whose shared generator is seeded with ``seed`` (random when ``None``).

        One shared generator is kept per device the logits arrive on, each seeded the same way.
        """
        self._seed = seed
        self._generators: dict[torch.device, torch.Generator] = {}

    # ------------------------------------------------------------------------------------------------
    # public entry point

    def __call__(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> list[SampledToken]:
        """Sample one token per row of ``logits`` (``[B, V]``, any device); ``len(rows) == B``."""
        return self.sample_async(logits, rows).to_host()

    def sample_async(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> SampleResult:
        """Queue the sampling of one token per row; nothing waits for the device until ``to_host``."""
        batch = len(rows)
        params = [row.params for row in rows]
        if batch == 0:
            return SampleResult(torch.empty(0, dtype=torch.long, device=logits.device), params)
        grammar_rows = [i for i, row in enumerate(rows) if row.grammar is not None]
        plain_greedy = not grammar_rows and all(
            p.greedy and p.logprobs is None and not _needs_processing(p) for p in params)
        if plain_greedy:
            # Fast path: one argmax over the raw logits, no copies.
            if kernels_available(logits.device):
                from pocketllm.kernels.sampling import greedy_argmax

                return SampleResult(greedy_argmax(logits), params)
            return SampleResult(argmax_rows(logits), params)

        device = logits.device
        vocab = logits.shape[-1]

        # 1. Raw log-probabilities for the rows that ask (computed before anything touches the logits).
        lp_rows = [i for i, p in enumerate(params) if p.logprobs is not None]
        raw_logprobs: torch.Tensor | None = None
        top: tuple[torch.Tensor, torch.Tensor] | None = None
        if lp_rows:
            raw = logits if len(lp_rows) == batch else logits.index_select(0, self._index(lp_rows, device))
            raw_logprobs = torch.log_softmax(raw.float(), dim=-1)
            k = min(max(params[i].logprobs or 0 for i in lp_rows), vocab)
            if k > 0:
                top = raw_logprobs.topk(k, dim=-1)

        # 2. Processed logits: grammar mask, bias and penalties on a float32 copy (made only when needed; the
        #    logits otherwise stay in the model's dtype).
        processing = any(_needs_processing(p) for p in params)
        x = logits.to(torch.float32, copy=True) if grammar_rows or processing else logits
        if grammar_rows:
            matchers = [rows[i].grammar for i in grammar_rows]
            bitmask = fill_bitmask(matchers, math.ceil(matchers[0].vocab_size / 32))
            if bitmask is not None:
                apply_bitmask(x, bitmask, grammar_rows)
        if processing:
            self._apply_logit_bias(x, params)
            self._apply_penalties(x, rows)

        # 3. Greedy rows take the argmax; sampling rows overwrite their entries below.
        sample_rows = [i for i, p in enumerate(params) if not p.greedy]
        if not sample_rows:
            tokens = argmax_rows(x)
        elif len(sample_rows) == batch:
            tokens = self._sample(x, rows, sample_rows)
        else:
            tokens = argmax_rows(x)
            tokens[self._index(sample_rows, device)] = self._sample(x, rows, sample_rows)

        picked = None
        if raw_logprobs is not None:
            chosen = tokens.index_select(0, self._index(lp_rows, device)) if len(lp_rows) < batch else tokens
            picked = raw_logprobs.gather(1, chosen.unsqueeze(1)).squeeze(1)
        return SampleResult(tokens, params, lp_rows, picked, top)

    # ------------------------------------------------------------------------------------------------
    # helpers

    def shared_generator(self, device: torch.device | str) -> torch.Generator:
        """The shared generator used on ``device`` by rows that bring none of their own."""
        device = torch.device(device)
        gen = self._generators.get(device)
        if gen is None:
            gen = torch.Generator(device=device)
            if self._seed is None:
                gen.seed()
            else:
                gen.manual_seed(self._seed)
            self._generators[device] = gen
        return gen

    @staticmethod
    def _index(indices: Sequence[int], device: torch.device) -> torch.Tensor:
        return device_tensor(indices, torch.long, device)

    @staticmethod
    def _apply_logit_bias(x: torch.Tensor, params: Sequence[SamplingParams]) -> None:
        """Add every row's ``logit_bias`` in one scatter; ids outside the vocabulary are ignored."""
        vocab = x.shape[-1]
        r_idx: list[int] = []
        c_idx: list[int] = []
        vals: list[float] = []
        for i, p in enumerate(params):
            for token, bias in p.logit_bias.items():
                if token < vocab:
                    r_idx.append(i)
                    c_idx.append(token)
                    vals.append(bias)
        if not vals:
            return
        device = x.device
        x.index_put_(
            (device_tensor(r_idx, torch.long, device),
             device_tensor(c_idx, torch.long, device)),
            device_tensor(vals, x.dtype, device),
            accumulate=True,
        )

    @staticmethod
    def _flat_ids(seqs: Sequence[Sequence[int]], vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(row, token) index pairs on CPU for a list of token sequences, dropping out-of-vocab ids."""
        rows = []
        cols = []
        for j, seq in enumerate(seqs):
            ids = torch.as_tensor(seq, dtype=torch.long).reshape(-1)
            if ids.numel() == 0:
                continue
            rows.append(torch.full_like(ids, j))
            cols.append(ids)
        if not cols:
            empty = torch.empty(0, dtype=torch.long)
            return empty, empty
        r = torch.cat(rows)
        c = torch.cat(cols)
        keep = (c >= 0) & (c < vocab)
        return r[keep], c[keep]

    def _apply_penalties(self, x: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
        """Repetition penalty (HF rule, prompt + output), then frequency / presence (OpenAI, output)."""
        vocab = x.shape[-1]
        device = x.device

        rep = [i for i, r in enumerate(rows) if r.params.repetition_penalty != 1.0]
        if rep:
            seqs = [list(rows[i].prompt_token_ids) + list(rows[i].output_token_ids) for i in rep]
            r, c = self._flat_ids(seqs, vocab)
            if c.numel():
                idx = self._index(rep, device)
                sub = x.index_select(0, idx)
                mask = torch.zeros_like(sub, dtype=torch.bool)
                mask[r.to(device), c.to(device)] = True
                penalty = torch.tensor([rows[i].params.repetition_penalty for i in rep],
                                       dtype=x.dtype, device=device).unsqueeze(1)
                penalised = torch.where(sub > 0, sub / penalty, sub * penalty)
                x.index_copy_(0, idx, torch.where(mask, penalised, sub))

        freq = [i for i, r in enumerate(rows)
                if r.params.frequency_penalty != 0.0 or r.params.presence_penalty != 0.0]
        if freq:
            r, c = self._flat_ids([rows[i].output_token_ids for i in freq], vocab)
            if c.numel():
                idx = self._index(freq, device)
                counts = torch.zeros(len(freq), vocab, dtype=x.dtype, device=device)
                counts.index_put_((r.to(device), c.to(device)),
                                  torch.ones(c.numel(), dtype=x.dtype, device=device), accumulate=True)
                f = torch.tensor([rows[i].params.frequency_penalty for i in freq],
                                 dtype=x.dtype, device=device).unsqueeze(1)
                p = torch.tensor([rows[i].params.presence_penalty for i in freq],
                                 dtype=x.dtype, device=device).unsqueeze(1)
                delta = counts * f + (counts > 0).to(x.dtype) * p
                x.index_copy_(0, idx, x.index_select(0, idx) - delta)

    def _sample(self, x: torch.Tensor, rows: Sequence[SamplingRow], sample_rows: list[int]) -> torch.Tensor:
        """Temperature, min-p, top-k, top-p and the exponential race for the sampling rows."""
        device = x.device
        vocab = x.shape[-1]
        n = len(sample_rows)
        params = [rows[i].params for i in sample_rows]

        base = x if n == x.shape[0] else x.index_select(0, self._index(sample_rows, device))
        if device.type == "cuda" and kernels_available(device) and not any(
                p.min_p > 0.0 or 0 < p.top_k < vocab or p.top_p < 1.0 for p in params):
            # Temperature only: one fused pass (kernels/sampling.py), the same distribution.
            from pocketllm.kernels.sampling import gumbel_argmax

            temps = device_tensor([p.temperature for p in params], torch.float32, device)
            return gumbel_argmax(base, temps, self._seeds(rows, sample_rows, device))
        s = self._truncated(base, params)
        if device.type == "cpu":
            return self._inverse_cdf(s, self._uniforms(rows, sample_rows))
        # Exponential race: token = argmax(p / q) = argmax(logit - log q), q ~ Exp(1) per token.
        q = torch.empty(n, vocab, dtype=torch.float32, device=device)
        shared = [j for j, i in enumerate(sample_rows) if rows[i].generator is None]
        if shared:
            gen = self.shared_generator(device)
            draw = torch.empty(len(shared), vocab, dtype=torch.float32, device=device).exponential_(
                generator=gen)
            if len(shared) == n:
                q = draw
            else:
                q.index_copy_(0, self._index(shared, device), draw)
        for j, i in enumerate(sample_rows):
            gen = rows[i].generator
            if gen is None:
                continue
            own = torch.empty(vocab, dtype=torch.float32, device=gen.device).exponential_(generator=gen)
            q[j].copy_(own)
        q.clamp_(min=torch.finfo(torch.float32).tiny).log_()
        return (s - q).argmax(dim=-1)

    def processed_scores(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
        """``[B, V]`` float32 scores of what each row samples from: the logits after its grammar mask, bias and
        penalties, and for a sampling row its temperature and min-p / top-k / top-p masks (the row draws from
        their softmax; a greedy row takes their argmax)."""
        params = [row.params for row in rows]
        x = logits.to(torch.float32, copy=True)
        grammar_rows = [i for i, row in enumerate(rows) if row.grammar is not None]
        if grammar_rows:
            matchers = [rows[i].grammar for i in grammar_rows]
            bitmask = fill_bitmask(matchers, math.ceil(matchers[0].vocab_size / 32))
            if bitmask is not None:
                apply_bitmask(x, bitmask, grammar_rows)
        if any(_needs_processing(p) for p in params):
            self._apply_logit_bias(x, params)
            self._apply_penalties(x, rows)
        sample_rows = [i for i, p in enumerate(params) if not p.greedy]
        if sample_rows:
            idx = self._index(sample_rows, x.device)
            x.index_copy_(0, idx, self._truncated(x.index_select(0, idx), [params[i] for i in sample_rows]))
        return x

    def _truncated(self, base: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
        """Sampling rows' logits divided by their temperature, with min-p, top-k and top-p masks (a new tensor)."""
        device = base.device
        vocab = base.shape[-1]
        temps = device_tensor([p.temperature for p in params], torch.float32, device).unsqueeze(1)
        s = base / temps  # a fresh tensor: safe to modify in place below

        # min_p: drop tokens whose probability is below min_p * max probability, i.e. in log space
        # logit < max_logit + log(min_p).
        mp_rows = [j for j, p in enumerate(params) if p.min_p > 0.0]
        if mp_rows:
            idx = self._index(mp_rows, device)
            sub = s.index_select(0, idx)
            log_min_p = device_tensor([math.log(params[j].min_p) for j in mp_rows], s.dtype, device).unsqueeze(1)
            floor = sub.amax(dim=-1, keepdim=True) + log_min_p
            s.index_copy_(0, idx, sub.masked_fill(sub < floor, -math.inf))

        # top_k / top_p on the rows that use them.
        trunc_rows = [j for j, p in enumerate(params)
                      if (0 < p.top_k < vocab) or p.top_p < 1.0]
        if trunc_rows:
            idx = self._index(trunc_rows, device)
            sub = s.index_select(0, idx)
            top_k = [params[j].top_k if 0 < params[j].top_k < vocab else vocab for j in trunc_rows]
            top_p = [params[j].top_p for j in trunc_rows]
            s.index_copy_(0, idx, self._truncate(sub, top_k, top_p))
        return s

    def _uniforms(self, rows: Sequence[SamplingRow], sample_rows: list[int]) -> torch.Tensor:
        """One float64 uniform in [0, 1) per sampling row (CPU): rows with their own generator draw it from
        theirs, the others from the shared generator (in row order)."""
        n = len(sample_rows)
        shared = [j for j, i in enumerate(sample_rows) if rows[i].generator is None]
        u = torch.empty(n, dtype=torch.float64)
        if shared:
            draw = torch.rand(len(shared), dtype=torch.float64, generator=self.shared_generator("cpu"))
            u = draw if len(shared) == n else u.index_copy_(0, torch.tensor(shared), draw)
        for j, i in enumerate(sample_rows):
            gen = rows[i].generator
            if gen is not None:
                u[j:j + 1] = torch.rand(1, dtype=torch.float64, generator=gen)
        return u

    @staticmethod
    def _inverse_cdf(s: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        """Token ``i`` of each row with probability ``softmax(s)[i]``: the first token whose cumulative
        probability exceeds the row's uniform ``u`` (a token of probability 0 is never chosen). The same
        distribution as the exponential race, from one random number per row instead of one per token
        (drawing ``V`` exponentials is most of a CPU sampling step)."""
        cdf = torch.softmax(s, dim=-1).cumsum(dim=-1, dtype=torch.float64)
        total = cdf[:, -1]
        # Strictly below the total (``u * total`` may round up to it), so the pick has a probability above 0.
        target = torch.minimum(u * total, torch.nextafter(total, torch.zeros_like(total))).unsqueeze(1)
        return torch.searchsorted(cdf, target, right=True).squeeze(1).clamp_(max=s.shape[-1] - 1)

    def _seeds(self, rows: Sequence[SamplingRow], sample_rows: list[int], device: torch.device) -> torch.Tensor:
        """One Philox key per sampling row for this step, drawn on the device: rows with their own generator
        draw one value from it, the others from the shared generator (in row order)."""
        n = len(sample_rows)
        high = 1 << 62
        shared = [j for j, i in enumerate(sample_rows) if rows[i].generator is None]
        if len(shared) == n:
            return torch.randint(high, (n,), generator=self.shared_generator(device), device=device)
        seeds = torch.empty(n, dtype=torch.int64, device=device)
        if shared:
            draw = torch.randint(high, (len(shared),), generator=self.shared_generator(device), device=device)
            seeds.index_copy_(0, self._index(shared, device), draw)
        for j, i in enumerate(sample_rows):
            gen = rows[i].generator
            if gen is not None:
                seeds[j:j + 1].copy_(torch.randint(high, (1,), generator=gen, device=gen.device))
        return seeds

    @staticmethod
    def _truncate(s: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
        """Mask everything outside each row's top-k tokens and top-p nucleus with ``-inf``.

        ``top_k`` entries equal to the vocabulary size and ``top_p`` entries of 1 are no-ops. Kept
        logits are returned unchanged (bit for bit), so a row's result does not depend on which path
        handled it.
        """
        device = s.device
        vocab = s.shape[-1]
        k = device_tensor(top_k, torch.long, device).unsqueeze(1)
        if all(p >= 1.0 for p in top_p):
            # top-k only: a partial sort of the largest max(k) logits is enough.
            kmax = max(top_k)
            vals, ids = s.topk(kmax, dim=-1)
            pos = torch.arange(kmax, device=device).unsqueeze(0)
            vals = vals.masked_fill(pos >= k, -math.inf)
            return torch.full_like(s, -math.inf).scatter_(1, ids, vals)

        vals, ids = s.sort(dim=-1, descending=True, stable=True)
        pos = torch.arange(vocab, device=device).unsqueeze(0)
        vals = vals.masked_fill(pos >= k, -math.inf)
        probs = torch.softmax(vals, dim=-1)
        before = probs.cumsum(dim=-1) - probs  # probability mass strictly ahead of each token
        p = device_tensor(top_p, s.dtype, device).unsqueeze(1)
        # Keep the smallest prefix whose mass reaches top_p: drop a token once the mass ahead of it
        # already does. The first token has nothing ahead of it and is always kept; rows with
        # top_p == 1 drop nothing.
        drop = (before >= p) & (p < 1.0)
        vals = vals.masked_fill(drop, -math.inf)
        return torch.empty_like(s).scatter_(1, ids, vals)
