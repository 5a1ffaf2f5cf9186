"""The 4-bit x 8-bit CPU kernel (``pocketllm/layers/q4_linear.py``) against torch ops on the same numbers."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pocketllm.kernels import cpu_native
from pocketllm.layers import q4_linear

needs_kernel = pytest.mark.skipif(not cpu_native.available(), reason="the CPU has no AVX-512 VNNI (or no compiler)")


def _q4_1_grid(rows: int, cols: int, seed: int) -> torch.Tensor:
    """Weights as a Q4_1 quantiser leaves them: fp16 ``d`` and ``m`` per 32, codes spanning 0..15."""
    gen = torch.Generator().manual_seed(seed)
    d = torch.rand(rows, cols // 32, 1, generator=gen).mul(0.02).add(1e-3).half().float()
    m = torch.randn(rows, cols // 32, 1, generator=gen).mul(0.1).half().float()
    codes = torch.randint(0, 16, (rows, cols // 32, 32), generator=gen).float()
    codes[..., 3], codes[..., 17] = 0, 15
    return (codes * d + m).reshape(rows, cols)


def test_a_q4_1_grid_is_recovered_exactly_and_packs_both_ways() -> None:
    weight = _q4_1_grid(48, 96, 0)
    codes, scale, minimum = q4_linear.quantize_q4(weight)
    assert codes.dtype == torch.uint8 and int(codes.max()) <= 15
    assert torch.equal(q4_linear.dequantize_q4(codes, scale, minimum), weight)
    records = q4_linear.pack_q4(codes, scale, minimum)
    assert records.shape == (3, 3, q4_linear.RECORD) and records.dtype == torch.uint8
    assert torch.equal(q4_linear.unpack_q4(records), weight)


def test_the_default_gguf_layers_are_recovered_exactly(smollm2_gguf: str) -> None:
    """Every Q4_1 tensor of the default model round-trips through the records bit for bit (its d and m are
    fp16 in the file, its codes span 0..15 per block)."""
    from gguf import GGMLQuantizationType, GGUFReader
    from gguf.quants import dequantize

    reader = GGUFReader(smollm2_gguf)
    tensors = [t for t in reader.tensors if t.tensor_type == GGMLQuantizationType.Q4_1]
    assert tensors
    for tensor in tensors[:12]:
        weight = torch.from_numpy(np.ascontiguousarray(dequantize(tensor.data, tensor.tensor_type))).float()
        weight = weight.reshape(-1, weight.shape[-1])
        codes, scale, minimum = q4_linear.quantize_q4(weight)
        assert torch.equal(q4_linear.dequantize_q4(codes, scale, minimum), weight), tensor.name


def test_activations_are_quantised_per_row_and_block() -> None:
    x = torch.zeros(2, 64)
    x[0, :32] = torch.linspace(-2, 1, 32)
    x[1, 40] = 0.5
    q, d = q4_linear.quantize_activations(x)
    assert torch.allclose(d.reshape(2, 2), torch.tensor([[2 / 127, 0.0], [0.0, 0.5 / 127]]))
    assert q[0, 0, 0] == -127 and q[1, 1, 8] == 127 and int(q[0, 1].abs().sum()) == 0
    assert ((q * d).reshape(2, 64) - x).abs().max() <= 1 / 127


@needs_kernel
@pytest.mark.parametrize(("out_features", "in_features"), [(16, 32), (48, 96), (960, 576), (576, 1536)])
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8, 9, 17])
def test_kernel_equals_its_reference(out_features: int, in_features: int, rows: int) -> None:
    """The kernel computes the quantised activations times the held weights (float rounding only), for any
    number of rows (more than eight go in passes of eight)."""
    torch.manual_seed(out_features + rows)
    weight = torch.randn(out_features, in_features) * 0.05
    x = torch.randn(rows, in_features)
    x[0, :32] = 0   # a block of zeros has scale 0
    codes, scale, minimum = q4_linear.quantize_q4(weight)
    got = q4_linear.Q4Weights(weight)(x)
    expected = q4_linear.reference(x, codes, scale, minimum)
    assert got.shape == (rows, out_features) and got.dtype == torch.float32
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    exact = x @ q4_linear.dequantize_q4(codes, scale, minimum).T   # 8-bit activations: within ~1% of float
    assert (got - exact).abs().max() <= 0.02 * exact.abs().max()


@needs_kernel
def test_kernel_takes_zero_rows_and_strided_input_and_refuses_wrong_shapes() -> None:
    layer = q4_linear.Q4Weights(torch.randn(32, 64))
    assert layer(torch.empty(0, 64)).shape == (0, 32)
    x = torch.randn(64, 3)
    torch.testing.assert_close(layer(x.T), layer(x.T.contiguous()))
    with pytest.raises(RuntimeError, match="shapes do not match"):
        torch.ops.pocketllm_cpu.q4_linear(torch.randn(2, 96), layer.records)
    with pytest.raises(RuntimeError, match="float32"):
        torch.ops.pocketllm_cpu.q4_linear(torch.randn(2, 64).bfloat16(), layer.records)


@needs_kernel
def test_kernel_runs_inside_a_compiled_function() -> None:
    """The op has a fake implementation, so a compiled step traces through it (``--cpu-compile``)."""
    layer = q4_linear.Q4Weights(torch.randn(48, 64))
    x = torch.randn(3, 64)
    compiled = torch.compile(lambda t: layer(t) * 2, dynamic=True)
    torch.testing.assert_close(compiled(x), layer(x) * 2)


def test_a_failed_build_leaves_torch_kernels(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """No compiler (or any build error): a warning, and int4 layers on torch's int4 kernel."""
    from pocketllm.layers.quantized_linear import CpuLinear

    def fail() -> None:
        raise RuntimeError("no C++ compiler")

    monkeypatch.setattr(cpu_native, "_state", {})
    monkeypatch.setattr(cpu_native, "_cpu_has_flags", lambda: True)
    monkeypatch.setattr(cpu_native, "_build", fail)
    assert not cpu_native.available()
    assert "no C++ compiler" in caplog.text
    layer = CpuLinear(torch.randn(32, 64), None, "int4")
    assert layer.records is None and layer.packed is not None
    assert layer(torch.randn(2, 64)).dtype == torch.bfloat16
