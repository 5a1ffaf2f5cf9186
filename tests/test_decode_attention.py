"""The CPU decode-attention kernel (``pocketllm.kernels.cpu_native``) against softmax attention in float64."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pocketllm.kernels import cpu_native

pytestmark = pytest.mark.skipif(not cpu_native.available(), reason="the CPU has no AVX-512 VNNI (or no compiler)")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("rows", "heads", "group", "dim"), [(1, 3, 3, 64), (8, 3, 3, 64), (2, 2, 1, 128),
                                                             (3, 1, 8, 32), (5, 4, 2, 64), (3, 2, 2, 16)])
@pytest.mark.parametrize("head_major", [False, True])
def test_kernel_equals_masked_softmax_attention(dtype: torch.dtype, rows: int, heads: int, group: int,
                                                dim: int, head_major: bool) -> None:
    """Each row attends to its own first ``lengths[r]`` positions of a strided view: the dense K/V rows (a
    position's heads side by side), or a view whose heads are apart (``head_major``); contexts long enough that
    a row's positions split into several ranges."""
    torch.manual_seed(rows * 7 + dim)
    longest = 600 if rows == 8 else 300
    if head_major:
        store_k = torch.randn(rows + 2, heads, longest + 5, dim).to(dtype).transpose(1, 2)
        store_v = torch.randn(rows + 2, heads, longest + 5, dim).to(dtype).transpose(1, 2)
    else:
        store_k = torch.randn(rows + 2, longest + 5, heads, dim).to(dtype)
        store_v = torch.randn(rows + 2, longest + 5, heads, dim).to(dtype)
    k, v = store_k[:rows, :longest], store_v[:rows, :longest]
    lengths = torch.randint(1, longest + 1, (rows,))
    lengths[0] = 1
    lengths[-1] = longest
    q = torch.randn(rows, heads + 1, group, dim)[:, 1:]   # a view, as the step's query heads are
    got = cpu_native.decode_attention(q, k, v, lengths, dim ** -0.5)
    expected = cpu_native.reference_attention(q, k, v, lengths, dim ** -0.5)
    assert got.shape == q.shape and got.dtype == torch.float32
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)


def test_kernel_matches_sdpa_over_a_cache_span() -> None:
    """One row over a span of the paged cache ([slots, KVH, D] viewed as one row), against torch's SDPA."""
    torch.manual_seed(3)
    cache_k, cache_v = torch.randn(512, 3, 64).bfloat16(), torch.randn(512, 3, 64).bfloat16()
    k, v = cache_k[100:237].unsqueeze(0), cache_v[100:237].unsqueeze(0)
    q = torch.randn(1, 3, 3, 64)
    got = cpu_native.decode_attention(q, k, v, torch.tensor([137]), 0.125)
    sdpa = F.scaled_dot_product_attention(q, k.float().transpose(1, 2), v.float().transpose(1, 2), scale=0.125)
    torch.testing.assert_close(got, sdpa, rtol=1e-4, atol=1e-5)


def test_kernel_refuses_bad_lengths_and_shapes() -> None:
    q, k = torch.randn(2, 3, 3, 64), torch.randn(2, 10, 3, 64).bfloat16()
    with pytest.raises(RuntimeError, match="length"):
        cpu_native.decode_attention(q, k, k, torch.tensor([3, 11]), 0.125)
    with pytest.raises(RuntimeError, match="shapes do not match"):
        cpu_native.decode_attention(q, k[:, :, :2], k[:, :, :2], torch.tensor([3, 4]), 0.125)
    with pytest.raises(RuntimeError, match="head size"):
        cpu_native.decode_attention(torch.randn(2, 3, 3, 48), k[..., :48], k[..., :48], torch.tensor([3, 4]), 0.1)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("window", [1, 7, 40, 1000])
def test_kernel_attends_from_each_rows_start(dtype: torch.dtype, window: int) -> None:
    """A sliding window: row r attends to positions ``starts[r] .. lengths[r] - 1`` only."""
    torch.manual_seed(window)
    rows, heads, group, dim, longest = 5, 2, 3, 64, 300
    k = torch.randn(rows, longest, heads, dim).to(dtype)
    v = torch.randn(rows, longest, heads, dim).to(dtype)
    lengths = torch.tensor([1, 5, 41, 299, 300])
    starts = (lengths - window).clamp(min=0)
    q = torch.randn(rows, heads, group, dim)
    got = cpu_native.decode_attention(q, k, v, lengths, dim ** -0.5, starts)
    expected = cpu_native.reference_attention(q, k, v, lengths, dim ** -0.5, starts)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)
    with pytest.raises(RuntimeError, match="start"):
        cpu_native.decode_attention(q, k, v, lengths, dim ** -0.5, lengths)
