"""Tensor parallelism from the library on CPU (gloo): TP=2 decodes the same greedy tokens as TP=1, and the
worker ranks the library starts are reaped."""

from __future__ import annotations

import os
import time

import pytest
import torch.distributed as dist
from conftest import tiny_config

from pocketllm import LLM, SamplingParams
from pocketllm.cli.main import main
from pocketllm.config import EngineArgs
from pocketllm.distributed import tp_size
from pocketllm.distributed.group import RankInfo
from pocketllm.errors import EngineDeadError, InvalidRequestError

PROMPTS = [[1, 5, 9, 200, 3000], list(range(100, 141))]   # 5 and 41 tokens
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


def engine_args(model: str, tp: int, **extra) -> EngineArgs:
    """The Torch engine at ``tp`` ranks (named: backend='auto' would run a TP=1 Qwen3.5 on the native plane)."""
    return EngineArgs(model=model, backend="torch", tensor_parallel_size=tp, device="cpu", dtype="float32",
                      cpu_kv_cache_gb=0.02, max_model_len=256, tensor_parallel_startup_timeout=120,
                      tensor_parallel_shutdown_timeout=10, **extra)


def gone(pid: int) -> bool:
    """Whether ``pid`` no longer runs (a zombie counts as gone)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8") as handle:
            return handle.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def wait_gone(pids: list[int], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if all(gone(pid) for pid in pids):
            return True
        time.sleep(0.05)
    return all(gone(pid) for pid in pids)


def worker_pids(llm: LLM) -> list[int]:
    return [proc.pid for proc in llm._client.backend.tp.spawned.procs.values()]


def greedy(args: EngineArgs) -> tuple[list[list[int]], list[int]]:
    """Token ids of PROMPTS (one batch) and the pids of the worker ranks, which must be gone after shutdown."""
    llm = LLM(args)
    try:
        pids = worker_pids(llm) if args.tensor_parallel_size > 1 else []
        outputs = llm.generate(PROMPTS, GREEDY)
    finally:
        llm.shutdown()
    assert wait_gone(pids, 10), "a worker rank outlived LLM.shutdown()"
    assert not dist.is_initialized() and tp_size() == 1
    return [o.token_ids for o in outputs], pids


@pytest.mark.parametrize("arch", ["llama", "qwen3", "qwen3_moe", "qwen3_5_text", "qwen3_5_moe_text"])
def test_tp2_matches_tp1_greedy(tiny_checkpoint, arch: str) -> None:
    path = tiny_checkpoint(arch)
    single, _ = greedy(engine_args(path, 1))
    sharded, pids = greedy(engine_args(path, 2))
    assert len(pids) == 1
    assert all(len(ids) == 16 for ids in single)
    assert sharded == single


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_tp2_fp8_weights_match_tp1(tiny_checkpoint, arch: str) -> None:
    """quantization="fp8" over two ranks: a row-parallel layer's rows are split across the ranks, and each row's
    scale comes from the whole row (the maximum over the ranks), so the ranks hold TP=1's codes and scales."""
    path = tiny_checkpoint(arch)
    single, _ = greedy(engine_args(path, 1, quantization="fp8"))
    sharded, _ = greedy(engine_args(path, 2, quantization="fp8"))
    assert sharded == single


def test_tp2_dummy_weights_and_replicated_kv_head_match_tp1(tmp_path) -> None:
    """Random weights: each rank keeps its shard of what one rank would draw; a single KV head (fewer KV heads
    than ranks) is replicated on both ranks."""
    config = tiny_config("qwen3_moe")
    config.num_key_value_heads = 1
    config.vocab_size = 4096
    config.architectures = ["Qwen3MoeForCausalLM"]
    config.save_pretrained(tmp_path)
    single, _ = greedy(engine_args(str(tmp_path), 1, load_format="dummy"))
    sharded, _ = greedy(engine_args(str(tmp_path), 2, load_format="dummy"))
    assert sharded == single


def test_tp2_dummy_weights_of_a_hybrid_match_tp1(tmp_path) -> None:
    """Qwen3.5-MoE with random weights: the fused DeltaNet input projection, its conv and per-head vectors, and
    the experts each get this rank's shard of one rank's draw."""
    config = tiny_config("qwen3_5_moe_text")
    config.vocab_size = 4096
    config.architectures = ["Qwen3_5MoeForCausalLM"]
    config.save_pretrained(tmp_path)
    single, _ = greedy(engine_args(str(tmp_path), 1, load_format="dummy"))
    sharded, _ = greedy(engine_args(str(tmp_path), 2, load_format="dummy"))
    assert sharded == single


def test_worker_crash_fails_requests_and_is_reaped(tiny_checkpoint) -> None:
    llm = LLM(engine_args(tiny_checkpoint("llama"), 2))
    try:
        [pid] = worker_pids(llm)
        assert llm.generate(PROMPTS[:1], GREEDY)[0].token_ids
        os.kill(pid, 9)
        assert wait_gone([pid], 10)
        started = time.monotonic()
        with pytest.raises(EngineDeadError, match="tensor-parallel rank"):
            llm.generate(PROMPTS[:1], GREEDY)
        assert time.monotonic() - started < 30
    finally:
        llm.shutdown()
    assert not dist.is_initialized()


def test_rank_variables_are_checked() -> None:
    with pytest.raises(InvalidRequestError, match="RANK and WORLD_SIZE"):
        RankInfo.from_env({}, 2)
    with pytest.raises(InvalidRequestError, match="tensor_parallel_size is 2"):
        RankInfo.from_env({"RANK": "0", "WORLD_SIZE": "4"}, 2)
    with pytest.raises(InvalidRequestError, match="TP_RANK"):
        RankInfo.from_env({"RANK": "1", "WORLD_SIZE": "2", "TP_RANK": "0", "TP_WORLD": "2"}, 2)
    info = RankInfo.from_env({"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}, 2)
    assert (info.rank, info.world_size, info.local_rank, info.init_method) == (1, 2, 1, "env://")


def test_lifecycle_options_are_validated() -> None:
    with pytest.raises(InvalidRequestError, match="tensor_parallel_startup_timeout"):
        EngineArgs(tensor_parallel_startup_timeout=0)
    with pytest.raises(InvalidRequestError, match="tensor_parallel_master_port"):
        EngineArgs(tensor_parallel_master_port=70000)


def test_serve_without_supervisor_needs_the_launcher_variables(monkeypatch, capsys) -> None:
    for name in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    assert main(["serve", "--tensor-parallel-size", "2", "--no-tensor-parallel-supervisor"]) == 2
    assert "RANK and WORLD_SIZE" in capsys.readouterr().err


def bare_checkpoint(directory: str, arch: str) -> str:
    """A tiny random checkpoint with a three-word tokenizer: no packaged tokenizer needed (the GPU machine
    has none); prompts are token ids."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config(arch), dtype=torch.float32)
    model.config.architectures = [type(model).__name__]
    model.save_pretrained(directory)
    words = Tokenizer(models.WordLevel({"<unk>": 0, "<eos>": 1, "a": 2}, unk_token="<unk>"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=words, unk_token="<unk>", eos_token="<eos>").save_pretrained(directory)
    return directory


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["llama", "qwen3", "qwen3_moe"])
def test_tp2_nccl_matches_tp1_on_cuda(tmp_path, arch: str) -> None:
    """Two GPUs (NCCL, the kernel path without graphs) against one GPU, fp32."""
    import torch

    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA devices")
    model = bare_checkpoint(str(tmp_path), arch)
    one = engine_args(model, 1).replace(device="cuda", num_kv_blocks=64)
    two = engine_args(model, 2).replace(device="cuda", num_kv_blocks=64)
    expected, _ = greedy(one)
    assert greedy(two)[0] == expected


@pytest.mark.parametrize(("arch", "changes", "field"), [
    ("llama", {"num_attention_heads": 6, "num_key_value_heads": 3}, "num_key_value_heads=3"),
    ("llama", {"num_attention_heads": 3, "num_key_value_heads": 1}, "num_attention_heads=3"),
    ("qwen3_moe", {"moe_intermediate_size": 33}, "moe_intermediate_size=33"),
    ("qwen3_5_text", {"linear_num_key_heads": 1, "linear_num_value_heads": 2}, "linear_num_key_heads=1"),
    ("qwen3_5_text", {"num_attention_heads": 1, "num_key_value_heads": 1}, "num_attention_heads=1"),
])
def test_shapes_that_do_not_split_over_two_ranks_are_refused(monkeypatch, arch, changes, field) -> None:
    """Built as rank 0 of two (the group faked): heads or expert widths that two ranks cannot share evenly are
    refused by name, never floored."""
    import torch

    from pocketllm import distributed
    from pocketllm.errors import UnsupportedFeatureError
    from pocketllm.models.registry import model_class

    config = tiny_config(arch)
    for name, value in changes.items():
        setattr(config, name, value)
    config.architectures = [{"llama": "LlamaForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
                             "qwen3_5_text": "Qwen3_5ForCausalLM"}[arch]]
    monkeypatch.setattr(distributed, "_joined", True)
    monkeypatch.setattr(distributed.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(distributed.dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(distributed.dist, "get_rank", lambda group=None: 0)
    assert tp_size() == 2
    with pytest.raises(UnsupportedFeatureError, match=field), torch.device("meta"):
        model_class(config)(config)
