"""Batch-1 decode of the native plane (backend='cpp') against the Torch backend on one random Qwen3 or Qwen3.5
checkpoint.

Builds a Qwen3-shaped (``--arch qwen3``) or Qwen3.5-shaped (``--arch qwen3_5``: Gated DeltaNet layers with one
full-attention layer in four) checkpoint with random float32 weights (sizes from the flags), then, for each backend in
a process of its own, generates ``--tokens`` tokens greedily (EOS ignored) for a ``--prompt-len``-token prompt
after one warm-up request, and prints one JSON line per backend: decode tokens/s over the tokens after the first
(``usage.decode_time_s``), and the prefill time. ``--device cuda`` runs both there (the native module a CUDA
build; the Torch backend in float32, as the native engine computes)."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile


def build_checkpoint(directory: str, args: argparse.Namespace) -> None:
    """A random Qwen3 or Qwen3.5 checkpoint with the flags' sizes (tied embeddings, float32) and the default
    model's tokenizer (SmolLM2's, 49152 tokens: the vocabulary's default), or that of ``--tokenizer-gguf``."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

    from pocketllm.loaders.default_model import default_model_path

    gguf = args.tokenizer_gguf or default_model_path()
    PreTrainedTokenizerFast.from_pretrained(os.path.dirname(gguf), gguf_file=os.path.basename(gguf),
                                            local_files_only=True).save_pretrained(directory)

    sizes = dict(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
                 num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
                 head_dim=args.head_dim, tie_word_embeddings=True, max_position_embeddings=4096)
    if args.arch == "qwen3_5":
        config = AutoConfig.for_model(
            "qwen3_5_text", **sizes,
            layer_types=["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(args.layers)],
            linear_num_key_heads=args.linear_key_heads, linear_num_value_heads=args.linear_value_heads,
            linear_key_head_dim=args.linear_head_dim, linear_value_head_dim=args.linear_head_dim,
            linear_conv_kernel_dim=4,
            rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25})
    else:
        config = AutoConfig.for_model("qwen3", **sizes)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(directory)


def measure(model: str, backend: str, prompt_len: int, tokens: int, device: str) -> dict:
    """One backend's batch-1 numbers (run in a child process so the two never share memory or threads)."""
    import torch

    from pocketllm import LLM, EngineArgs, SamplingParams

    args = EngineArgs(model=model, backend=backend, cpu_kv_cache_gb=0.25, max_num_seqs=4, device=device)
    if backend == "torch":
        args = args.replace(cpu_weight_format="float32", dtype="float32")
    prompt = [int(t) for t in torch.randint(0, 1000, (prompt_len,), generator=torch.Generator().manual_seed(1))]
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    with LLM(args) as llm:
        llm.generate([prompt], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
        out = llm.generate([[t + 1 for t in prompt]], params)[0]
    usage = out.usage
    return {"backend": backend, "device": device, "threads": torch.get_num_threads(),
            "prompt_tokens": usage.prompt_tokens,
            "completion_tokens": usage.completion_tokens, "prefill_s": round(usage.prefill_time_s, 4),
            "decode_tok_s": round((usage.completion_tokens - 1) / usage.decode_time_s, 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", choices=("qwen3", "qwen3_5"), default="qwen3")
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--intermediate", type=int, default=3072)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--linear-key-heads", type=int, default=8, help="qwen3_5: Gated DeltaNet key heads")
    parser.add_argument("--linear-value-heads", type=int, default=16, help="qwen3_5: Gated DeltaNet value heads")
    parser.add_argument("--linear-head-dim", type=int, default=128, help="qwen3_5: Gated DeltaNet head size")
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--tokenizer-gguf", help="a GGUF file whose tokenizer the checkpoint gets (default: the "
                        "default model's)")
    parser.add_argument("--checkpoint", help="build the checkpoint in this directory and keep it (reused when "
                        "it holds one already) instead of a temporary directory")
    parser.add_argument("--child", nargs=2, metavar=("MODEL", "BACKEND"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args.child[0], args.child[1], args.prompt_len, args.tokens, args.device)))
        return
    with tempfile.TemporaryDirectory() as scratch:
        directory = args.checkpoint or scratch
        if not os.path.isfile(os.path.join(directory, "config.json")):
            build_checkpoint(directory, args)
        for backend in ("cpp", "torch"):
            subprocess.run([sys.executable, os.path.abspath(__file__), "--child", directory, backend,
                            "--prompt-len", str(args.prompt_len), "--tokens", str(args.tokens),
                            "--device", args.device], check=True)


if __name__ == "__main__":
    main()
