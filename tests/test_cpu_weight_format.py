"""``cpu_weight_format="auto"``: resolved once at engine construction, int4 only for Q4_1 GGUF weights where the
4-bit x 8-bit kernels run; the kernels' build cache; the checkpoint's default sampling."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pocketllm import LLM, EngineArgs
from pocketllm.engine.engine_core import resolve_cpu_weight_format
from pocketllm.kernels import cpu_native
from pocketllm.loaders.generation_defaults import FALLBACK_SAMPLING, default_sampling_params, sampling_defaults

CPU = torch.device("cpu")


def _resolve(weight_type: str | None, dtype: torch.dtype = torch.float32, device: torch.device = CPU,
             **args: object) -> str:
    return resolve_cpu_weight_format(EngineArgs(**args), device, dtype, weight_type).name


def test_auto_keeps_float_checkpoints_and_other_quantisations_as_loaded() -> None:
    assert _resolve(None) == "float32"
    assert _resolve("Q8_0") == "float32"
    assert _resolve("Q4_K") == "float32"   # not a Q4_1 block: int4 would quantise it again
    assert _resolve(None, torch.bfloat16) == "auto"   # left in the compute dtype, as before


@pytest.mark.skipif(not cpu_native.available(), reason="the CPU has no AVX-512 VNNI (or no compiler)")
def test_auto_takes_int4_for_q4_1_where_the_kernels_run() -> None:
    assert _resolve("Q4_1") == "int4"
    assert _resolve("Q4_1", tensor_parallel_size=2) == "float32"    # int4 runs on one rank
    with cpu_native.switched_off():
        assert _resolve("Q4_1") == "float32"                       # torch's int4 kernel is not the fast path
    assert _resolve("Q4_1", device=torch.device("cuda")) == "auto"   # means nothing off CPU


def test_an_explicit_format_is_kept() -> None:
    for fmt in ("float32", "bfloat16", "int4", "int8"):
        assert _resolve("Q4_1", cpu_weight_format=fmt) == fmt
        assert _resolve(None, cpu_weight_format=fmt) == fmt


def test_tiny_safetensors_checkpoints_run_float32_under_auto(tiny_checkpoint) -> None:
    """The parity tests' tiny HF checkpoints are float weights: "auto" leaves them as they were."""
    with LLM(EngineArgs(model=tiny_checkpoint("llama"), device="cpu", num_kv_blocks=16)) as llm:
        assert llm.engine_caps().details["cpu_weight_format"] == "float32"
        assert llm.args.cpu_weight_format == "auto"   # resolved into the engine, the arguments untouched


def test_the_default_gguf_reports_q4_1_layers(smollm2_gguf: str) -> None:
    from pocketllm.loaders import load_checkpoint

    assert load_checkpoint(smollm2_gguf).weight_type == "Q4_1"


def test_kernel_builds_are_keyed_by_what_they_are_built_from(monkeypatch: pytest.MonkeyPatch,
                                                             tmp_path: Path) -> None:
    monkeypatch.setenv("POCKETLLM_CACHE_DIR", str(tmp_path))
    first = cpu_native.build_dir()
    assert first.parent == tmp_path / "cpu_kernels" and not cpu_native.is_built()
    monkeypatch.setattr(cpu_native, "_CFLAGS", (*cpu_native._CFLAGS, "-DSOMETHING_ELSE"))
    assert cpu_native.build_dir() != first
    monkeypatch.delenv("POCKETLLM_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cpu_native.cache_root() == tmp_path / "xdg" / "pocketllm"


@pytest.mark.skipif(not cpu_native.available(), reason="the CPU has no AVX-512 VNNI (or no compiler)")
def test_a_built_library_is_found_by_a_new_process() -> None:
    import subprocess
    import sys

    assert cpu_native.is_built() and cpu_native.library_path().is_file()
    result = subprocess.run([sys.executable, "-m", "pocketllm.kernels.cpu_native"], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0 and result.stdout.startswith("built: "), result.stdout + result.stderr


def test_sampling_defaults_follow_the_generation_config() -> None:
    assert sampling_defaults({}) == FALLBACK_SAMPLING
    assert sampling_defaults(None) == FALLBACK_SAMPLING
    assert sampling_defaults({"eos_token_id": 2}) == FALLBACK_SAMPLING
    qwen = {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "do_sample": True}
    assert sampling_defaults(qwen) == {"temperature": 0.6, "top_p": 0.95, "top_k": 20}
    assert sampling_defaults({"do_sample": False})["temperature"] == 0.0
    params = default_sampling_params({"temperature": 0.3}, max_tokens=7, top_p=0.5)
    assert (params.temperature, params.top_p, params.max_tokens) == (0.3, 0.5, 7)
    greedy = default_sampling_params({"temperature": 0.6, "repetition_penalty": 1.2}, temperature=0)
    assert greedy.temperature == 0 and greedy.repetition_penalty == 1.0   # plain greedy: no default applies
    assert default_sampling_params({}, top_k=5).top_p == FALLBACK_SAMPLING["top_p"]
