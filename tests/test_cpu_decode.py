"""The CPU decode fast path and the CPU weight formats, against the reference path and dequantised weights."""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from pocketllm.api import LLM
from pocketllm.config import EngineArgs
from pocketllm.errors import InvalidRequestError
from pocketllm.kernels import cpu_native
from pocketllm.layers import q4_linear, quantized_linear
from pocketllm.layers.quantized_linear import CpuLinear, RescoredLMHead, dequantize_int4, quantize_int4
from pocketllm.runner.step_backend import CpuDecodeBackend
from pocketllm.sampling_params import SamplingParams
from pocketllm.step.host_batch import gather_host_batch
from pocketllm.step.scheduled_chunk import ScheduledChunk


def test_int4_recovers_a_q4_1_grid_exactly() -> None:
    """Weights on a 4-bit grid (a Q4_1 block) keep their codes; the kernel's bfloat16 zero point
    (``low + 8 * scale``) is the only rounding."""
    torch.manual_seed(0)
    rows, cols = 24, 64
    scale = torch.rand(rows, cols // 32, 1).add(0.1).to(torch.bfloat16).float()
    low = torch.randn(rows, cols // 32, 1).to(torch.bfloat16).float()
    codes = torch.randint(0, 16, (rows, cols // 32, 32)).float()
    codes[..., 0], codes[..., 1] = 0, 15  # each group spans the whole grid, as a quantiser leaves it
    weight = (codes * scale + low).reshape(rows, cols)
    got_codes, scales_zeros = quantize_int4(weight)
    assert torch.equal(got_codes.reshape(codes.shape).float(), codes)
    zero_rounding = (low.abs() + 8 * scale) * 2.0 ** -8
    error = (dequantize_int4(got_codes, scales_zeros) - weight).reshape(codes.shape).abs()
    assert bool((error <= zero_rounding).all())


@pytest.mark.parametrize("rows", [1, 3, 40])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("kernel", ["q4", "torch"])
def test_int4_linear_matches_dequantised_matmul(rows: int, bias: bool, kernel: str,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """int4 layers multiply by the 4-bit weights they hold: a decode step's rows (``few_rows``) through the 4-bit
    x 8-bit kernel (where the CPU has it) or torch's int4 kernel up to 8 rows, the same weights dense in bfloat16
    above; a prompt chunk (``forward``) through the dense weights whatever its row count."""
    if kernel == "q4" and not cpu_native.available():
        pytest.skip("the CPU has no AVX-512 VNNI (or no compiler)")
    if kernel == "torch":
        monkeypatch.setitem(cpu_native._state, "ok", False)
    torch.manual_seed(1)
    weight, x = torch.randn(48, 96), torch.randn(rows, 96)
    b = torch.randn(48) if bias else None
    layer = CpuLinear(weight, b, "int4")
    assert (layer.records is not None) == (kernel == "q4")
    held = q4_linear.unpack_q4(layer.records) if kernel == "q4" else dequantize_int4(*quantize_int4(weight))
    out = layer.few_rows(x)
    chunk = layer(x)
    torch.testing.assert_close(chunk, F.linear(x.bfloat16(), held.bfloat16(), None if b is None else b.bfloat16()))
    if kernel == "q4" and rows <= 8:   # 8-bit activations per block of 32: the kernel's own reference
        assert out.dtype == torch.float32
        reference = q4_linear.reference(x, *q4_linear.quantize_q4(weight)) + (0 if b is None else b.bfloat16())
        torch.testing.assert_close(out, reference, rtol=1e-5, atol=1e-4)
    else:
        dense = held if rows <= 8 else held.bfloat16().float()   # many rows: the held weights in bfloat16
        reference = F.linear(x.bfloat16().float(), dense, None if b is None else b.bfloat16().float())
        torch.testing.assert_close(out.float(), reference, rtol=2e-2, atol=5e-2)
    assert (held - weight).abs().max() < 0.1 * weight.abs().max()


@pytest.mark.parametrize("rows", [1, 8, 40])
def test_int8_linear_matches_float_matmul(rows: int) -> None:
    """8-bit weights per output channel and 8-bit activations up to 8 rows (float32 out, within the rounding of
    both); above, the dense bfloat16 copy."""
    torch.manual_seed(5)
    weight, x, b = torch.randn(48, 96), torch.randn(rows, 96), torch.randn(48)
    layer = CpuLinear(weight, b, "int8")
    out = layer.few_rows(x)
    assert out.dtype == (torch.float32 if rows <= 8 else torch.bfloat16)
    reference = F.linear(x, weight, b)
    assert (out.float() - reference).abs().max() < 0.03 * reference.abs().max()
    assert layer.weight_bytes() == 48 * (96 + quantized_linear.Int8Product.extra) + 4 * 48   # (+ the range columns)


def test_bfloat16_linear_and_padded_rows() -> None:
    torch.manual_seed(2)
    weight, x = torch.randn(40, 64), torch.randn(2, 64)
    layer = CpuLinear(weight, None, "bfloat16", keep=33)
    out = layer(x)
    assert out.dtype == torch.bfloat16 and out.shape == (2, 33)
    torch.testing.assert_close(out.float(), F.linear(x.bfloat16(), weight.bfloat16())[:, :33].float())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rescore_kernel_equals_topk_and_exact_products(dtype: torch.dtype) -> None:
    """PocketLLM's rescoring kernel replaces the same top logits as torch's topk (a tie at the top included) by
    float32 products of the float weights, and a row's result does not depend on the rows beside it."""
    if not cpu_native.available():
        pytest.skip("the CPU has no AVX-512 VNNI (or no compiler)")
    torch.manual_seed(5)
    for vocab, hidden, count in [(4133, 96, 64), (100, 64, 64), (40, 32, 64)]:
        weight, x = (torch.randn(vocab + 3, hidden) * 0.05).to(dtype), torch.randn(3, hidden)
        base = torch.randn(3, vocab)
        base[0, 5] = base[0, 9] = base[0].max() + 1
        k = min(count, vocab)
        got = cpu_native.rescore_top(base.clone(), x, weight, k)
        top = base.topk(k, dim=-1).indices
        want = base.clone().scatter_(1, top, (x @ weight[:vocab].float().T).gather(1, top))
        assert torch.equal(got != base, want != base)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        alone = cpu_native.rescore_top(base[1:2].clone(), x[1:2].contiguous(), weight, k)
        assert torch.equal(alone[0], got[1])


@pytest.mark.parametrize("kernels", ["native", "torch"])
@pytest.mark.parametrize("fbgemm", [True, False])
def test_lm_head_rescores_its_top_candidates_exactly(fbgemm: bool, kernels: str,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """The top logits (and so the argmax) are the float head's, from an 8-bit head (an int4 one where fbgemm is
    missing), rescored by PocketLLM's kernel or torch's ops; many rows use it in bfloat16 throughout."""
    monkeypatch.setattr(quantized_linear, "int8_available", lambda: fbgemm)
    if kernels == "torch":
        monkeypatch.setitem(cpu_native._state, "ok", False)
    torch.manual_seed(4)
    weight, x = torch.randn(304, 64) * 0.1, torch.randn(3, 64)
    head = RescoredLMHead(weight, vocab_size=290)
    exact = F.linear(x, weight)[:, :290]
    logits = head(x)
    assert logits.shape == (3, 290) and logits.dtype == torch.float32
    top = exact.topk(8, dim=-1).indices
    torch.testing.assert_close(logits.gather(1, top), exact.gather(1, top), rtol=1e-5, atol=1e-5)
    assert torch.equal(logits.argmax(-1), exact.argmax(-1))
    assert isinstance(head.inner, quantized_linear.Int8Product if fbgemm else CpuLinear)
    assert (logits - exact).abs().max() < (0.02 if fbgemm else 0.2) * exact.abs().max()  # the rest: quantised
    many = torch.randn(40, 64)
    torch.testing.assert_close(head(many), F.linear(many.bfloat16(), weight.bfloat16())[:, :290].float())


def test_8_bit_product_of_a_row_does_not_depend_on_its_batch() -> None:
    """Each row is quantised on its own: a row's output is the same alone or beside rows of other magnitudes."""
    if not quantized_linear.int8_available():
        pytest.skip("this torch build has no fbgemm")
    torch.manual_seed(2)
    weight = torch.randn(300, 64) * 0.1
    product = quantized_linear.Int8Product(weight)
    x = torch.randn(5, 64) * torch.tensor([[1.0], [40.0], [0.01], [3.0], [1e-4]])
    batch = product(x)
    assert torch.equal(batch, torch.cat([product(row[None]) for row in x]))
    assert torch.equal(product(x.view(5, 1, 64)), batch.view(5, 1, 300))
    exact = F.linear(x, weight)
    assert ((batch - exact).norm(dim=1) / exact.norm(dim=1)).max() < 0.03   # each row on the full 8-bit range


def test_unknown_cpu_weight_format_is_refused() -> None:
    with pytest.raises(InvalidRequestError, match="cpu_weight_format"):
        EngineArgs(cpu_weight_format="int3")


def _without_cpu_decode(runner) -> None:
    """Take the CPU decode step out of the runner's step backends: every step runs the reference step."""
    runner.step_backends = [b for b in runner.step_backends if not isinstance(b, CpuDecodeBackend)]
    assert runner.cpu_decode is None


def _request(ids: list[int], table: list[int], prompt: int, computed: int) -> SimpleNamespace:
    """A request of tokens ``ids`` (the first ``prompt`` its prompt), ``computed`` of them cached."""
    return SimpleNamespace(prompt_token_ids=ids[:prompt], output_token_ids=ids[prompt:], all_token_ids=ids,
                           num_computed_tokens=computed, num_tokens=len(ids), block_table=table, state_slot=-1)


def _chunk(ids: list[int], table: list[int]) -> SimpleNamespace:
    """A decode chunk: the last of ``ids`` is the new token, the rest are cached."""
    return ScheduledChunk(_request(ids, table, 1, len(ids) - 1), 1, len(ids) - 1, True)


@pytest.mark.parametrize("kernels", ["native", "torch"])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mistral", "qwen2_swa"])   # the last two: windows
def test_fast_decode_step_equals_reference_forward(arch: str, kernels: str, tiny_checkpoint,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """One request over consecutive blocks (cache view), one over scattered blocks (gather), and a batch of
    three of different lengths (gather with padding): hidden states equal the model's own forward pass, with
    PocketLLM's decode attention (where the CPU runs it) and with torch's."""
    if kernels == "native" and not cpu_native.available():
        pytest.skip("the CPU has no AVX-512 VNNI (or no compiler)")
    if kernels == "torch":
        monkeypatch.setitem(cpu_native._state, "ok", False)
    with LLM(EngineArgs(model=tiny_checkpoint(arch), device="cpu", num_kv_blocks=32, block_size=4)) as llm:
        runner = llm._client.backend.core.runner
        assert runner.cpu_decode is not None
        assert runner.cpu_decode.native_attention() == (kernels == "native")
        torch.manual_seed(3)
        for layer in runner.attention_layers:
            layer.k_cache.normal_()
            layer.v_cache.normal_()
        batches = [
            [_chunk(list(range(10, 21)), [4, 5, 6])],
            [_chunk(list(range(30, 44)), [9, 2, 7, 12])],
            [_chunk(list(range(50, 57)), [13, 14]), _chunk(list(range(60, 78)), [20, 3, 15, 16, 17]),
             _chunk([70, 71], [25])],
        ]
        with torch.inference_mode():
            for chunks in batches:
                reference = runner.forward_reference(gather_host_batch(chunks, runner.block_size))
                fast = runner.cpu_decode.forward(chunks)
                torch.testing.assert_close(fast, reference, rtol=1e-4, atol=1e-4)


def _prompt_chunk(ids: list[int], table: list[int]) -> ScheduledChunk:
    """A whole prompt in one chunk that samples."""
    return ScheduledChunk(_request(ids, table, len(ids), 0), len(ids), 0, True)


def _verify_chunk(ids: list[int], draft: list[int], table: list[int]) -> ScheduledChunk:
    """A verify chunk: the last of ``ids`` (the rest cached) and the proposals ``draft``."""
    return ScheduledChunk(_request(ids, table, 1, len(ids) - 1), 1 + len(draft), len(ids) - 1, True, tuple(draft))


@pytest.mark.parametrize("fmt", ["int4", "float32"])
def test_decode_rows_beside_a_prompt_run_the_decode_step(fmt: str, tiny_checkpoint) -> None:
    """A step that holds prompt chunks besides decode rows runs the decode rows on the decode step and the
    prompts on the reference forward: each row's logits are those of the same chunk in a step of its own kind,
    bit for bit, whatever the order (the whole step on the reference forward gave the decode rows other
    rounding, and a request's greedy tokens then depended on when other prompts arrived)."""
    with LLM(EngineArgs(model=tiny_checkpoint("llama"), device="cpu", num_kv_blocks=64, block_size=4,
                        cpu_weight_format=fmt)) as llm:
        runner = llm._client.backend.core.runner
        torch.manual_seed(3)
        for layer in runner.attention_layers:
            layer.k_cache.normal_()
            layer.v_cache.normal_()
        first, second = _chunk(list(range(10, 21)), [4, 5, 6]), _chunk(list(range(30, 44)), [9, 2, 7, 12])
        prompt = _prompt_chunk(list(range(50, 59)), [20, 21, 22])
        step = runner.cpu_decode
        fast_calls = []
        forward = step.forward
        step.forward = lambda chunks: fast_calls.append(list(chunks)) or forward(chunks)
        with torch.inference_mode():
            decode = runner.launch([first, second])
            alone = runner.launch([prompt])
            for order in ([first, prompt, second], [prompt, first, second], [first, second, prompt]):
                fast_calls.clear()
                mixed = runner.launch(order)
                assert fast_calls == [[first, second]]   # the decode rows ran on the decode step
                rows = {id(chunk): mixed[i] for i, chunk in enumerate(order)}
                assert torch.equal(rows[id(first)], decode[0]) and torch.equal(rows[id(second)], decode[1])
                assert torch.equal(rows[id(prompt)], alone[0])
            if step.fused is None:   # verify chunks run on the decode step with the 4-bit kernels only
                return
            # A verify chunk's rows (the last token and two proposals) keep their place beside a prompt too. Its
            # decode step holds other rows than before: the 16 highest logits (rescored exactly) are compared.
            verify = _verify_chunk(list(range(80, 90)), [91, 92], [30, 31, 32])
            scored = runner.launch([verify])
            fast_calls.clear()
            mixed = runner.launch([prompt, verify, first])
            assert fast_calls == [[verify, first]]
            assert torch.equal(mixed[0], alone[0])
            for got, want in zip(mixed[1:], [*scored, decode[0]]):
                top = want.topk(16).indices
                assert torch.equal(got.topk(16).indices, top) and torch.equal(got[top], want[top])


@pytest.mark.parametrize("kv", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral", "qwen2_swa"])
def test_fused_step_equals_the_step_of_torch_ops(arch: str, kv: torch.dtype, tiny_checkpoint) -> None:
    """int4 weights in q4 records: the step in one C++ call (``decode_layers``) over a cache span, over the dense
    rows of three requests and over one request's dense row gives the hidden states of the step's torch ops
    around the same kernels, stores the same K/V in the paged cache and the dense rows, and leaves a gathered
    batch to the torch ops. Qwen2 adds a QKV bias, Mistral and qwen2_swa sliding windows; the cache is bfloat16
    (int4's default) or float32."""
    if not cpu_native.available():
        pytest.skip("the CPU has no AVX-512 VNNI (or no compiler)")
    with LLM(EngineArgs(model=tiny_checkpoint(arch), device="cpu", num_kv_blocks=256, block_size=4,
                        cpu_weight_format="int4", cpu_compile=True)) as llm:
        runner = llm._client.backend.core.runner
        step = runner.cpu_decode
        assert step.fused is not None and (len(step.fused.qkv_bias) > 0) == arch.startswith("qwen2")
        assert step.fused.windows == [layer.sliding_window or 0 for layer in runner.attention_layers]
        assert not step.compiles   # cpu_compile: nothing left to compile
        if kv != runner.kv_dtype:
            runner.kv_dtype = kv
            runner.allocate_kv_cache(runner.num_blocks)
        assert step.first_attention.k_cache.dtype == kv
        torch.manual_seed(3)
        for layer in runner.attention_layers:
            layer.k_cache.normal_()
            layer.v_cache.normal_()
        batches = {
            "span": [_chunk(list(range(10, 21)), [4, 5, 6])],
            "dense": [_chunk(list(range(50, 57)), [13, 14]), _chunk(list(range(60, 78)), [20, 3, 15, 16, 17]),
                      _chunk([70, 71], [25])],
            "one dense row": [_chunk(list(range(30, 44)), [9, 2, 7, 12])],
        }
        fused_calls = []
        run_fused = step.run_fused
        step.run_fused = lambda batch: fused_calls.append(batch) or run_fused(batch)
        with torch.inference_mode():
            for kind, chunks in batches.items():
                batch = step._metadata(chunks)
                assert (batch.span is not None, batch.dense_index is not None) == (kind == "span", kind != "span")
                eager = step.run(batch)
                stored = [(k[batch.slots].clone(), v[batch.slots].clone()) for k, v in step._cache_views()]
                fused = step.run_step(batch)
                assert fused_calls[-1] is batch
                assert float((fused - eager).norm() / eager.norm()) < 2e-3, kind
                for (k, v), (k_eager, v_eager) in zip(step._cache_views(), stored):
                    torch.testing.assert_close(k[batch.slots], k_eager, rtol=2e-2, atol=2e-2)
                    torch.testing.assert_close(v[batch.slots], v_eager, rtol=2e-2, atol=2e-2)
                if batch.dense_index is not None:
                    for (k, v), (k_rows, v_rows) in zip(step._cache_views(), step.dense_rows.layers):
                        shape = (-1, *k_rows.shape[2:])
                        assert torch.equal(k_rows.view(shape)[batch.dense_index], k[batch.slots])
                        assert torch.equal(v_rows.view(shape)[batch.dense_index], v[batch.slots])
            # More rows than the dense rows hold: the batch gathers its blocks, through the torch ops.
            many = [_chunk([1, 100 + i, 200 + i], [i]) for i in range(17)]
            batch = step._metadata(many)
            assert batch.index is not None
            torch.testing.assert_close(step.run_step(batch), step.run(batch))
        assert len(fused_calls) == 3


@pytest.mark.parametrize("fmt", ["auto", "int4", "int8"])
def test_greedy_tokens_equal_with_and_without_the_fast_path(fmt: str, tiny_checkpoint) -> None:
    """Whole generations, three requests at once: the fast path changes no greedy token (float32), and with
    int4 weights it runs end to end (prefill on the dense copy, decode on the packed kernel)."""
    prompts = [[1, 400, 401, 402], [1, 500], [1, 600, 601, 602, 603, 604, 605, 606, 607]]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    results = []
    for fast in (True, False):
        with LLM(EngineArgs(model=tiny_checkpoint("llama"), device="cpu", num_kv_blocks=64,
                            cpu_weight_format=fmt)) as llm:
            if not fast:
                _without_cpu_decode(llm._client.backend.core.runner)
            results.append([out.token_ids for out in llm.generate(prompts, params)])
    assert all(len(tokens) == 12 for tokens in results[0])
    if fmt == "auto":
        assert results[0] == results[1]


@pytest.mark.parametrize("fmt", ["int4", "bfloat16"])
def test_compiled_decode_step_matches_the_eager_step(fmt: str, tiny_checkpoint) -> None:
    """``cpu_compile``: every decode step (one request over its cache span, two over dense rows, one over a
    dense row because its blocks are not consecutive) computed by ``run_step`` and by the eager step on the same
    batch gives the same hidden states, within the rounding of bfloat16 activations (inductor fuses the
    elementwise ops between the products); every kind of step ran compiled, and none compiled again after
    start-up. int4 compiles with torch's kernels (with PocketLLM's, its steps are fused, not compiled: below);
    bfloat16 with PocketLLM's decode attention where the CPU runs it."""
    from torch._dynamo.utils import counters

    seen = []
    compiled_kinds = set()
    off = cpu_native.switched_off() if fmt == "int4" else contextlib.nullcontext()
    with off, LLM(EngineArgs(model=tiny_checkpoint("llama"), device="cpu", num_kv_blocks=64, cpu_weight_format=fmt,
                             cpu_compile=True)) as llm:
        core = llm._client.backend.core
        step = core.runner.cpu_decode
        assert step._compiled is not None
        compiled = step._compiled

        def counted(batch):
            kind = "span" if batch.span is not None else "dense" if batch.dense_index is not None else "gather"
            compiled_kinds.add((batch.ids.shape[0], kind))
            # After start-up a batch no graph takes would run eagerly; here it raises, so a kind start-up did not
            # compile fails the test.
            with torch.compiler.set_stance("fail_on_recompile"):
                return compiled(batch)

        step._compiled = counted
        graphs = counters["stats"]["unique_graphs"]

        def both(chunks):
            batch = step._metadata(chunks)
            eager = step.run(batch)
            compiled = step.run_step(batch)
            assert float((compiled - eager).norm() / eager.norm()) < 2e-2
            seen.append(len(chunks))
            return compiled

        step.forward = both
        params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
        alone = llm.generate([[1, 400, 401, 402]], params)
        pair = llm.generate([[1, 500, 501], [1, 600, 601, 602, 603]], params)
        # Free blocks in the order concurrent requests leave them (interleaved): the next request's two blocks
        # are not consecutive, so it decodes alone over a dense row.
        free = list(core.blocks.free)
        core.blocks.free.clear()
        core.blocks.free.update((block, None) for block in free[::2] + free[1::2])
        scattered = llm.generate([[1, *range(700, 720)]], params)
        assert counters["stats"]["unique_graphs"] == graphs
    assert [len(out.token_ids) for out in alone + pair + scattered] == [4, 4, 4, 4]
    assert 1 in seen and 2 in seen
    assert compiled_kinds == {(1, "span"), (2, "dense"), (1, "dense")}


def test_cpu_compile_refuses_a_model_without_the_fast_path() -> None:
    from pocketllm.runner.cpu_decode import setup_cpu

    with pytest.raises(InvalidRequestError, match="cpu_compile"):
        setup_cpu(torch.nn.Linear(4, 4), "auto", 16, compile_step=True)


@pytest.mark.parametrize("fmt", ["auto", "int4"])
def test_dense_rows_follow_a_changing_batch(fmt: str, tiny_checkpoint) -> None:
    """Requests of different lengths that end at different steps, and one that joins late: the batch's rows
    shift and the dense K/V rows are regathered; greedy tokens equal the reference path's (float32), and the
    rows hold exactly what the paged cache holds."""
    from pocketllm.engine.engine_core import EngineCore
    from pocketllm.loaders import hf_loader

    checked = []

    def rows_match_the_paged_cache(core) -> None:
        rows = core.runner.cpu_decode.dense_rows
        paged = core.runner.cpu_decode._cache_views()
        for i, request in enumerate(rows.owners):
            table = request.block_table
            for layer in (0, len(paged) - 1):
                for pos in range(rows.stored[i]):
                    slot = table[pos // 4] * 4 + pos % 4
                    assert torch.equal(rows.layers[layer][0][i, pos], paged[layer][0][slot])
                    assert torch.equal(rows.layers[layer][1][i, pos], paged[layer][1][slot])
        checked.append(len(rows.owners))

    def run(fast: bool) -> list[list[int]]:
        directory = tiny_checkpoint("llama")
        config = hf_loader.load_hf_config(directory)
        weights = hf_loader.SafetensorsWeights(hf_loader.safetensors_files(directory))
        core = EngineCore(EngineArgs(model=directory, device="cpu", num_kv_blocks=1024, block_size=4,
                                     cpu_weight_format=fmt), config, weights, frozenset())
        if not fast:
            _without_cpu_decode(core.runner)
        prompts = [[1, 400, 401, 402], [1, 500], [1, 600, 601, 602, 603, 604, 605], [1, 700, 701]]
        limits = [5, 11, 8, 9]
        requests = [core.add_request(f"r{i}", prompts[i], SamplingParams(max_tokens=limits[i], temperature=0.0,
                                                                          ignore_eos=True)) for i in range(3)]
        for step in range(20):
            if step == 3:
                requests.append(core.add_request("r3", prompts[3], SamplingParams(max_tokens=limits[3],
                                                                                  temperature=0.0, ignore_eos=True)))
            core.step()
            if fast and step in (2, 6, 9):   # three rows; four after the late join; three after the first ends
                rows_match_the_paged_cache(core)
        assert not core.has_work()
        return [r.output_token_ids for r in requests]

    fast_tokens = run(True)
    reference_tokens = run(False)
    assert [len(t) for t in fast_tokens] == [5, 11, 8, 9]
    if fmt == "auto":
        assert fast_tokens == reference_tokens
    assert checked == [3, 4, 4]


@pytest.mark.parametrize(("fmt", "kv", "expected"), [
    ("auto", "auto", torch.float32), ("int4", "auto", torch.bfloat16), ("int8", "auto", torch.bfloat16),
    ("bfloat16", "auto", torch.bfloat16),
    ("auto", "bfloat16", torch.bfloat16)])
def test_kv_cache_dtype_on_cpu(fmt: str, kv: str, expected: torch.dtype, tiny_checkpoint) -> None:
    """bfloat16/int4 weights keep a bfloat16 cache by default (their activations are bfloat16); a float32
    model keeps a float32 one unless asked; the fast path's attention reads either."""
    with LLM(EngineArgs(model=tiny_checkpoint("qwen3"), device="cpu", num_kv_blocks=32, cpu_weight_format=fmt,
                        kv_cache_dtype=kv)) as llm:
        assert llm._client.backend.core.runner.attention_layers[0].k_cache.dtype == expected
        outputs = llm.generate([[1, 400, 401], [1, 500]], SamplingParams(max_tokens=6, temperature=0.0,
                                                                         ignore_eos=True))
        assert [len(out.token_ids) for out in outputs] == [6, 6]


def test_fast_path_reads_only_the_decode_plan() -> None:
    """``runner/cpu_decode.py`` and ``cpu_kv_rows.py`` read no private attribute of another module's objects
    (their own ``self._...`` and torch's ``torch._dynamo`` aside), no layer internals, and import no model."""
    import ast
    from pathlib import Path

    import pocketllm.runner

    internals = {"inner", "records", "keep", "few_rows_dtype", "self_attn", "mlp", "rotary_emb", "input_layernorm",
                 "post_attention_layernorm", "embed_tokens", "qkv_proj", "gate_up_proj", "down_proj"}
    for name in ("cpu_decode.py", "cpu_kv_rows.py"):
        tree = ast.parse((Path(pocketllm.runner.__file__).parent / name).read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute):
                base = node.value
                while isinstance(base, ast.Attribute):
                    base = base.value
                own = isinstance(node.value, ast.Name) and node.value.id == "self"
                if node.attr.startswith("_") and not node.attr.startswith("__") and not own:
                    assert isinstance(base, ast.Name) and base.id == "torch", f"{name}:{node.lineno} .{node.attr}"
                assert node.attr not in internals, f"{name}:{node.lineno} .{node.attr}"
            elif isinstance(node, ast.ImportFrom):
                assert not (node.module or "").startswith("pocketllm.models"), f"{name}:{node.lineno}"


def test_decode_plan_describes_only_what_the_step_computes() -> None:
    """Plain RMSNorms and full-width rotary have plans; a zero-centred norm, partial rotary, an object without
    ``decode_plan`` and a model with another feed-forward have none."""
    from pocketllm.layers.decode_plan import decode_plan_of
    from pocketllm.layers.linear import RowParallelLinear
    from pocketllm.layers.norm import OffsetRMSNorm, RMSNorm
    from pocketllm.layers.rotary import RotaryEmbedding
    from pocketllm.models.llama import LlamaForCausalLM

    norm = RMSNorm(8, 1e-5).decode_plan()
    assert norm is not None and norm.eps == 1e-5 and norm.weight.shape == (8,)
    assert OffsetRMSNorm(8).decode_plan() is None
    full, partial = RotaryEmbedding(16, 16, 32, 10000.0), RotaryEmbedding(16, 8, 32, 10000.0)
    assert full.decode_plan() == RotaryEmbedding(16, 16, 32, 10000.0).decode_plan() and partial.decode_plan() is None
    product = RowParallelLinear(8, 4).decode_product()
    assert product.out_dtype == torch.float32 and product.bias is None and product.q4_records is None
    assert decode_plan_of(torch.nn.Linear(4, 4)) is None
    config = SimpleNamespace(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-6,
                             max_position_embeddings=64, rope_theta=10000.0)
    model = LlamaForCausalLM(config)
    plan = decode_plan_of(model)
    assert plan is not None and len(plan.layers) == 2 and plan.embedding is model.embed_tokens.weight
    attention = plan.layers[0].attention
    assert (attention.num_heads, attention.num_kv_heads, attention.head_dim) == (4, 2, 8)
    assert attention.cache is model.layers[0].self_attn.attn and attention.q_norm is None
    model.layers[1].mlp = torch.nn.Identity()
    assert decode_plan_of(model) is None
