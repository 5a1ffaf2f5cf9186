"""Loading checkpoint tensors (HF names) into a model's fused, tensor-parallel parameters."""

from __future__ import annotations

import re
from collections.abc import Iterable

import torch
from torch import nn

from pocketllm.distributed import single_rank, tp_size
from pocketllm.errors import CheckpointError, UnsupportedFeatureError
from pocketllm.layers.gated_delta import GatedDeltaInProj
from pocketllm.layers.linear import MergedColumnParallelLinear, QKVParallelLinear

_EXPERT = re.compile(r"^((?:mtp\.)?layers\.\d+\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$")


def _default_loader(param: nn.Parameter, loaded: torch.Tensor) -> None:
    if param.shape != loaded.shape:
        raise CheckpointError(f"shape mismatch: parameter {tuple(param.shape)} vs checkpoint {tuple(loaded.shape)}")
    param.data.copy_(loaded)


def load_weights(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Copy every checkpoint tensor into its parameter; raise if a parameter is left unloaded."""
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    tied = getattr(model, "tie_word_embeddings", False)
    packed = getattr(model, "packed_modules", {})
    for raw_name, tensor in weights:
        name = model.checkpoint_name(raw_name)
        if name is None:  # a part the model does not run (e.g. a vision tower or an MTP head)
            continue
        if tied and name == "lm_head.weight":
            continue
        if "rotary_emb.inv_freq" in name:
            continue
        expert = _EXPERT.match(name)
        if expert:
            prefix, index, part = expert.groups()
            target = f"{prefix}.{'w2' if part == 'down' else 'w13'}"
            params[target].weight_loader(params[target], tensor, part, int(index))
            loaded.add(target)
            continue
        for key, (fused, shard) in packed.items():
            if f".{key}." in name:
                target = name.replace(f".{key}.", f".{fused}.")
                params[target].weight_loader(params[target], tensor, shard)
                loaded.add(target)
                break
        else:
            if name not in params:
                raise CheckpointError(f"checkpoint tensor {raw_name!r} has no parameter in {type(model).__name__}")
            param = params[name]
            getattr(param, "weight_loader", _default_loader)(param, tensor)
            loaded.add(name)
    missing = sorted(set(params) - loaded - ({"lm_head.weight"} if tied else set()))
    if missing and all(name.startswith("mtp.") for name in missing):
        raise UnsupportedFeatureError("speculative_config.method 'mtp' needs the checkpoint's MTP head weights "
                                      f"(mtp.*); this checkpoint lacks {len(missing)} of them, e.g. {missing[:2]}")
    if missing:
        raise CheckpointError(f"checkpoint lacks {len(missing)} parameters, e.g. {missing[:4]}")


def _fill_table(param: nn.Parameter, generator: torch.Generator) -> bool:
    """A parameter that is a table, not a weight (``dummy_fill``: DeepSeek-V4's hash routing), filled its own way
    from ``generator``; whether it was one."""
    fill = getattr(param, "dummy_fill", None)
    if fill is None:
        return False
    fill(param.data, generator)
    return True


def _is_norm_like(name: str, param: torch.Tensor) -> bool:
    """Parameters dummy weights set to one (norm scales and other 1-D non-bias vectors)."""
    return name.endswith("norm.weight") or param.dim() == 1 and "bias" not in name


def _load_full(owner: nn.Module, twin: nn.Module, param: nn.Parameter, full: torch.Tensor) -> None:
    """Give ``param`` (of ``owner``, a tensor-parallel layer) its shard of ``full``, the tensor the unsharded
    ``twin`` layer holds; fused projections are split into their checkpoint parts first."""
    loader = getattr(param, "weight_loader", None)
    if isinstance(owner, QKVParallelLinear):
        q, kv = twin.num_heads * twin.head_dim, twin.num_kv_heads * twin.head_dim
        for shard, part in zip("qkv", full.split([q, kv, kv])):
            loader(param, part, shard)
    elif isinstance(owner, MergedColumnParallelLinear):
        for index, part in enumerate(full.split(twin.output_sizes)):
            loader(param, part, index)
    elif isinstance(owner, GatedDeltaInProj):
        for shard, part in zip(twin.parts, full.split([sum(sizes) for sizes in twin.parts.values()])):
            loader(param, part, shard)
    elif loader is not None:
        loader(param, full)
    else:
        _default_loader(param, full)


def _init_dummy_sharded(model: nn.Module, seed: int) -> None:
    """Tensor parallelism: draw the unsharded model's weights exactly as one rank would, keep this rank's shard."""
    with single_rank(), torch.device("meta"):
        twin = type(model)(model.config)
    device = next(model.parameters()).device
    generator = torch.Generator(device=device).manual_seed(seed)
    twin_modules = dict(twin.named_modules())
    twin_params = dict(twin.named_parameters())
    for module_name, module in model.named_modules():
        for local_name, param in module.named_parameters(recurse=False):
            name = f"{module_name}.{local_name}" if module_name else local_name
            if name not in twin_params or _fill_table(param, generator):  # a tied weight (filled through
                continue                                                   # its first name) or a table
            shape = twin_params[name].shape
            if _is_norm_like(name, param):
                full = torch.ones(shape, dtype=param.dtype, device=device)
            elif device.type != "cpu":
                full = torch.empty(shape, dtype=param.dtype, device=device).normal_(0.0, 0.02, generator=generator)
            else:
                full = (torch.randn(shape, generator=generator, dtype=torch.float32) * 0.02).to(param.dtype)
            _load_full(module, twin_modules[module_name], param, full)


def init_dummy_weights(model: nn.Module, seed: int = 0) -> None:
    """Random weights with the model's real shapes (for benchmarks and tests without a checkpoint).

    On an accelerator the values are drawn there, in the parameter's dtype (seconds for an 8B model instead
    of minutes through the host); they differ from the CPU draw of the same seed. Under tensor parallelism each
    rank keeps its shard of the weights one rank would draw.
    """
    if tp_size() > 1:
        _init_dummy_sharded(model, seed)
        return
    first = next(model.parameters(), None)
    if first is not None and first.device.type != "cpu":
        generator = torch.Generator(device=first.device).manual_seed(seed)
        for name, param in model.named_parameters():
            if _fill_table(param, generator):
                continue
            if _is_norm_like(name, param):
                param.data.fill_(1.0)
            else:
                param.data.normal_(0.0, 0.02, generator=generator)
        return
    generator = torch.Generator(device="cpu").manual_seed(seed)
    for name, param in model.named_parameters():
        if _fill_table(param, generator):
            continue
        if _is_norm_like(name, param):
            param.data.fill_(1.0)
            continue
        values = torch.randn(param.shape, generator=generator, dtype=torch.float32) * 0.02
        param.data.copy_(values.to(param.dtype))
