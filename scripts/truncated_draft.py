"""Write a checkpoint's first N layers (with its embedding, final norm and LM head) as an HF safetensors directory
with its tokenizer: a layer-truncated draft model for speculative decoding, from the weights at hand (no download).

    python scripts/truncated_draft.py CHECKPOINT LAYERS OUT_DIR
    pocketllm bench latency --model CHECKPOINT --speculative-config \
        '{"method": "draft_model", "model": "OUT_DIR", "num_speculative_tokens": 4}'
"""

from __future__ import annotations

import argparse
import json
import os
import re

import torch
from safetensors.torch import save_file

from pocketllm.loaders.checkpoint import load_checkpoint

LAYER = re.compile(r"\.layers\.(\d+)\.")


def main() -> None:
    """Read the checkpoint, keep layers below LAYERS (float32) and write config, weights and tokenizer."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint")
    parser.add_argument("layers", type=int)
    parser.add_argument("out_dir")
    args = parser.parse_args()
    checkpoint = load_checkpoint(args.checkpoint)
    weights: dict[str, torch.Tensor] = {}
    for name, tensor in checkpoint.iter_weights():
        found = LAYER.search(name)
        if found is None or int(found.group(1)) < args.layers:
            weights[name] = tensor.float().contiguous()
    config = checkpoint.hf_config.to_dict()
    if not 0 < args.layers <= config["num_hidden_layers"]:
        parser.error(f"layers must be in 1..{config['num_hidden_layers']}")
    config["num_hidden_layers"] = args.layers
    os.makedirs(args.out_dir, exist_ok=True)
    save_file(weights, os.path.join(args.out_dir, "model.safetensors"))
    with open(os.path.join(args.out_dir, "config.json"), "w", encoding="utf-8") as handle:
        json.dump(config, handle)
    if checkpoint.tokenizer is not None:
        checkpoint.tokenizer.hf.save_pretrained(args.out_dir)
    print(f"{args.out_dir}: {args.layers} layers, {len(weights)} tensors")


if __name__ == "__main__":
    main()
