"""Gated DeltaNet fast paths against the PyTorch reference in ``pocketllm.layers.gated_delta`` (marked ``gpu``).

Run on a CUDA machine with ``pytest -m gpu tests/test_gated_delta_gpu.py``. The Triton decode-step tests also
run without a GPU under Triton's interpreter (``TRITON_INTERPRET=1``, CPU tensors); the CUDA-graph test and
the fla prefill tests need CUDA (the latter also the optional ``fla`` package, skipped without it).
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from pocketllm.layers.gated_delta import GatedDeltaNet
from pocketllm.step.attention_metadata import AttentionMetadata

pytestmark = pytest.mark.gpu

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cpu" if INTERPRET else "cuda"
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}
if INTERPRET:  # the interpreter truncates float32 -> bfloat16 instead of rounding to nearest
    TOL[torch.bfloat16] = 3e-2


def _need_kernels() -> None:
    pytest.importorskip("triton")
    if not INTERPRET and not torch.cuda.is_available():
        pytest.skip("needs a CUDA device (or TRITON_INTERPRET=1)")


def _need_fla() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    from pocketllm.kernels.gated_delta_fla import fla_available

    if not fla_available():
        pytest.skip("the CUDA-only fla (fla-core) kernels are not importable")


def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30))


def _layer(key_heads: int, value_heads: int, dk: int, dv: int, dtype: torch.dtype, slots: int,
           device: str = DEVICE, ksize: int = 4) -> GatedDeltaNet:
    """A layer with random conv/gate/norm parameters in ``dtype`` and random (non-zero) state pools."""
    config = SimpleNamespace(linear_num_key_heads=key_heads, linear_num_value_heads=value_heads,
                             linear_key_head_dim=dk, linear_value_head_dim=dv, linear_conv_kernel_dim=ksize,
                             hidden_size=32, rms_norm_eps=1e-6)
    layer = GatedDeltaNet(config)
    gen = torch.Generator().manual_seed(key_heads * 131 + value_heads * 7 + dk + dv)
    with torch.no_grad():
        layer.conv1d.weight.copy_(torch.randn(layer.conv1d.weight.shape, generator=gen) * 0.5)
        layer.A_log.copy_(torch.randn(value_heads, generator=gen) * 0.5)
        layer.dt_bias.copy_(torch.randn(value_heads, generator=gen))
        layer.norm.weight.copy_(torch.rand(dv, generator=gen) + 0.5)
    layer = layer.to(device=device, dtype=dtype)
    layer.conv_state = torch.randn(slots, ksize - 1, layer.conv_dim, generator=gen).to(device=device, dtype=dtype)
    layer.ssm_state = torch.randn(slots, value_heads, dk, dv, generator=gen).to(device) * 0.3
    return layer


def _inputs(layer: GatedDeltaNet, tokens: int, dtype: torch.dtype, device: str = DEVICE):
    """(mixed, z, b, a): views into one projection row, strided as in ``GatedDeltaNet.forward``."""
    width = layer.conv_dim + layer.value_dim + 2 * layer.num_v_heads
    proj = torch.randn(tokens, width, generator=torch.Generator().manual_seed(tokens)).to(device=device, dtype=dtype)
    return proj.split([layer.conv_dim, layer.value_dim, layer.num_v_heads, layer.num_v_heads], dim=-1)


def _meta(q_lens: list[int], ctx: list[int], slots: list[int], device: str = DEVICE) -> AttentionMetadata:
    starts = [0]
    for n in q_lens:
        starts.append(starts[-1] + n)
    as_int = lambda xs: torch.tensor(xs, dtype=torch.int32, device=device)
    return AttentionMetadata(
        slot_mapping=as_int([0] * starts[-1]), block_tables=as_int([[0]] * len(q_lens)), query_start=starts,
        context_lens=ctx, block_size=16, context_lens_gpu=as_int(ctx), query_start_gpu=as_int(starts),
        max_query_len=max(q_lens), state_slots=as_int(slots), state_slots_host=slots)


def _reference_decode(layer: GatedDeltaNet, mixed, z, b, a, meta) -> torch.Tensor:
    """``GatedDeltaNet.forward``'s decode core on the PyTorch path, then the gated RMSNorm: [B, Hv * Dv]."""
    beta = b.float().sigmoid()
    g = -layer.A_log.float().exp() * F.softplus(a.float() + layer.dt_bias.float())
    core = layer._decode(mixed, g, beta, meta)
    out = layer.norm(core.to(mixed.dtype), z.reshape(-1, layer.num_v_heads, layer.head_v_dim))
    return out.reshape(mixed.shape[0], layer.value_dim)


def _decode_kernel(layer: GatedDeltaNet, mixed, z, b, a, meta, block_v: int | None = None) -> torch.Tensor:
    from pocketllm.kernels.gated_delta import gated_delta_decode

    out = gated_delta_decode(mixed, a, b, layer.conv1d.weight, layer.A_log, layer.dt_bias, layer.conv_state,
                             layer.ssm_state, meta.state_slots, meta.context_lens_gpu, layer.num_k_heads,
                             layer.num_v_heads, layer.head_k_dim, layer.head_v_dim, z=z, norm_weight=layer.norm.weight,
                             eps=layer.norm.eps, block_v=block_v)
    if block_v is not None and block_v < layer.head_v_dim:   # the rule's output only: normalise here
        out = layer.norm(out.view(-1, layer.num_v_heads, layer.head_v_dim),
                         z.reshape(-1, layer.num_v_heads, layer.head_v_dim)).reshape(out.shape)
    return out


# (key heads, value heads, Dk, Dv): GQA groups 2 and 3, one group, odd head dims, a real 128 x 128 head
SHAPES = [(2, 4, 16, 16), (2, 6, 24, 40), (3, 3, 32, 16), (1, 2, 128, 128)]
# row: (context length, slot): continuing rows, a fresh one-token prompt (1), a graph padding row (0)
ROWS = [(5, 6), (1, 2), (9, 0), (0, 7), (33, 3)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("block_v", [None, 8])
def test_decode_kernel_matches_reference(dtype, shape, block_v):
    _need_kernels()
    if INTERPRET and shape[2] == 128 and block_v is not None:
        pytest.skip("slow in the interpreter")
    layer = _layer(*shape, dtype=dtype, slots=8)
    ctx, slots = [c for c, _ in ROWS], [s for _, s in ROWS]
    meta = _meta([1] * len(ROWS), ctx, slots)
    mixed, z, b, a = _inputs(layer, len(ROWS), dtype)
    conv0, ssm0 = layer.conv_state.clone(), layer.ssm_state.clone()

    ref = _reference_decode(layer, mixed, z, b, a, meta)
    conv_ref, ssm_ref = layer.conv_state.clone(), layer.ssm_state.clone()
    layer.conv_state, layer.ssm_state = conv0.clone(), ssm0.clone()
    out = _decode_kernel(layer, mixed, z, b, a, meta, block_v)

    assert out.shape == ref.shape and out.dtype == ref.dtype
    assert _rel(out, ref) < TOL[dtype]
    used = torch.tensor(slots, device=DEVICE)
    assert _rel(layer.ssm_state[used], ssm_ref[used]) < TOL[dtype]
    assert _rel(layer.conv_state[used], conv_ref[used]) == 0.0      # a shift: exact
    untouched = torch.tensor(sorted(set(range(8)) - set(slots)), device=DEVICE)
    assert torch.equal(layer.ssm_state[untouched], ssm0[untouched])
    assert torch.equal(layer.conv_state[untouched], conv0[untouched])


def test_decode_kernel_steps_like_the_recurrence():
    """Several decode steps in a row from a fresh prompt equal the reference run step by step."""
    _need_kernels()
    dtype = torch.float32
    layer = _layer(2, 4, 16, 32, dtype=dtype, slots=3)
    ref_layer = _layer(2, 4, 16, 32, dtype=dtype, slots=3)
    for step in range(1, 7):
        meta = _meta([1, 1], [step, step + 3], [2, 0])
        mixed, z, b, a = _inputs(layer, 2, dtype)
        mixed = mixed * (1 + step / 7)          # different inputs each step
        ref = _reference_decode(ref_layer, mixed, z, b, a, meta)
        out = _decode_kernel(layer, mixed, z, b, a, meta)
        assert _rel(out, ref) < TOL[dtype]
    assert _rel(layer.ssm_state, ref_layer.ssm_state) < TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_kernel_runs_chains_of_positions(dtype):
    """Rows that are consecutive positions of one sequence (a verify chunk run as decode rows) give what decode
    steps of one row each give, and leave the state after each position in that row's slot."""
    _need_kernels()
    layer = _layer(2, 4, 16, 32, dtype=dtype, slots=10)
    ref_layer = _layer(2, 4, 16, 32, dtype=dtype, slots=10)
    # a decode row (slot 1); a verify chunk of four positions (slot 2, checkpoints 5-7); a graph padding row
    # (context 0, slot 9); a fresh two-token chain without checkpoints (slot 3)
    ctx = [7, 10, 11, 12, 13, 0, 1, 2]
    writes = [1, 5, 6, 7, 2, 9, 3, 3]
    chain = [1, 2, -1, -1, -1, 9, 3, -1]
    reads = [1, 2, 2, 2, 2, 9, 3, 3]        # the reference runs each row in its sequence's slot
    mixed, z, b, a = _inputs(layer, len(ctx), dtype)
    meta = _meta([1] * len(ctx), ctx, writes)
    from pocketllm.kernels.gated_delta import gated_delta_decode

    out = gated_delta_decode(mixed, a, b, layer.conv1d.weight, layer.A_log, layer.dt_bias, layer.conv_state,
                             layer.ssm_state, meta.state_slots, meta.context_lens_gpu, layer.num_k_heads,
                             layer.num_v_heads, layer.head_k_dim, layer.head_v_dim, z=z, norm_weight=layer.norm.weight,
                             eps=layer.norm.eps, chain=torch.tensor(chain, dtype=torch.int32, device=DEVICE))
    # (compiled apart, the chained kernel may round differently from the one-row kernel in the last place)
    for row in range(len(ctx)):
        one = _meta([1], [ctx[row]], [reads[row]])
        expected = _decode_kernel(ref_layer, mixed[row:row + 1], z[row:row + 1], b[row:row + 1], a[row:row + 1], one)
        assert _rel(out[row:row + 1], expected) < TOL[dtype] / 10, row
        if writes[row] != reads[row]:
            ref_layer.conv_state[writes[row]] = ref_layer.conv_state[reads[row]]
            ref_layer.ssm_state[writes[row]] = ref_layer.ssm_state[reads[row]]
    assert torch.equal(layer.conv_state, ref_layer.conv_state)      # a shift: exact
    assert _rel(layer.ssm_state, ref_layer.ssm_state) < TOL[dtype] / 10


def test_decode_kernel_replays_in_a_cuda_graph():
    """Captured once, replayed with new slots, lengths and inputs written into the static buffers."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    pytest.importorskip("triton")
    dtype = torch.bfloat16
    layer = _layer(2, 4, 128, 128, dtype=dtype, slots=6, device="cuda")
    ref_layer = _layer(2, 4, 128, 128, dtype=dtype, slots=6, device="cuda")
    meta = _meta([1] * 3, [4, 4, 4], [0, 1, 2], device="cuda")
    mixed, z, b, a = _inputs(layer, 3, dtype, device="cuda")
    _decode_kernel(layer, mixed, z, b, a, meta)                  # compile outside the capture
    layer.conv_state.copy_(ref_layer.conv_state)
    layer.ssm_state.copy_(ref_layer.ssm_state)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = _decode_kernel(layer, mixed, z, b, a, meta)
    for ctx, slots in (([1, 7, 3], [5, 3, 4]), ([2, 8, 4], [5, 3, 4])):
        meta.context_lens_gpu.copy_(torch.tensor(ctx, dtype=torch.int32))
        meta.state_slots.copy_(torch.tensor(slots, dtype=torch.int32))
        new = _inputs(layer, 3, dtype, device="cuda")[0] * ctx[0]
        mixed.copy_(new)
        graph.replay()
        ref = _reference_decode(ref_layer, mixed, z, b, a, _meta([1] * 3, ctx, slots, device="cuda"))
        assert _rel(out, ref) < TOL[dtype]
    assert _rel(layer.ssm_state, ref_layer.ssm_state) < TOL[dtype] / 10


# --------------------------------------------------------------------------------- prefill in one launch

@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rule, shape", [("triton", (2, 4, 16, 16)), ("triton", (2, 4, 128, 128)),
                                         ("triton", (2, 6, 32, 40)), ("fla", (2, 4, 16, 16)),
                                         ("fla", (2, 4, 128, 128))])
def test_flat_prefill_matches_the_chunked_reference(rule, shape, dtype):
    """A mixed batch (a fresh prompt, a decode row, a chunk after a cached prefix, one over several chunks)
    through one launch of the chunked rule (ours or fla's) against the per-sequence PyTorch path; states
    compared too, and the slots no sequence uses left alone."""
    if rule == "fla":
        _need_fla()
    else:
        _need_kernels()
        if INTERPRET and shape[2] == 128 and dtype == torch.bfloat16:
            pytest.skip("slow in the interpreter")
    device = "cuda" if rule == "fla" else DEVICE
    q_lens, ctx, slots = [37, 1, 21, 150], [37, 9, 61, 150], [3, 0, 5, 1]
    layer = _layer(*shape, dtype=dtype, slots=6, device=device)
    conv0, ssm0 = layer.conv_state.clone(), layer.ssm_state.clone()
    meta = _meta(q_lens, ctx, slots, device=device)
    mixed, _, b, a = _inputs(layer, sum(q_lens), dtype, device=device)
    beta = b.float().sigmoid()
    g = -layer.A_log.float().exp() * F.softplus(a.float() + layer.dt_bias.float())
    ref = torch.cat([layer._sequence(mixed, g, beta, meta, i) for i in range(len(q_lens))])
    conv_ref, ssm_ref = layer.conv_state.clone(), layer.ssm_state.clone()
    layer.conv_state, layer.ssm_state = conv0.clone(), ssm0.clone()
    out = layer._prefill_flat(mixed, g, beta, meta, rule)
    # fla runs its matmuls in 16-bit / TF32; ours in TF32 for a bf16 model, IEEE float32 for a float32 one
    tol = 2e-2 if dtype == torch.bfloat16 else (5e-3 if rule == "fla" else 1e-5)
    assert out.shape == ref.shape
    assert _rel(out, ref) < tol
    used = torch.tensor(slots, device=device)
    assert _rel(layer.ssm_state[used], ssm_ref[used]) < tol
    unused = torch.tensor([2, 4], device=device)
    assert torch.equal(layer.ssm_state[unused], ssm0[unused])
    assert torch.equal(layer.conv_state, conv_ref)


def test_backend_rule():
    """CPU tensors never leave the reference; on CUDA the decode kernel needs the kernel metadata."""
    from pocketllm.layers.gated_delta_backend import gated_delta_backend

    meta = _meta([1, 1], [3, 4], [0, 1], device="cpu")
    hidden = torch.zeros(2, 8)
    assert tuple(gated_delta_backend(hidden, meta)) == ("torch", "torch")
    if torch.cuda.is_available():
        pytest.importorskip("triton")
        from pocketllm.kernels.gated_delta_fla import fla_available

        cuda_meta = _meta([1, 1], [3, 4], [0, 1], device="cuda")
        choice = gated_delta_backend(hidden.cuda().bfloat16(), cuda_meta)
        assert choice.decode == "triton"
        assert choice.prefill == ("fla" if fla_available() else "triton")
        prefill = gated_delta_backend(hidden.cuda(), _meta([2], [2], [0], device="cuda"))
        assert prefill.decode == "torch" and prefill.prefill == "torch"   # float32 stays on the reference
