"""Speculative decoding's acceptance rule: which proposed tokens a request keeps, from one forward's scores.

A verify chunk scores the request's last token and its ``k`` proposals in one forward: row ``j`` holds the
target's scores for the token after proposal ``j - 1``. Each row is processed as the request's sampler would
process it at that point (penalties count the proposals before it). Greedy: accept while the target's argmax
equals the proposal, then emit the target's own token. Sampling, with ``x`` drawn from the draft's distribution
``q``: accept ``x`` with probability ``min(1, p(x) / q(x))``; on rejection draw from ``max(0, p - q)``,
renormalised; with every proposal accepted, draw a bonus token from the last row. A proposal without a
distribution (prompt lookup, a greedy draft) is a point mass: accepted with probability ``p(x)``, and a
rejection draws from ``p`` without ``x``. Each emitted token is then distributed as the plain sampler's would
be. Draws come from the request's own generator (or the shared one), one uniform each.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pocketllm.runner.sampler import Sampler, SamplingRow, argmax_rows
from pocketllm.step.sampled import SampledToken
from pocketllm.step.scheduled_chunk import ScheduledChunk


def _uniform(sampler: Sampler, generator: torch.Generator | None, device: torch.device) -> torch.Tensor:
    """One float64 uniform in [0, 1) of shape [1] on the CPU, from the request's generator or the shared one."""
    gen = generator if generator is not None else sampler.shared_generator(device)
    return torch.rand(1, dtype=torch.float64, generator=gen, device=gen.device).cpu()


def _draw(probs: torch.Tensor, u: torch.Tensor) -> int:
    """Token ``i`` with probability ``probs[i] / probs.sum()`` by inverting the cumulative sum at ``u``."""
    cdf = probs.cumsum(0)
    total = cdf[-1]
    target = torch.minimum(u * total, torch.nextafter(total, torch.zeros_like(total)))
    return int(torch.searchsorted(cdf, target, right=True).clamp_(max=probs.numel() - 1))


def accept_greedy(targets: Sequence[int], draft: Sequence[int]) -> list[int]:
    """The tokens a greedy request emits from the target's argmax ``targets`` of its ``k + 1`` rows and its ``k``
    proposals: the proposals up to the first that differs from the target's token, then the target's token."""
    out: list[int] = []
    for j, proposal in enumerate(draft):
        if targets[j] != proposal:
            return out + [targets[j]]
        out.append(proposal)
    return out + [targets[len(draft)]]


def accept(scores: torch.Tensor, draft: Sequence[int], greedy: bool, sampler: Sampler,
           generator: torch.Generator | None, device: torch.device,
           draft_probs: torch.Tensor | None = None) -> list[int]:
    """The tokens a request emits from its ``[k + 1, V]`` processed scores (CPU float32) and its ``k``
    proposals: the accepted proposals, then the target's token (a correction or the bonus). ``draft_probs``:
    the ``[k, V]`` distributions the proposals were drawn from (None: point masses)."""
    if greedy:
        return accept_greedy(argmax_rows(scores).tolist(), draft)
    out = []
    for j, proposal in enumerate(draft):
        probs = torch.softmax(scores[j].double(), dim=-1)
        q = 1.0 if draft_probs is None else draft_probs[j, proposal].item()
        if _uniform(sampler, generator, device).item() * q < probs[proposal].item():
            out.append(proposal)
            continue
        if draft_probs is None:
            probs[proposal] = 0.0
        else:
            residual = (probs - draft_probs[j].to(probs.dtype)).clamp_(min=0.0)
            # p and q equal to rounding leave nothing: then p itself (a rejection that rounding alone made).
            probs = residual if residual.sum().item() > 0 else probs
        return out + [_draw(probs, _uniform(sampler, generator, device))]
    # The bonus token is drawn exactly as the plain sampler draws on the CPU.
    last = scores[len(draft):len(draft) + 1]
    return out + [int(Sampler._inverse_cdf(last, _uniform(sampler, generator, device))[0])]


def draw_proposals(sampler: Sampler, logits: torch.Tensor, rows: Sequence[SamplingRow]
                   ) -> tuple[list[int], list[torch.Tensor | None]]:
    """A draft model's next proposal for each row of its ``logits``, processed as the target's rows are: a
    greedy request's argmax, or a draw from a sampling request's distribution ``q``, returned with ``q`` (float64,
    CPU) for the acceptance rule (None for a greedy row). Draws use the request's generator (or the shared one),
    one uniform each."""
    scores = sampler.processed_scores(logits, rows)
    tokens = argmax_rows(scores).tolist()
    dists: list[torch.Tensor | None] = [None] * len(rows)
    sampled = [i for i, row in enumerate(rows) if not row.params.greedy]
    if sampled:
        probs = torch.softmax(scores[sampled].double(), dim=-1).cpu()
        for j, i in enumerate(sampled):
            tokens[i] = _draw(probs[j], _uniform(sampler, rows[i].generator, logits.device))
            dists[i] = probs[j]
    return tokens, dists


def _with_logprobs(raw: torch.Tensor | None, tokens: list[int], count: int | None) -> list[SampledToken]:
    """Tokens with their raw log-probabilities (row ``j`` of ``raw`` scored token ``j``) and ``count`` ranked
    alternatives; plain tokens when ``count`` is None."""
    if count is None:
        return [SampledToken(t) for t in tokens]
    lp = torch.log_softmax(raw[:len(tokens)].float(), dim=-1)
    out = []
    for j, token in enumerate(tokens):
        sampled = SampledToken(token, float(lp[j, token]))
        if count > 0:
            values, ids = lp[j].topk(min(count, lp.shape[-1]))
            sampled.top_ids, sampled.top_logprobs = ids.tolist(), values.tolist()
        out.append(sampled)
    return out


def verify(sampler: Sampler, logits: torch.Tensor, chunks: Sequence[ScheduledChunk],
           forced: bool = False) -> list[list[SampledToken]]:
    """The tokens each sampling chunk emits, from ``logits`` (``1 + len(draft)`` rows per sampling chunk, in
    chunk order); a chunk without proposals emits one token, drawn as the plain sampler draws it. ``forced``
    (benchmarking the mechanics only): every proposal is kept, then the target's token after them."""
    rows: list[SamplingRow] = []
    spans: list[tuple[ScheduledChunk, int]] = []
    for chunk in chunks:
        if not chunk.samples:
            continue
        request = chunk.request
        spans.append((chunk, len(rows)))
        output = list(request.output_token_ids)
        for j in range(len(chunk.draft) + 1):
            rows.append(SamplingRow(request.params, request.prompt_token_ids,
                                    output + list(chunk.draft[:j]), request.generator, request.grammar))
    scores = sampler.processed_scores(logits, rows)
    # Greedy rows need only the target's argmax: every row's is read back as one small tensor of ids. Only the
    # rows of sampling requests (the acceptance draws) and of requests asking for logprobs copy scores back.
    targets = argmax_rows(scores).tolist()
    drawing = [(chunk, start) for chunk, start in spans if not chunk.request.params.greedy]
    drawn = _host_rows(scores, drawing)
    ranked = _host_rows(logits, [(c, s) for c, s in spans if c.request.params.logprobs is not None])
    results = []
    for chunk, start in spans:
        request = chunk.request
        width = len(chunk.draft) + 1
        if request.params.greedy:
            own = targets[start:start + width]
            tokens = list(chunk.draft) + own[-1:] if forced else accept_greedy(own, chunk.draft)
        elif forced:
            last = drawn[start][width - 1:width]
            tokens = list(chunk.draft) + accept(last, (), False, sampler, request.generator, logits.device)
        else:
            tokens = accept(drawn[start], chunk.draft, False, sampler, request.generator, logits.device,
                            chunk.draft_probs)
        results.append(_with_logprobs(ranked.get(start), tokens, request.params.logprobs))
    return results


def _host_rows(x: torch.Tensor, spans: Sequence[tuple[ScheduledChunk, int]]) -> dict[int, torch.Tensor]:
    """Each span's ``1 + len(draft)`` rows of ``x`` on the CPU, copied back in one transfer, by the span's first
    row."""
    if not spans:
        return {}
    index = [start + j for chunk, start in spans for j in range(len(chunk.draft) + 1)]
    host = x.index_select(0, torch.tensor(index, device=x.device)).cpu()
    out, at = {}, 0
    for chunk, start in spans:
        width = len(chunk.draft) + 1
        out[start] = host[at:at + width]
        at += width
    return out
