"""The bench commands run on CPU with a tiny model and write the JSON fields they promise."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from pocketllm.cli.main import main

SMALL_ENGINE = ["--num-kv-blocks", "64", "--device", "cpu"]


def _read(path) -> dict:
    with open(path, encoding="utf-8") as handle:
        return json.load(handle)


def test_bench_throughput(tiny_checkpoint, tmp_path, capsys):
    out = tmp_path / "throughput.json"
    assert main(["bench", "throughput", "--model", tiny_checkpoint("llama"), "--num-requests", "5", "--min-len", "3",
                 "--max-len", "9", "--warmup-requests", "1", "--output-json", str(out), *SMALL_ENGINE]) == 0
    result = _read(out)
    ours = result["pocketllm"]
    assert result["benchmark"] == "throughput"
    assert result["workload"]["num_requests"] == 5 and result["workload"]["temperature"] == 0.6
    assert ours["num_requests"] == 5 and 5 * 3 <= ours["output_tokens"] <= 5 * 9
    assert ours["output_tokens_per_s"] > 0 and ours["elapsed_s"] > 0 and ours["requests_per_s"] > 0
    assert "cpu" in result["hardware"] and result["engine_args"]["max_model_len"] == 18
    assert "output tok/s" in capsys.readouterr().out


def test_bench_latency_with_hf_peer(tiny_checkpoint, tmp_path, capsys):
    out = tmp_path / "latency.json"
    assert main(["bench", "latency", "--model", tiny_checkpoint("qwen3"), "--input-len", "8", "--output-len", "5",
                 "--num-iters", "1", "--warmup-iters", "0", "--peak-bandwidth-gbs", "10", "--peer", "hf",
                 "--output-json", str(out), *SMALL_ENGINE]) == 0
    result = _read(out)
    ours = result["pocketllm"]
    assert result["workload"] == {"batch_size": 1, "input_len": 8, "output_len": 5, "greedy": True}
    assert ours["runs"][0]["tokens"] == 5
    assert ours["decode_tokens_per_s"] > 0 and ours["ttft_s"] > 0 and ours["weight_bytes"] > 0
    assert ours["bound_bandwidth_gbs"] == pytest.approx(10.0)
    assert ours["fraction_of_bound"] == pytest.approx(ours["achieved_bandwidth_gbs"] / 10.0)
    assert ours["host_exposed_per_step_s"] > 0
    peer = result["peer"]["hf"]
    assert peer["decode_tokens_per_s"] > 0 and peer["ratio_pocketllm_over_peer"] > 0
    assert "pocketllm / hf" in capsys.readouterr().out


def _config_only(checkpoint: str, out_dir) -> str:
    """A copy of a checkpoint's configs only: served with dummy weights and no tokenizer, as a preset is."""
    out_dir.mkdir()
    for name in ("config.json", "generation_config.json"):
        shutil.copy(os.path.join(checkpoint, name), out_dir / name)
    return str(out_dir)


@pytest.mark.parametrize(("tokenizer", "processes"), [(True, 1), (False, 1), (True, 2)],
                         ids=["with-tokenizer", "without-tokenizer", "two-client-processes"])
def test_bench_serve(tiny_checkpoint, tmp_path, tokenizer, processes):
    """Without a tokenizer the stream's texts are empty: the tokens are still timed and counted (from usage).
    With two client processes each sends its share and the results come back together."""
    from server_utils import ServerProcess

    if tokenizer:
        model = ["--model", tiny_checkpoint("llama")]
    else:
        model = ["--model", _config_only(tiny_checkpoint("llama"), tmp_path / "m"), "--load-format", "dummy"]
    server = ServerProcess(*model, *SMALL_ENGINE)
    try:   # no wait here: the benchmark waits for /ready itself
        out = tmp_path / "serve.json"
        assert main(["bench", "serve", "--base-url", server.url, "--num-requests", "4", "--request-rate", "50",
                     "--max-concurrency", "3", "--min-input-len", "4", "--max-input-len", "12",
                     "--min-output-len", "3", "--max-output-len", "6", "--vocab-size", "1000",
                     "--client-processes", str(processes), "--output-json", str(out)]) == 0
    finally:
        server.stop()
    result = _read(out)["pocketllm"]
    assert result["completed"] == 4 and result["failed"] == 0, result["errors"]
    assert 4 * 3 <= result["output_tokens"] <= 4 * 6
    for name in ("ttft_s", "tpot_s", "itl_s", "e2e_s"):
        assert result[name]["p50"] is not None and result[name]["p99"] >= result[name]["p50"]
    assert result["requests_per_s"] > 0 and result["output_tokens_per_s"] > 0
    assert result["client_processes"] == processes


@pytest.mark.parametrize("tokens_in_the_last_chunk", [3, 0])
def test_bench_serve_counts_tokens_joined_into_the_finishing_chunk(monkeypatch, tokens_in_the_last_chunk):
    """A server that fell behind sends all of a request's tokens in its finishing chunk; without a tokenizer
    that chunk's text is empty and only the usage says tokens came. A stream with no tokens at all fails."""
    import asyncio

    from pocketllm.bench import serve_load, sse_client

    async def events(url, body, headers):
        final = {"choices": [{"index": 0, "text": "", "finish_reason": "length"}]}
        usage = {"choices": [], "usage": {"completion_tokens": tokens_in_the_last_chunk, "prompt_tokens": 2}}
        for at, payload in ((1.0, final), (1.5, usage)):
            yield at, json.dumps(payload).encode()
        yield 2.0, b"[DONE]"

    monkeypatch.setattr(sse_client, "stream_events", events)
    result = asyncio.run(serve_load._one("http://bench.test", {"prompt": [1, 2], "max_tokens": 3}, {}, 5.0))
    if tokens_in_the_last_chunk:
        assert result["error"] is None and result["chunks"] == [1.0] and result["output_tokens"] == 3
    else:
        assert result["error"] == "the stream carried no tokens"


def test_bench_serve_waits_for_ready_and_stops_on_a_refusal_that_will_not_pass():
    import asyncio

    import httpx

    from pocketllm.bench.serve import ServerNotReady, _wait_ready

    def server(answers: list[tuple[int, str]]):
        calls = []

        def handle(request: httpx.Request) -> httpx.Response:
            calls.append(request.url.path)
            status, message = answers[min(len(calls), len(answers)) - 1]
            body = {"status": "ready"} if status == 200 else {"error": {"message": message}}
            return httpx.Response(status, json=body)

        return httpx.AsyncClient(transport=httpx.MockTransport(handle)), calls

    async def wait(answers, seconds=30.0):
        client, calls = server(answers)
        async with client:
            await _wait_ready(client, "http://bench.test", seconds, {})
        return calls

    loading = (503, "the model is still loading; retry when /ready answers 200")
    assert asyncio.run(wait([loading, loading, (200, "")])) == ["/ready"] * 3
    with pytest.raises(ServerNotReady, match="cannot serve: the model failed to load: no such file"):
        asyncio.run(wait([loading, (503, "the model failed to load: no such file")]))
    with pytest.raises(ServerNotReady, match="not ready within 0.6 s .the model is still loading"):
        asyncio.run(wait([loading], seconds=0.6))


def test_bench_latency_with_llama_cpp_peer(smollm2_gguf, tmp_path, capsys):
    pytest.importorskip("llama_cpp")
    out = tmp_path / "latency.json"
    assert main(["bench", "latency", "--model", smollm2_gguf, "--input-len", "8", "--output-len", "4",
                 "--num-iters", "1", "--warmup-iters", "0", "--peak-bandwidth-gbs", "10", "--peer", "llama.cpp",
                 "--cpu-weight-format", "int4", "--output-json", str(out), *SMALL_ENGINE]) == 0
    peer = _read(out)["peer"]["llama.cpp"]
    assert peer["runs"][0]["tokens"] == 4 and peer["decode_tokens_per_s"] > 0 and peer["ttft_s"] > 0
    assert peer["ratio_pocketllm_over_peer"] > 0 and peer["ttft_ratio_pocketllm_over_peer"] > 0
    assert "pocketllm / llama.cpp" in capsys.readouterr().out


def test_bench_throughput_with_llama_cpp_peer(smollm2_gguf, tmp_path, capsys):
    pytest.importorskip("llama_cpp")
    out = tmp_path / "throughput.json"
    assert main(["bench", "throughput", "--model", smollm2_gguf, "--num-requests", "2", "--min-len", "3",
                 "--max-len", "5", "--warmup-requests", "0", "--peer", "llama.cpp", "--output-json", str(out),
                 *SMALL_ENGINE]) == 0
    result = _read(out)
    peer = result["peer"]["llama.cpp"]
    assert peer["num_requests"] == 2 and peer["output_tokens"] == result["pocketllm"]["output_tokens"]
    assert "llama.cpp (serial)" in capsys.readouterr().out


def test_llama_cpp_peer_needs_a_gguf(tiny_checkpoint, tmp_path):
    with pytest.raises(SystemExit, match="GGUF"):
        main(["bench", "latency", "--model", tiny_checkpoint("llama"), "--input-len", "4", "--output-len", "2",
              "--num-iters", "1", "--warmup-iters", "0", "--peak-bandwidth-gbs", "10", "--peer", "llama.cpp",
              *SMALL_ENGINE])


@pytest.mark.parametrize(("flag", "value", "least"), [("--num-iters", "0", 1), ("--output-len", "-3", 1),
                                                      ("--input-len", "0", 1), ("--warmup-iters", "-1", 0)])
def test_bench_latency_checks_its_sizes_before_loading(tmp_path, flag, value, least):
    """A size that cannot run is one line before the model loads (the checkpoint here does not even exist)."""
    with pytest.raises(SystemExit, match=f"^pocketllm bench latency: {flag} must be at least {least}, got {value}$"):
        main(["bench", "latency", "--model", str(tmp_path / "missing.gguf"), flag, value])


@pytest.mark.parametrize("benchmark", ["latency", "throughput", "startup"])
@pytest.mark.parametrize("flag", ["--output-json", "--plot"])
def test_bench_refuses_an_output_path_it_cannot_write_before_running(tmp_path, capsys, benchmark, flag):
    """An output file in a folder that does not exist is one line and status 2 before anything runs (the results
    of a whole run were lost when the write failed at its end)."""
    path = str(tmp_path / "absent" / "result.json")
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", benchmark, "--model", str(tmp_path / "missing.gguf"), flag, path])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err == (f"pocketllm bench {benchmark}: error: {flag} {path}: the folder "
                                       f"{tmp_path / 'absent'} does not exist or cannot be written\n")


def test_bench_startup(smollm2_gguf, tmp_path, capsys):
    """Cold processes of ``pocketllm run`` on the default model, one with a tokenizer cache to fill."""
    out = tmp_path / "startup.json"
    assert main(["bench", "startup", "--model", smollm2_gguf, "--runs", "1", "--fresh-tokenizer-cache",
                 "--output-json", str(out)]) == 0
    result = _read(out)
    assert result["benchmark"] == "startup" and result["runs"] == 1 and result["fresh_tokenizer_cache"] is True
    assert 0 < result["ttft_s"]["median"] <= result["exit_s"]["median"]
    assert "first token" in capsys.readouterr().out


def test_bench_startup_reports_a_failed_run(tmp_path):
    with pytest.raises(SystemExit, match="the run failed"):
        main(["bench", "startup", "--model", str(tmp_path / "missing.gguf"), "--runs", "1"])
