"""Builds the model on its device, owns the paged KV cache, and runs one scheduled step."""

from __future__ import annotations

import logging
from collections.abc import Iterable

import torch

from pocketllm.engine.scheduler import ScheduledChunk
from pocketllm.models.registry import model_class
from pocketllm.models.weights import init_dummy_weights, load_weights
from pocketllm.runner.attention_metadata import AttentionMetadata
from pocketllm.runner.sampler import SampledToken, Sampler, SamplingRow

logger = logging.getLogger("pocketllm.runner")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return DTYPES[name]


class ModelRunner:
    """Turns a list of scheduled chunks into one flat forward pass and samples where a chunk ends."""

    def __init__(self, hf_config, device: torch.device, dtype: torch.dtype, block_size: int,
                 seed: int) -> None:
        self.hf_config = hf_config
        self.device = device
        self.dtype = dtype
        self.block_size = block_size
        cls = model_class(hf_config)
        with torch.device(device):
            default_dtype = torch.get_default_dtype()
            torch.set_default_dtype(dtype)
            try:
                self.model = cls(hf_config)
            finally:
                torch.set_default_dtype(default_dtype)
        self.model.eval()
        self.sampler = Sampler(seed)
        self.attention_layers = [m for m in self.model.modules() if type(m).__name__ == "Attention"]
        self.num_blocks = 0

    def load(self, weights: Iterable[tuple[str, torch.Tensor]] | None, dummy_seed: int | None = None) -> None:
        """Load checkpoint weights, or fill random ones when ``weights`` is None."""
        if weights is None:
            init_dummy_weights(self.model, dummy_seed or 0)
        else:
            load_weights(self.model, weights)

    def kv_bytes_per_block(self) -> int:
        element = torch.tensor([], dtype=self.dtype).element_size()
        per_layer = sum(2 * a.num_kv_heads * a.head_dim for a in self.attention_layers)
        return per_layer * self.block_size * element

    def allocate_kv_cache(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        for attn in self.attention_layers:
            shape = (num_blocks, self.block_size, attn.num_kv_heads, attn.head_dim)
            attn.k_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
            attn.v_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)

    def _prepare(self, chunks: list[ScheduledChunk]):
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_start = [0]
        context_lens: list[int] = []
        sample_index: list[int] = []
        for chunk in chunks:
            request = chunk.request
            start = request.num_computed_tokens
            end = start + chunk.num_tokens
            tokens = request.all_token_ids
            input_ids.extend(tokens[start:end])
            positions.extend(range(start, end))
            table = request.block_table
            bs = self.block_size
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            query_start.append(query_start[-1] + chunk.num_tokens)
            context_lens.append(end)
            if chunk.samples:
                sample_index.append(query_start[-1] - 1)
        width = max(len(c.request.block_table) for c in chunks)
        tables = [c.request.block_table + [0] * (width - len(c.request.block_table)) for c in chunks]
        device = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
            block_tables=torch.tensor(tables, dtype=torch.int64, device=device),
            query_start=query_start, context_lens=context_lens, block_size=self.block_size)
        ids = torch.tensor(input_ids, dtype=torch.int64, device=device)
        pos = torch.tensor(positions, dtype=torch.int64, device=device)
        return ids, pos, meta, sample_index

    @torch.inference_mode()
    def execute(self, chunks: list[ScheduledChunk]) -> list[SampledToken]:
        """Run the chunks; return one sampled token per chunk that reached the end of its sequence."""
        ids, positions, meta, sample_index = self._prepare(chunks)
        hidden = self.model(ids, positions, meta)
        if not sample_index:
            return []
        index = torch.tensor(sample_index, dtype=torch.int64, device=self.device)
        logits = self.model.compute_logits(hidden.index_select(0, index)).float()
        rows = [SamplingRow(c.request.params, c.request.prompt_token_ids, c.request.output_token_ids,
                            c.request.generator) for c in chunks if c.samples]
        return self.sampler(logits, rows)

