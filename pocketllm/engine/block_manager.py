"""Paged KV-cache blocks: allocation, reference counts and the prefix cache (LRU over free blocks)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass

from pocketllm.engine.request import Request

BlockKey = tuple[int, tuple[int, ...]]


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    key: BlockKey | None = None      # (parent block's hash, this block's tokens) once full and cached
    hash: int | None = None


class BlockManager:
    """Hands out fixed-size KV blocks to requests.

    A full block's identity is the chain ``hash((parent_hash, tokens))``; the cache maps that key to the
    block, and the dictionary's equality check on the key verifies the tokens on every hit. Freed blocks
    keep their contents and stay findable until reused, oldest first.

    ``window`` (None: keep every block): the longest sliding window of the layers that use the cache, set only
    when every such layer slides. A block whose every position is older than the window of the first query
    any later step may run is released while its request runs (``release_outside_window``): no layer reads it
    again. Its block-table entry then reads 0 (a block the attention masks, as the tables' padding is).
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool,
                 window: int | None = None) -> None:
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.window = window
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cached: dict[BlockKey, int] = {}
        self.prefix_queries = 0
        self.prefix_hits = 0

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / max(1, self.num_blocks)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def chain_keys(self, token_ids: list[int], num_blocks: int, start: int = 0,
                   parent: int = 0) -> Iterator[tuple[BlockKey, int]]:
        """(key, hash) of blocks ``start..num_blocks-1`` of ``token_ids``, chained from ``parent``."""
        for i in range(start, num_blocks):
            tokens = tuple(token_ids[i * self.block_size:(i + 1) * self.block_size])
            key = (parent, tokens)
            parent = hash(key)
            yield key, parent

    def cached_blocks(self, token_ids: list[int], num_blocks: int) -> list[int]:
        """Blocks the cache holds for the longest prefix of ``token_ids``' first ``num_blocks`` blocks."""
        found: list[int] = []
        for key, _ in self.chain_keys(token_ids, num_blocks):
            block_id = self.cached.get(key)
            if block_id is None:
                break
            found.append(block_id)
        return found

    def usable_blocks(self, request: Request) -> int:
        """How many of the request's full blocks a cache hit may cover (one token is always left to compute)."""
        return (request.num_tokens - 1) // self.block_size

    def cached_prefix(self, request: Request) -> list[int]:
        """Blocks holding the longest cached prefix of the request (always leaving one token to compute)."""
        if not self.enable_prefix_caching:
            return []
        return self.cached_blocks(request.all_token_ids, self.usable_blocks(request))

    def record_lookup(self, request: Request, found: list[int]) -> None:
        """Count one prefix-cache lookup of the request that found ``found`` (the hit-rate metrics)."""
        if self.enable_prefix_caching:
            self.prefix_queries += request.num_tokens
            self.prefix_hits += len(found) * self.block_size

    def find_cached_prefix(self, request: Request) -> list[int]:
        """``cached_prefix``, counted as a lookup."""
        found = self.cached_prefix(request)
        self.record_lookup(request, found)
        return found

    def can_allocate(self, request: Request, num_new_tokens: int, cached: list[int] = ()) -> bool:
        held = len(request.block_table) or len(cached)
        need = self.blocks_needed(request.num_computed_tokens + num_new_tokens) - held
        reusable_free = sum(1 for b in cached if self.blocks[b].ref_count == 0)
        return need <= self.num_free_blocks - reusable_free

    def allocate(self, request: Request, num_new_tokens: int, cached: list[int] = ()) -> None:
        """Grow the request's block table to hold ``num_new_tokens`` more tokens (after taking ``cached``)."""
        for block_id in cached:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self.free[block_id]
            block.ref_count += 1
            request.block_table.append(block_id)
        need = self.blocks_needed(request.num_computed_tokens + num_new_tokens) - len(request.block_table)
        for _ in range(need):
            block_id, _ = self.free.popitem(last=False)
            block = self.blocks[block_id]
            if block.key is not None:
                if self.cached.get(block.key) == block_id:
                    del self.cached[block.key]
                block.key = block.hash = None
            block.ref_count = 1
            request.block_table.append(block_id)

    def cache_full_blocks(self, request: Request) -> None:
        """Register the request's blocks whose every token's KV is now computed."""
        if not self.enable_prefix_caching:
            return
        # Computed tokens may run one past the known ones (a launched step's pending input): hash known ones.
        computed = min(request.num_computed_tokens, request.num_tokens)
        full = min(computed // self.block_size, len(request.block_table))
        if full <= request.num_hashed_blocks:
            return
        tokens = request.all_token_ids
        start, parent = request.num_hashed_blocks, request.last_block_hash
        for i, (key, digest) in enumerate(self.chain_keys(tokens, full, start, parent), start):
            if i < request.num_released_blocks:   # released: its entry no longer names the block that held it
                parent = digest
                continue
            block = self.blocks[request.block_table[i]]
            if block.key is None:
                block.key, block.hash = key, digest
                self.cached.setdefault(key, block.block_id)
            parent = digest
        request.num_hashed_blocks, request.last_block_hash = full, parent

    def release_outside_window(self, request: Request, first_query: int) -> int:
        """Release the request's leading blocks that hold no position within the window of a query at
        ``first_query`` or later (the first position a step not yet completed may compute); returns how many
        were released. Blocks that are full and registered stay findable in the prefix cache until reused."""
        if self.window is None:
            return 0
        # A query at position p attends p - window + 1 .. p: block i is done with once (i + 1) * block_size
        # <= first_query - window + 1. Only full, already hashed blocks are released (when caching), so that a
        # released block's key always describes its tokens.
        done = max(0, first_query - self.window + 1) // self.block_size
        if self.enable_prefix_caching:
            done = min(done, request.num_hashed_blocks)
        done = min(done, len(request.block_table))
        released = 0
        for i in range(request.num_released_blocks, done):
            self._drop(request.block_table[i])
            request.block_table[i] = 0
            released += 1
        request.num_released_blocks = max(request.num_released_blocks, done)
        return released

    def _drop(self, block_id: int) -> None:
        block = self.blocks[block_id]
        block.ref_count -= 1
        if block.ref_count == 0:
            self.free[block_id] = None

    def truncate(self, request: Request, num_tokens: int) -> None:
        """Give back the request's blocks past its first ``num_tokens`` tokens (speculative slots of rejected
        tokens). Such blocks were never hashed (they hold no computed token) and go first in line for reuse,
        ahead of freed blocks the prefix cache still finds."""
        keep = self.blocks_needed(num_tokens)
        for block_id in reversed(request.block_table[keep:]):
            self._drop(block_id)
            if block_id in self.free and self.blocks[block_id].key is None:
                self.free.move_to_end(block_id, last=False)
        del request.block_table[keep:]

    def free_request(self, request: Request) -> None:
        """Drop the request's references; blocks reaching zero go to the free list (most recent last)."""
        for block_id in reversed(request.block_table[request.num_released_blocks:]):
            self._drop(block_id)
        request.block_table = []
        request.num_released_blocks = 0
        request.num_hashed_blocks, request.last_block_hash = 0, 0

    def reset_prefix_cache(self) -> None:
        for block in self.blocks:
            block.key = block.hash = None
        self.cached.clear()
