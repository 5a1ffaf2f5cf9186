"""The attention backends (``layers/attention_backend.py``) and the step backends (``runner/step_backend.py``): what
the model runner binds on CPU, which step backend a step takes, and the reference attention backend's results."""

from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from conftest import tiny_config

from pocketllm.layers.attention import Attention
from pocketllm.layers.attention_backend import TorchAttentionBackend, TritonAttentionBackend
from pocketllm.runner.model_runner import ModelRunner
from pocketllm.runner.step_backend import CpuDecodeBackend, ReferenceStep, StepBackend
from pocketllm.step.attention_metadata import AttentionMetadata
from pocketllm.step.scheduled_chunk import ScheduledChunk

ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM", "qwen3_5_text": "Qwen3_5ForCausalLM"}


def _cpu_runner(arch: str) -> ModelRunner:
    """A float32 CPU runner of a tiny ``arch`` model with random weights."""
    config = tiny_config(arch)
    config.architectures = [ARCHITECTURES[arch]]
    runner = ModelRunner(config, torch.device("cpu"), torch.float32, block_size=4, seed=0)
    runner.load(None)
    return runner


@pytest.mark.parametrize("arch, fast", [("llama", True), ("qwen3_moe", False), ("qwen3_5_text", False)])
def test_cpu_runner_binds_the_reference_attention_and_orders_its_step_backends(arch: str, fast: bool) -> None:
    """On CPU every attention layer runs the PyTorch reference backend; the CPU decode step comes first where the
    model exports a decode plan (not with experts, not for a hybrid), and the reference step last."""
    runner = _cpu_runner(arch)
    assert runner.attention_layers
    assert all(type(layer.backend) is TorchAttentionBackend for layer in runner.attention_layers)
    assert not any(layer.backend.supports_packed for layer in runner.attention_layers)
    expected = [CpuDecodeBackend, ReferenceStep] if fast else [ReferenceStep]
    assert [type(backend) for backend in runner.step_backends] == expected
    assert runner.step_backends[-1] is runner.host_step is runner.reference_step
    assert not runner.uses_kernels
    assert (runner.cpu_decode is not None) == fast
    assert runner.compiled_cpu_decode is None


def _chunk(prompt: list[int], outputs: list[int], num_tokens: int, table: list[int]) -> ScheduledChunk:
    """The last ``num_tokens`` of ``prompt + outputs`` as one sampling chunk."""
    ids = prompt + outputs
    request = SimpleNamespace(prompt_token_ids=prompt, output_token_ids=outputs, all_token_ids=ids,
                              num_computed_tokens=len(ids) - num_tokens, num_tokens=len(ids), block_table=table,
                              state_slot=-1)
    return ScheduledChunk(request, num_tokens, len(ids) - num_tokens, True)


def test_launch_takes_the_first_step_backend_that_handles_the_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    """A prompt chunk runs on the reference step, a decode step on the CPU decode step; both give logits of the
    sampling rows."""
    runner = _cpu_runner("llama")
    runner.allocate_kv_cache(8)
    taken: list[type] = []
    for backend in runner.step_backends:
        monkeypatch.setattr(backend, "launch", lambda chunks, previous, backend=backend, launch=backend.launch:
                            taken.append(type(backend)) or launch(chunks, previous))
    prompt = [1, 400, 401, 402, 403]
    with torch.inference_mode():
        prefill = runner.launch([_chunk(prompt, [], 5, [0, 1])])
        decode = runner.launch([_chunk(prompt, [7], 1, [0, 1])])
    assert taken == [ReferenceStep, CpuDecodeBackend]
    assert prefill.shape == decode.shape == (1, runner.hf_config.vocab_size)


class _Fake(StepBackend):
    def __init__(self, name: str, handles: bool, launched: list[str]) -> None:
        self.name, self.handled, self.launched = name, handles, launched

    def handles(self, chunks) -> bool:
        return self.handled

    def launch(self, chunks, previous_tokens) -> torch.Tensor:
        self.launched.append(self.name)
        return torch.full((1,), float(len(self.launched)))


def test_step_backends_are_asked_in_order() -> None:
    runner = _cpu_runner("qwen3_moe")
    launched: list[str] = []
    runner.step_backends = [_Fake("a", False, launched), _Fake("b", True, launched), _Fake("c", True, launched)]
    runner.launch([])
    assert launched == ["b"]


def _paged(lens: list[int], q_lens: list[int], block_size: int, num_blocks: int, gen: torch.Generator
           ) -> tuple[list[list[int]], list[int], list[int]]:
    """Scattered block tables for contexts ``lens``, the new tokens' slots, and the query starts."""
    order = torch.randperm(num_blocks, generator=gen).tolist()
    tables, slots, starts = [], [], [0]
    for length, count in zip(lens, q_lens):
        table, order = order[: -(-length // block_size)], order[-(-length // block_size):]
        tables.append(table)
        slots += [table[p // block_size] * block_size + p % block_size for p in range(length - count, length)]
        starts.append(starts[-1] + count)
    return tables, slots, starts


@pytest.mark.parametrize("q_lens, lens", [([1, 1, 1], [5, 9, 13]), ([1, 3, 6, 2], [7, 3, 10, 2])])
def test_reference_backend_stores_and_attends(q_lens: list[int], lens: list[int]) -> None:
    """Decode-only and mixed steps (grouped heads, scattered blocks): the new keys/values land in their slots, and
    each query attends causally over its sequence's context, as a float64 softmax over the gathered rows does."""
    gen = torch.Generator().manual_seed(len(q_lens))
    heads, kv_heads, dim, block_size, num_blocks = 4, 2, 16, 4, 24
    layer = Attention(heads, dim, kv_heads, dim ** -0.5)
    assert type(layer.backend) is TorchAttentionBackend
    layer.k_cache = torch.randn(num_blocks, block_size, kv_heads, dim, generator=gen)
    layer.v_cache = torch.randn(num_blocks, block_size, kv_heads, dim, generator=gen)
    tables, slots, starts = _paged(lens, q_lens, block_size, num_blocks, gen)
    width = max(map(len, tables))
    meta = AttentionMetadata(slot_mapping=torch.tensor(slots),
                             block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables]),
                             query_start=starts, context_lens=lens, block_size=block_size)
    tokens = starts[-1]
    q, k, v = (torch.randn(tokens, n, dim, generator=gen) for n in (heads, kv_heads, kv_heads))
    out = layer(q, k, v, meta)
    assert out.shape == (tokens, heads * dim)
    k_flat, v_flat = layer.k_cache.view(-1, kv_heads, dim), layer.v_cache.view(-1, kv_heads, dim)
    assert torch.equal(k_flat[slots], k) and torch.equal(v_flat[slots], v)
    expected = torch.empty(tokens, heads, dim, dtype=torch.float64)
    for i, (table, length) in enumerate(zip(tables, lens)):
        rows = [table[p // block_size] * block_size + p % block_size for p in range(length)]
        keys, values = k_flat[rows].double(), v_flat[rows].double()
        for t in range(starts[i], starts[i + 1]):
            visible = length - (starts[i + 1] - t) + 1
            for h in range(heads):
                g = h // (heads // kv_heads)
                weights = torch.softmax(keys[:visible, g] @ q[t, h].double() * dim ** -0.5, dim=0)
                expected[t, h] = weights @ values[:visible, g]
    torch.testing.assert_close(out.double(), expected.reshape(tokens, -1), rtol=1e-5, atol=1e-5)


def test_reference_backend_takes_no_packed_projection() -> None:
    layer = Attention(4, 16, 2, 0.25)
    with pytest.raises(NotImplementedError, match="torch"):
        layer.forward_packed(torch.zeros(1, 128), torch.zeros(1, dtype=torch.int64), None, None, None, None)
    assert TritonAttentionBackend.supports_packed


def test_the_backends_import_no_kernel_module() -> None:
    """The runner and its backends import without the Triton kernel modules (they load only when a kernel
    runs)."""
    code = ("import sys, pocketllm.runner.model_runner, pocketllm.layers.attention_backend; "
            "bad = [m for m in ('triton', 'pocketllm.kernels.attention', 'pocketllm.kernels.fused') "
            "if m in sys.modules]; assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)
