"""Export the KV blocks that hold a token prefix, and import them back so that the prefix cache serves them.

A snapshot is the KV of whole blocks only (a prefix of ``block_size`` multiples), taken from blocks the
prefix cache knows. Importing writes the tensors into free blocks and registers them under the same chain
keys the block manager uses, as freed-but-findable blocks: the next request sharing the prefix takes them
like any other prefix-cache hit. Both functions run on the engine thread (the loop's ``ExportPrefix`` and
``ImportPrefix`` commands).

A snapshot may also hold only the blocks from ``first_token`` on (an increment: the KV store appends one per
conversation turn instead of rewriting the whole prefix); increments are joined from token 0 before import.

On disk a snapshot is one safetensors file (``k.<layer>``/``v.<layer>`` tensors and ``token_ids``) whose
header metadata holds the JSON identity of the model that made it and its first token; no pickle anywhere.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

import torch

from pocketllm.errors import InvalidRequestError, UnsupportedFeatureError
from pocketllm.kernels.fp8 import copy_rows_

FORMAT = "pocketllm-kv/1"
_META_KEY = "pocketllm_kv"
_FIRST_KEY = "pocketllm_kv_first_token"


@dataclass
class KVSnapshot:
    """The KV of ``token_ids`` (a whole number of blocks), one key and one value tensor per attention layer.

    Each tensor is ``[num_blocks, *block_shape]`` on the CPU in the engine's KV dtype. ``identity`` names the
    model, dtype, block size and cache layout it was made with. ``token_ids`` sit at ``first_token`` of the
    prefix (0 for a whole prefix, the only kind that can be imported).
    """

    identity: dict[str, Any]
    token_ids: list[int]
    keys: list[torch.Tensor] = field(default_factory=list)
    values: list[torch.Tensor] = field(default_factory=list)
    first_token: int = 0

    @property
    def end_token(self) -> int:
        return self.first_token + len(self.token_ids)

    @classmethod
    def join(cls, parts: list[KVSnapshot]) -> KVSnapshot:
        """One snapshot from consecutive parts (each starting where the one before ends)."""
        if not parts:
            raise InvalidRequestError("no KV snapshot parts to join", param="snapshot")
        for before, after in zip(parts, parts[1:]):
            if after.first_token != before.end_token or after.identity != before.identity:
                raise InvalidRequestError("KV snapshot parts do not follow each other", param="snapshot")
        keys = [torch.cat(layer) for layer in zip(*(p.keys for p in parts))]
        values = [torch.cat(layer) for layer in zip(*(p.values for p in parts))]
        return cls(parts[0].identity, [t for p in parts for t in p.token_ids], keys, values, parts[0].first_token)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_blocks(self) -> int:
        return int(self.keys[0].shape[0]) if self.keys else 0

    def save(self, path: str) -> None:
        """Write atomically (a temporary file renamed over ``path``)."""
        from safetensors.torch import save_file

        tensors = {"token_ids": torch.tensor(self.token_ids, dtype=torch.int64)}
        for i, (k, v) in enumerate(zip(self.keys, self.values)):
            tensors[f"k.{i}"] = k.contiguous()
            tensors[f"v.{i}"] = v.contiguous()
        tmp = f"{path}.tmp-{os.getpid()}"
        save_file(tensors, tmp, metadata={_META_KEY: json.dumps(self.identity, sort_keys=True),
                                          _FIRST_KEY: str(self.first_token)})
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: str) -> KVSnapshot:
        from safetensors import safe_open

        with safe_open(path, framework="pt") as handle:
            metadata = handle.metadata() or {}
            raw = metadata.get(_META_KEY)
            if raw is None:
                raise InvalidRequestError(f"{path} is not a PocketLLM KV snapshot (no {_META_KEY} metadata)")
            identity = json.loads(raw)
            layers = int(identity.get("num_layers", 0))
            token_ids = handle.get_tensor("token_ids").tolist()
            keys = [handle.get_tensor(f"k.{i}") for i in range(layers)]
            values = [handle.get_tensor(f"v.{i}") for i in range(layers)]
        return cls(identity, token_ids, keys, values, int(metadata.get(_FIRST_KEY, "0")))


def _layers(core) -> list:
    layers = core.runner.attention_layers
    if not layers or any(getattr(a, "k_cache", None) is None or a.k_cache.dim() < 2 for a in layers):
        raise UnsupportedFeatureError("this engine's KV cache layout cannot be exported")
    return layers


def model_identity(core, model_path: str) -> dict[str, Any]:
    """What must match for a snapshot to be valid here: the model file, dtype, block size and cache layout."""
    layers = _layers(core)
    size = 0
    if os.path.isfile(model_path):
        size = os.path.getsize(model_path)
    elif os.path.isdir(model_path):
        size = sum(os.path.getsize(os.path.join(model_path, name)) for name in sorted(os.listdir(model_path))
                   if name.endswith((".safetensors", ".gguf")))
    architectures = getattr(core.runner.hf_config, "architectures", None) or ["?"]
    return {
        "format": FORMAT,
        "model": os.path.basename(os.path.normpath(model_path)),
        "model_bytes": size,
        "architecture": architectures[0],
        "dtype": str(layers[0].k_cache.dtype).removeprefix("torch."),
        "block_size": int(core.blocks.block_size),
        "num_layers": len(layers),
        "block_shape": [list(a.k_cache.shape[1:]) for a in layers],
    }


def _check_enabled(core) -> None:
    if core.runner.tp_size > 1:
        raise UnsupportedFeatureError("KV snapshots hold one rank's cache: not available with tensor parallelism")
    if not core.blocks.enable_prefix_caching:
        raise UnsupportedFeatureError("KV snapshots need the prefix cache (enable_prefix_caching=True)")


def export_prefix(core, token_ids: list[int], model_path: str, first_token: int = 0) -> KVSnapshot:
    """The longest prefix of ``token_ids`` whose full blocks the prefix cache holds, with their KV; from
    ``first_token`` on (a block boundary) when only an increment is wanted."""
    _check_enabled(core)
    blocks = core.blocks
    if first_token < 0 or first_token % blocks.block_size:
        raise InvalidRequestError(f"first_token must be a multiple of the block size {blocks.block_size}",
                                  param="first_token")
    skip = first_token // blocks.block_size
    found = blocks.cached_blocks(list(token_ids), len(token_ids) // blocks.block_size)
    identity = model_identity(core, model_path)
    layers = _layers(core)
    if len(found) <= skip:
        empty = [a.k_cache.new_empty((0, *a.k_cache.shape[1:]), device="cpu") for a in layers]
        return KVSnapshot(identity, [], empty, [t.clone() for t in empty], first_token)
    index = torch.tensor(found[skip:], dtype=torch.int64, device=layers[0].k_cache.device)
    keys = [a.k_cache.index_select(0, index).to("cpu") for a in layers]
    values = [a.v_cache.index_select(0, index).to("cpu") for a in layers]
    return KVSnapshot(identity, list(token_ids[first_token:len(found) * blocks.block_size]), keys, values,
                      first_token)


def check_compatible(snapshot: KVSnapshot, identity: dict[str, Any]) -> None:
    """Refuse a snapshot made by another model, dtype, block size or cache layout."""
    theirs = snapshot.identity
    wrong = [name for name in sorted(set(identity) | set(theirs)) if identity.get(name) != theirs.get(name)]
    if wrong:
        detail = ", ".join(f"{n}: snapshot {theirs.get(n)!r} vs engine {identity.get(n)!r}" for n in wrong)
        raise InvalidRequestError(f"the KV snapshot was made by a different engine setup ({detail})",
                                  param="snapshot")
    if len(snapshot.keys) != identity["num_layers"] or len(snapshot.values) != identity["num_layers"]:
        raise InvalidRequestError("the KV snapshot has the wrong number of layers", param="snapshot")
    blocks = len(snapshot.token_ids) // identity["block_size"]
    if len(snapshot.token_ids) % identity["block_size"] or any(
            int(t.shape[0]) != blocks for t in (*snapshot.keys, *snapshot.values)):
        raise InvalidRequestError("the KV snapshot's tensors do not match its token count", param="snapshot")


def import_prefix(core, snapshot: KVSnapshot, model_path: str) -> int:
    """Place the snapshot's blocks in the prefix cache; returns how many leading tokens it now serves.

    Blocks already cached are kept; missing ones take the least recently freed blocks (never a block a
    running request holds). When free blocks run short only the leading part of the prefix is imported.
    """
    _check_enabled(core)
    if snapshot.first_token:
        raise InvalidRequestError(f"this snapshot starts at token {snapshot.first_token}; join it to the parts "
                                  "before it (KVSnapshot.join) and import the whole prefix", param="snapshot")
    check_compatible(snapshot, model_identity(core, model_path))
    blocks = core.blocks
    layers = _layers(core)
    chain = list(blocks.chain_keys(list(snapshot.token_ids), len(snapshot.token_ids) // blocks.block_size))
    present = [blocks.cached.get(key) for key, _ in chain]
    for block_id in present:   # keep the cached part of the chain from being chosen for reuse below
        if block_id is not None and block_id in blocks.free:
            blocks.free.move_to_end(block_id)
    spare = blocks.num_free_blocks - sum(1 for b in present if b is not None and b in blocks.free)
    sources: list[int] = []
    targets: list[int] = []
    served = 0
    for i, ((key, digest), block_id) in enumerate(zip(chain, present)):
        if block_id is None:
            if spare <= 0:
                break
            block_id, _ = blocks.free.popitem(last=False)
            spare -= 1
            block = blocks.blocks[block_id]
            if block.key is not None and blocks.cached.get(block.key) == block_id:
                del blocks.cached[block.key]
            block.key, block.hash = key, digest
            blocks.cached[key] = block_id
            blocks.free[block_id] = None      # free (ref count 0) and findable, most recently used
            sources.append(i)
            targets.append(block_id)
        served = (i + 1) * blocks.block_size
    if targets:
        device = layers[0].k_cache.device
        src = torch.tensor(sources, dtype=torch.int64)
        dst = torch.tensor(targets, dtype=torch.int64, device=device)
        for layer, k, v in zip(layers, snapshot.keys, snapshot.values):
            # (same dtype as the cache: ``check_compatible``; a float8 cache's codes are copied as they are)
            copy_rows_(layer.k_cache, dst, k.index_select(0, src).to(device=device))
            copy_rows_(layer.v_cache, dst, v.index_select(0, src).to(device=device))
    return served
