"""Gated DeltaNet on CUDA at Qwen3.5-9B layer shapes: which implementation to use, by measurement.

Decode step (batch 1, 8, 64; conv update + rule + gated RMSNorm, from the in-projection's output to the
out-projection's input), timed inside a CUDA graph: the PyTorch reference ops, our Triton step (whole-head
blocks with the norm fused, and 32-wide value blocks with the norm in PyTorch), and fla's fused recurrent
kernel (PyTorch conv and norm around it) when ``fla`` imports. Prefill (1 x 2048 and 8 x 512 fresh tokens):
the PyTorch chunked reference against our varlen chunked rule (with its flat conv) and fla's varlen chunked
kernels (with the per-sequence PyTorch conv). Every fast path is checked against the
PyTorch reference (relative error of the output). Stops starting new rows after 70 s (fla autotunes on its first calls).

Usage: ``python scripts/bench_gated_delta.py`` on a CUDA machine (with fla installed, or on ``PYTHONPATH``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from types import SimpleNamespace

import torch
import torch.nn.functional as F

from pocketllm.kernels.gated_delta import gated_delta_decode
from pocketllm.kernels.gated_delta_fla import fla_available, fla_recurrent_step
from pocketllm.kernels.gemv import time_in_graph
from pocketllm.layers.gated_delta import GatedDeltaNet, causal_conv1d_step
from pocketllm.loaders.dummy import PRESETS
from pocketllm.step.attention_metadata import AttentionMetadata

PRESET = "qwen3.5-9b"
DTYPE = torch.bfloat16
DEADLINE_S = 70.0
STARTED = time.perf_counter()


def over_time() -> bool:
    return time.perf_counter() - STARTED > DEADLINE_S


def make_layer(slots: int) -> GatedDeltaNet:
    """A layer at the preset's shapes, random conv/gate/norm parameters, random states (no projections used)."""
    cfg = PRESETS[PRESET]
    config = SimpleNamespace(**{k: cfg[k] for k in (
        "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim",
        "linear_conv_kernel_dim", "hidden_size")}, rms_norm_eps=cfg.get("rms_norm_eps", 1e-6))
    layer = GatedDeltaNet(config)
    with torch.no_grad():
        layer.conv1d.weight.normal_(0, 0.3)
        layer.A_log.uniform_(-1, 1)
        layer.dt_bias.normal_(0, 1)
        layer.norm.weight.uniform_(0.5, 1.5)
    layer = layer.to(device="cuda", dtype=DTYPE)
    layer.conv_state = torch.randn(slots, layer.kernel_size - 1, layer.conv_dim, device="cuda", dtype=DTYPE)
    layer.ssm_state = torch.randn(slots, layer.num_v_heads, layer.head_k_dim, layer.head_v_dim, device="cuda") * 0.1
    return layer


def make_meta(q_lens: list[int], ctx: list[int], slots: list[int]) -> AttentionMetadata:
    starts = [0]
    for n in q_lens:
        starts.append(starts[-1] + n)
    as_int = lambda xs: torch.tensor(xs, dtype=torch.int32, device="cuda")
    return AttentionMetadata(
        slot_mapping=as_int([0] * starts[-1]), block_tables=as_int([[0]] * len(q_lens)), query_start=starts,
        context_lens=ctx, block_size=16, context_lens_gpu=as_int(ctx), query_start_gpu=as_int(starts),
        max_query_len=max(q_lens), state_slots=as_int(slots), state_slots_host=slots)


def projections(layer: GatedDeltaNet, tokens: int) -> tuple[torch.Tensor, ...]:
    """(mixed, z, b, a) as row-strided views of one in-projection output."""
    width = layer.conv_dim + layer.value_dim + 2 * layer.num_v_heads
    proj = torch.randn(tokens, width, device="cuda", dtype=DTYPE)
    return proj.split([layer.conv_dim, layer.value_dim, layer.num_v_heads, layer.num_v_heads], dim=-1)


def gates(layer: GatedDeltaNet, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    g = -layer.A_log.float().exp() * F.softplus(a.float() + layer.dt_bias.float())
    return g, b.float().sigmoid()


def rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30))


# ------------------------------------------------------------------------------------------------ decode

def decode_variants(layer: GatedDeltaNet, meta: AttentionMetadata, mixed, z, b, a) -> dict[str, Callable]:
    heads = (-1, layer.num_v_heads, layer.head_v_dim)

    def torch_ops() -> torch.Tensor:
        g, beta = gates(layer, a, b)
        core = layer._decode(mixed, g, beta, meta)
        return layer.norm(core.to(DTYPE), z.reshape(heads)).reshape(mixed.shape[0], -1)

    def triton_step(block_v: int | None) -> Callable[[], torch.Tensor]:
        def run() -> torch.Tensor:
            out = gated_delta_decode(mixed, a, b, layer.conv1d.weight, layer.A_log, layer.dt_bias, layer.conv_state,
                                     layer.ssm_state, meta.state_slots, meta.context_lens_gpu, layer.num_k_heads,
                                     layer.num_v_heads, layer.head_k_dim, layer.head_v_dim, z=z,
                                     norm_weight=layer.norm.weight, eps=layer.norm.eps, block_v=block_v)
            if block_v is not None and block_v < layer.head_v_dim:
                out = layer.norm(out.view(heads), z.reshape(heads)).reshape(out.shape)
            return out
        return run

    def fla_step() -> torch.Tensor:
        slots = meta.state_slots.long()
        keep = meta.context_lens_gpu > 1
        conv_prev = torch.where(keep[:, None, None], layer.conv_state.index_select(0, slots), 0)
        conv_out, conv_next = causal_conv1d_step(mixed, layer.conv1d.weight, conv_prev)
        layer.conv_state.index_copy_(0, slots, conv_next)
        q, k, v = F.silu(conv_out).split([layer.key_dim, layer.key_dim, layer.value_dim], dim=-1)
        rows = mixed.shape[0]
        state = torch.where(keep[:, None, None, None], layer.ssm_state.index_select(0, slots), 0)
        g, beta = gates(layer, a, b)
        out, state = fla_recurrent_step(q.reshape(rows, layer.num_k_heads, -1), k.reshape(rows, layer.num_k_heads, -1),
                                        v.reshape(rows, layer.num_v_heads, -1), g, beta, state,
                                        layer.head_k_dim ** -0.5)
        layer.ssm_state.index_copy_(0, slots, state)
        return layer.norm(out.to(DTYPE), z.reshape(heads)).reshape(rows, -1)

    variants = {"pytorch ops": torch_ops, "triton (whole head, norm fused)": triton_step(None),
                "triton (32-wide blocks) + norm": triton_step(32)}
    if fla_available():
        variants["fla fused recurrent"] = fla_step
    return variants


def bench_decode(batch: int) -> None:
    layer = make_layer(batch + 1)
    meta = make_meta([1] * batch, [7] * batch, list(range(1, batch + 1)))
    mixed, z, b, a = projections(layer, batch)
    conv0, ssm0 = layer.conv_state.clone(), layer.ssm_state.clone()
    state_bytes = 2 * batch * layer.num_v_heads * layer.head_k_dim * layer.head_v_dim * 4
    reference = None
    for name, fn in decode_variants(layer, meta, mixed, z, b, a).items():
        if over_time():
            print(f"{'decode':8s} {batch:5d} {name:34s} skipped (time limit)")
            continue
        layer.conv_state.copy_(conv0)
        layer.ssm_state.copy_(ssm0)
        try:
            out = fn()
            if reference is None:
                reference = out
            err = rel(out, reference)
            us = time_in_graph(fn) * 1e3
        except Exception as exc:  # one failing backend must not hide the others' numbers
            print(f"{'decode':8s} {batch:5d} {name:34s} failed: {type(exc).__name__}: {str(exc)[:120]}")
            continue
        print(f"{'decode':8s} {batch:5d} {name:34s} {us:9.1f} {state_bytes / us / 1e3:9,.0f} {err:9.1e}")


# ------------------------------------------------------------------------------------------------ prefill

def bench_prefill(seqs: int, length: int) -> None:
    layer = make_layer(seqs + 1)
    meta = make_meta([length] * seqs, [length] * seqs, list(range(1, seqs + 1)))
    mixed, _, b, a = projections(layer, seqs * length)
    g, beta = gates(layer, a, b)
    variants = {"pytorch chunked": lambda: torch.cat([layer._sequence(mixed, g, beta, meta, i)
                                                      for i in range(seqs)])}
    variants["ours chunked (varlen, with conv)"] = lambda: layer._prefill_flat(mixed, g, beta, meta, "triton")
    if fla_available():
        variants["fla chunked (varlen)"] = lambda: layer._prefill_flat(mixed, g, beta, meta, "fla")
    reference = None
    for name, fn in variants.items():
        label = f"{seqs}x{length}"
        if over_time():
            print(f"{'prefill':8s} {label:>5s} {name:34s} skipped (time limit)")
            continue
        try:
            out = fn()                          # compile / autotune, and the output to check
            if reference is None:
                reference = out
            err = rel(out, reference)
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(3):
                fn()
            end.record()
            end.synchronize()
            us = start.elapsed_time(end) / 3 * 1e3
        except Exception as exc:
            print(f"{'prefill':8s} {label:>5s} {name:34s} failed: {type(exc).__name__}: {str(exc)[:120]}")
            continue
        print(f"{'prefill':8s} {label:>5s} {name:34s} {us:9.1f} {seqs * length / us * 1e6:11,.0f} tok/s {err:9.1e}")


def main() -> None:
    if not torch.cuda.is_available():
        print("needs a CUDA device")
        return
    cfg = PRESETS[PRESET]
    print(f"{PRESET}: key heads {cfg['linear_num_key_heads']}, value heads {cfg['linear_num_value_heads']}, "
          f"head dims {cfg['linear_key_head_dim']}/{cfg['linear_value_head_dim']}, "
          f"conv {cfg['linear_conv_kernel_dim']}, {DTYPE}; fla {'importable' if fla_available() else 'not importable'}")
    print("decode: µs per layer step (CUDA graph), GB/s of state traffic (fp32 read + write), error vs PyTorch")
    print(f"{'path':8s} {'batch':>5s} {'implementation':34s} {'µs':>9s} {'GB/s':>9s} {'rel err':>9s}")
    with torch.no_grad():
        for batch in (1, 8, 64):
            bench_decode(batch)
        print("prefill: µs per layer call (eager), tokens/s, error vs PyTorch")
        for seqs, length in ((1, 2048), (8, 512)):
            bench_prefill(seqs, length)
    print(f"done in {time.perf_counter() - STARTED:.0f} s")


if __name__ == "__main__":
    main()
