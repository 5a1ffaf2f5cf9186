"""A step of short chunks run as decode rows (``HostBatch.flattened``: each token a row of its own over its
sequence's context up to its position), the shape CUDA decode graphs replay speculative verify steps in."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from pocketllm.api import LLM
from pocketllm.config import EngineArgs
from pocketllm.step.host_batch import gather_host_batch
from pocketllm.step.scheduled_chunk import ScheduledChunk


def _request(ids: list[int], table: list[int], state_slot: int = -1) -> SimpleNamespace:
    return SimpleNamespace(prompt_token_ids=ids[:2], output_token_ids=ids[2:], num_tokens=len(ids),
                           block_table=table, state_slot=state_slot)


def _verify(ids: list[int], draft: list[int], table: list[int]) -> ScheduledChunk:
    """A verify chunk: the last of ``ids`` (the rest cached), then ``draft``."""
    return ScheduledChunk(_request(ids, table), 1 + len(draft), len(ids) - 1, True, tuple(draft))


def _decode(ids: list[int], table: list[int]) -> ScheduledChunk:
    return ScheduledChunk(_request(ids, table), 1, len(ids) - 1, True)


def test_flattened_rows_and_contexts() -> None:
    chunks = [_verify(list(range(10, 17)), [5, 6, 7], [3, 4, 5]), _decode(list(range(20, 25)), [8, 9])]
    host = gather_host_batch(chunks, block_size=4)
    flat = host.flattened()
    assert flat.input_ids == host.input_ids == [16, 5, 6, 7, 24]
    assert flat.positions == host.positions and flat.slots == host.slots
    assert flat.query_start == [0, 1, 2, 3, 4, 5]
    assert flat.context_lens == [7, 8, 9, 10, 5]
    assert flat.tables == [[3, 4, 5]] * 4 + [[8, 9]]
    assert flat.sample_index == host.sample_index == [0, 1, 2, 3, 4]
    assert flat.is_plain_decode and not host.is_plain_decode and host.max_query_len == 4


def test_recurrent_state_rows_form_chains() -> None:
    """Hybrid models: a verify chunk's rows form one chain from the sequence's state slot, writing its checkpoint
    slots and then the sequence's slot; a decode row is a chain of its own."""
    verify = _request(list(range(10, 17)), [3, 4, 5], state_slot=2)
    verify.state_checkpoints = 9
    chunks = [ScheduledChunk(verify, 3, 6, True, (5, 6)), ScheduledChunk(_request(list(range(20, 25)), [8, 9], 4), 1, 4,
                                                                         True)]
    flat = gather_host_batch(chunks, block_size=4).flattened()
    assert flat.state_slots == [9, 10, 2, 4]
    assert flat.state_chain == [2, -1, -1, 4]
    assert flat.state_checkpoints == [-1] * 4 and flat.is_plain_decode


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2_swa"])   # mistral, qwen2_swa: windows of 16
def test_flattened_step_equals_the_step(arch: str, tiny_checkpoint) -> None:
    """Verify chunks beside a decode row and a short prompt chunk, over contexts longer than the windows: the
    reference forward of the flattened batch gives every row's hidden state of the batch as scheduled."""
    with LLM(EngineArgs(model=tiny_checkpoint(arch), device="cpu", num_kv_blocks=64, block_size=4)) as llm:
        runner = llm._client.backend.core.runner
        torch.manual_seed(5)
        for layer in runner.attention_layers:
            layer.k_cache.normal_()
            layer.v_cache.normal_()
        chunks = [
            _verify(list(range(10, 31)), [40, 41, 42], [4, 5, 6, 7, 8, 9]),
            _decode(list(range(50, 57)), [13, 14]),
            _verify(list(range(60, 78)), [3], [20, 21, 15, 16, 17]),
            ScheduledChunk(_request(list(range(80, 85)), [30, 31]), 5, 0, True, (81, 82, 83, 84)),
        ]
        host = gather_host_batch(chunks, runner.block_size)
        with torch.inference_mode():
            expected = runner.forward_reference(host)
            flat = runner.forward_reference(host.flattened())
        assert flat.shape == expected.shape == (host.num_tokens, expected.shape[1])
        torch.testing.assert_close(flat, expected, rtol=1e-4, atol=1e-4)
