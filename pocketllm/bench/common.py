"""What the bench commands share: the random workload, the hardware description, memory-bandwidth
measurement, JSON and plot output, and the HF transformers peer model."""

from __future__ import annotations

import gc
import json
import os
import platform
import random
import sys
import time
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class Workload:
    """Requests of random token ids with their own output lengths (EOS ignored)."""

    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def num_output_tokens(self) -> int:
        return sum(self.output_lens)

    def head(self, n: int) -> Workload:
        return Workload(self.prompts[:n], self.output_lens[:n])


def random_workload(num_requests: int, input_range: tuple[int, int], output_range: tuple[int, int], vocab: int,
                    seed: int) -> Workload:
    """Prompt and output lengths uniform in their ranges (inclusive), token ids uniform in [0, vocab)."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(*input_range))] for _ in range(num_requests)]
    outputs = [rng.randint(*output_range) for _ in range(num_requests)]
    return Workload(prompts, outputs)


def hardware() -> dict[str, Any]:
    """CPU and accelerator names, core count, library versions."""
    info: dict[str, Any] = {
        "platform": platform.platform(), "python": sys.version.split()[0], "torch": torch.__version__,
        "cpu": _cpu_name(), "cpu_count": os.cpu_count(), "threads": torch.get_num_threads(),
        "load_average": load_average(),
    }
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info.update(gpu=props.name, gpu_memory_gib=round(props.total_memory / 2**30, 1),
                    gpu_sms=props.multi_processor_count, cuda=torch.version.cuda)
        try:
            import triton

            info["triton"] = triton.__version__
        except ImportError:
            pass
    try:
        import transformers

        info["transformers"] = transformers.__version__
    except ImportError:
        pass
    return info


def load_average() -> list[float] | None:
    """The 1/5/15-minute load averages (None where the OS has none): CPU numbers mean little under load."""
    try:
        return [round(v, 2) for v in os.getloadavg()]
    except (AttributeError, OSError):
        return None


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as handle:
            for line in handle:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def measure_bandwidth(device: torch.device, repeats: int = 10) -> float:
    """Device memory bandwidth in bytes/s from a large copy (bytes read plus bytes written), median of runs.

    CUDA: a 4 GiB copy timed with device events (smaller copies read lower: launch and tail effects).
    """
    if device.type == "cuda":
        src = torch.randn(1 << 30, device=device)
        dst = torch.empty_like(src)
        times = []
        for i in range(repeats + 2):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src)
            end.record()
            end.synchronize()
            if i >= 2:
                times.append(start.elapsed_time(end) / 1e3)
    else:
        src = torch.randn(64 << 20, device=device)  # 256 MiB
        dst = torch.empty_like(src)
        times = []
        for i in range(repeats + 2):
            start = time.perf_counter()
            dst.copy_(src)
            if i >= 2:
                times.append(time.perf_counter() - start)
    times.sort()
    return 2 * src.numel() * 4 / times[len(times) // 2]


def engine_vocab_size(llm) -> int:
    """The vocabulary size of the model an ``LLM`` or ``AsyncLLM`` runs."""
    return llm.model_info().vocab_size


def write_json(path: str | None, result: dict[str, Any]) -> None:
    if path:
        with open(path, "w", encoding="utf-8") as handle:
            json.dump(result, handle, indent=2)
            handle.write("\n")


def plot_path(args, json_path: str | None) -> str | None:
    """``--plot`` if given, else the JSON path with .png, else None (no plot)."""
    if getattr(args, "plot", None):
        return args.plot
    if json_path:
        return os.path.splitext(json_path)[0] + ".png"
    return None


def bar_plot(path: str | None, title: str, bars: dict[str, float], ylabel: str, note: str = "") -> str | None:
    """A bar chart (matplotlib, when installed); returns the path written or None."""
    if not path:
        return None
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("note: matplotlib is not installed (pip install 'pocketllm[bench]'); no plot written",
              file=sys.stderr)
        return None
    fig, ax = plt.subplots(figsize=(6, 4))
    names = list(bars)
    values = [bars[n] for n in names]
    palette = ["#2b6cb0", "#a0aec0", "#718096", "#4a5568"]
    ax.bar(names, values, color=[palette[i % len(palette)] for i in range(len(names))])
    for i, value in enumerate(values):
        ax.text(i, value, f"{value:,.1f}", ha="center", va="bottom")
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    if note:
        fig.text(0.01, 0.01, note, fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def hf_peer_model(model_path: str | None, load_format: str, dtype: torch.dtype, device: torch.device):
    """The same checkpoint in HF transformers (random weights for a dummy preset), eval mode, on ``device``."""
    from transformers import AutoModelForCausalLM

    from pocketllm.loaders.default_model import default_model_path
    from pocketllm.loaders.dummy import PRESETS, preset_config

    path = model_path or default_model_path()
    if load_format == "dummy" or path in PRESETS:
        config = preset_config(path)
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    elif path.endswith(".gguf"):
        directory, name = os.path.split(path)
        model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=dtype, local_files_only=True)
    else:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True)
    return model.to(device).eval()


def release_memory() -> None:
    """Let the engine's weights, KV cache and graphs go before a peer loads its own copy."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
