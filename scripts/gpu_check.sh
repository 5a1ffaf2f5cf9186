#!/usr/bin/env bash
# One device call: GPU tests, profiles and the three H200 benchmark numbers; logs and JSON under $OUT.
# Usage (on the GPU machine, repository root):
#   bash scripts/gpu_check.sh [tests|gdn|gemv|profile|latency|fp8|throughput|speculative|hybrid|models|serve|ab ...]
# TEST_K: a pytest -k expression for the tests stage (a subset of the GPU tests); failures and skips go to bench.log.
# TEST_IDS: a file of test node ids for the tests stage to run instead of every file with a gpu-marked test.
# fla-core (optional, for Qwen3.5 prefill) is picked up from PYTHONPATH if installed or unpacked there.
set -u
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
OUT=${OUT:-build/gpu-check}; mkdir -p "$OUT"
PY=${PY:-python3}
PLOTS=${PLOTS:-$OUT}  # at most 8 files come back from a device call: point PLOTS elsewhere to keep fewer
stages=${*:-tests gemv profile latency throughput}
# Wheels carried in build/wheels (pytest-xdist; the server's packages and py-spy, which the GPU machine lacks).
if ls build/wheels/*.whl > /dev/null 2>&1; then
  $PY -m pip install -q --no-deps --target build/pydeps build/wheels/*.whl > /dev/null 2>&1
  export PYTHONPATH=$PYTHONPATH:$PWD/build/pydeps PATH=$PATH:$PWD/build/pydeps/bin
fi

# serve_bench NAME [PYTHONPATH-prefix]: `pocketllm serve` of the throughput workload's model, then `bench serve`
# all at once and at 32 req/s, then once more all at once under py-spy (raw stacks in $OUT/NAME-stacks.txt).
# SERVE_VOCAB: the served model's vocabulary size, with which the requests are `bench throughput`'s workload.
serve_bench() {
  local name=$1 port=8010
  # -P: `python -m` would put the working directory (this tree) ahead of PYTHONPATH's other tree
  PYTHONPATH=${2:+$2:}$PYTHONPATH $PY -P -m pocketllm serve --model ${SERVE_MODEL:-qwen3-0.6b} --load-format dummy \
    --max-num-seqs 256 --max-num-batched-tokens 16384 --port $port > "$OUT/$name-server.log" 2>&1 &
  local server=$!
  if ! $PY -c "import os, sys, time, httpx
for _ in range(600):
    try:
        os.kill($server, 0)
    except OSError:
        sys.exit('the server exited: see $name-server.log')
    try:
        if httpx.get('http://127.0.0.1:$port/ready', timeout=2).status_code == 200: sys.exit()
    except httpx.HTTPError: pass
    time.sleep(0.5)
sys.exit('the server was not ready within 300 s')" >> "$OUT/bench.log" 2>&1; then
    tail -3 "$OUT/bench.log"; kill $server 2> /dev/null; return
  fi
  local common="--base-url http://127.0.0.1:$port --num-requests ${SERVE_REQUESTS:-256} --temperature 0.6 --vocab-size ${SERVE_VOCAB:-151936} ${SERVE_BENCH_ARGS:-}"
  echo "$name, all at once:" | tee -a "$OUT/bench.log"
  timeout 120 $PY -m pocketllm bench serve $common --output-json "$OUT/$name-inf.json" 2>&1 | tee -a "$OUT/bench.log"
  echo "$name, 32 req/s:" | tee -a "$OUT/bench.log"
  timeout 120 $PY -m pocketllm bench serve $common --request-rate 32 --output-json "$OUT/$name-32.json" 2>&1 \
    | tee -a "$OUT/bench.log"
  if [ -n "${3:-}" ] && command -v py-spy > /dev/null; then
    py-spy record -p $server --nonblocking --threads --rate 200 --format raw -o "$OUT/$name-stacks.txt" -d 25 \
      > /dev/null 2>&1 &
    local spy=$!
    sleep 1
    echo "$name, all at once, under py-spy:" | tee -a "$OUT/bench.log"
    timeout 120 $PY -m pocketllm bench serve $common 2>&1 | tee -a "$OUT/bench.log"
    wait $spy
  fi
  kill -INT $server; wait $server
}
# The tiny test checkpoints take the default model's tokenizer: a tokenizer-only copy of its GGUF, carried in
# build/ (python scripts/tokenizer_gguf.py SOURCE.gguf build/smollm2-tokenizer.gguf), where the package is absent.
if [ -f build/smollm2-tokenizer.gguf ]; then export POCKETLLM_TEST_TOKENIZER_GGUF=$PWD/build/smollm2-tokenizer.gguf; fi
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv | tee "$OUT/bench.log"
$PY -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)" | tee -a "$OUT/bench.log"
for stage in $stages; do
  start=$(date +%s)
  case $stage in
    tests)
      # Every test file with a gpu-marked test, found by the marker (pytest's collection), not listed by hand.
      # One shard per GPU (POCKETLLM_TEST_SHARD, tests/conftest.py): compiling every kernel variant on one GPU
      # took longer than a call's time limit.
      # (PYTEST_ADDOPTS cleared: a -v there changes the listing this reads)
      # TEST_IDS: a file of test node ids to run instead (e.g. those an earlier call did not reach: the collected
      # ids less the PASSED ones of its tests-*.log).
      if [ -n "${TEST_IDS:-}" ]; then files=$(cat "$TEST_IDS"); else
      files=$(PYTEST_ADDOPTS= $PY -m pytest -m gpu --collect-only -q -p no:cacheprovider tests 2>/dev/null | grep '::' | cut -d: -f1 | sort -u)
      fi
      if [ -z "$files" ]; then echo "no gpu-marked tests were collected" | tee -a "$OUT/bench.log"; exit 1; fi
      echo "gpu test files: $(echo $files)" | tee -a "$OUT/bench.log"
      gpus=$(nvidia-smi -L | wc -l)
      # Kernel compilation is CPU-bound: with pytest-xdist (carried as wheels in build/wheels) each GPU gets
      # several workers, which compile in parallel. Each result is a line of its own (-v), so a run cut short by
      # the timeout still says which tests passed.
      workers=""
      if [ -d build/pydeps/xdist ]; then workers="-n ${TEST_WORKERS_PER_GPU:-6}"; fi
      for ((i = 0; i < gpus; i++)); do
        CUDA_VISIBLE_DEVICES=$i POCKETLLM_TEST_SHARD=$i/$gpus timeout ${TESTS_TIMEOUT:-480} $PY -m pytest -m gpu \
          $files $workers -v -rfs -p no:cacheprovider ${TEST_K:+-k "$TEST_K"} > "$OUT/tests-$i.log" 2>&1 &
      done
      wait
      for ((i = 0; i < gpus; i++)); do
        echo "gpu tests shard $i/$gpus: $(tail -1 "$OUT/tests-$i.log"); $(grep -c " PASSED" "$OUT/tests-$i.log") passed" \
          | tee -a "$OUT/bench.log"
        grep -E "^(FAILED|ERROR|SKIPPED)" "$OUT/tests-$i.log" | head -30 | tee -a "$OUT/bench.log"
      done ;;
    gdn)
      timeout 100 $PY scripts/bench_gated_delta.py > "$OUT/gdn.log" 2>&1; cat "$OUT/gdn.log" | tee -a "$OUT/bench.log" ;;
    gemv)
      timeout 400 $PY scripts/bench_gemv.py > "$OUT/gemv.log" 2>&1; cat "$OUT/gemv.log" | tee -a "$OUT/bench.log" ;;
    profile)
      specs=("qwen3-0.6b 1 256" "qwen3-0.6b 256 800 graphs 0.6" "llama3-8b 1 256")
      for spec in "${specs[@]}"; do
        timeout 100 $PY scripts/profile_step.py $spec >> "$OUT/profile.log" 2>&1
      done
      grep "step wall" "$OUT/profile.log" | tee -a "$OUT/bench.log" ;;
    latency)
      for preset in qwen3-0.6b llama3-8b; do
        timeout 130 $PY -m pocketllm bench latency --model $preset --load-format dummy --peer hf \
          --output-json "$OUT/latency-$preset.json" --plot "$PLOTS/latency-$preset.png" 2>&1 | grep -v Warning | tee -a "$OUT/bench.log"
      done ;;
    fp8)
      # quantization="fp8": float8 weights with per-row scales, batch 1 (the bound halves with the bytes)
      for preset in ${FP8_PRESETS:-llama3-8b qwen3-0.6b}; do
        timeout 150 $PY -m pocketllm bench latency --model $preset --load-format dummy --quantization fp8 \
          --output-json "$OUT/latency-fp8-$preset.json" 2>&1 | grep -v Warning | tee -a "$OUT/bench.log"
      done ;;
    speculative)
      # A draft model's mechanics at batch 1 with random weights and forced acceptance: acceptance length k + 1
      # for k in SPEC_KS (default 1..3; the run without speculation is length 1). SPEC_PAIRS: "target draft" pairs
      # (default: Qwen3-0.6B drafting for itself, then Qwen3-8B drafted by Qwen3-0.6B: the same vocabulary).
      IFS=, read -ra pairs <<< "${SPEC_PAIRS:-qwen3-0.6b qwen3-0.6b,qwen3-8b qwen3-0.6b}"
      for pair in "${pairs[@]}"; do
        set -- $pair
        for k in ${SPEC_KS:-1 2 3}; do
          spec="{\"method\": \"draft_model\", \"model\": \"$2\", \"num_speculative_tokens\": $k, \"forced_acceptance\": true}"
          timeout ${SPEC_TIMEOUT:-200} $PY -m pocketllm bench latency --model $1 --load-format dummy --output-len 128 \
            --speculative-config "$spec" --output-json "$OUT/spec-$1-$2-k$k.json" 2>&1 | grep -v Warning | tee -a "$OUT/bench.log"
        done
      done ;;
    hybrid|models)
      # hybrid: the Qwen3.5 presets; models: MODEL_PRESETS (default the Gemma 3 preset), batch 1 and 64 requests
      presets="qwen3.5-9b qwen3.5-35b-a3b"
      if [ "$stage" = models ]; then presets=${MODEL_PRESETS:-gemma3-27b}; fi
      for preset in $presets; do
        timeout ${HYBRID_TIMEOUT:-150} $PY -m pocketllm bench latency --model $preset --load-format dummy \
          --output-json "$OUT/latency-$preset.json" 2>&1 | grep -v Warning | tee -a "$OUT/bench.log"
        timeout ${HYBRID_TIMEOUT:-150} $PY -m pocketllm bench throughput --model $preset --load-format dummy \
          --num-requests ${HYBRID_REQUESTS:-64} --max-num-seqs 64 --max-num-batched-tokens 8192 \
          --output-json "$OUT/throughput-$preset.json" 2>&1 | grep -v Warning | tee -a "$OUT/bench.log"
      done ;;
    serve)
      # The throughput workload served over HTTP; SERVE_BASELINE=DIR also serves the package copy in DIR first.
      if [ -n "${SERVE_BASELINE:-}" ]; then serve_bench baseline "$SERVE_BASELINE"; fi
      serve_bench served "" "${SERVE_PROFILE-profile}" ;;   # SERVE_PROFILE= (empty): no py-spy pass
    ab)
      # Batch-1 decode of AB_PRESETS with this tree (or the package in AB_NEW) and with the package in AB_BASE (a
      # folder holding another commit's pocketllm/, e.g. from `git archive REV pocketllm | tar -x -C build/base`),
      # alternated; AB_ARGS: more `bench latency` arguments (e.g. --quantization fp8).
      for preset in ${AB_PRESETS:-qwen3.5-35b-a3b}; do
        for which in new base new base; do
          src=${AB_NEW:-$PWD}; [ $which = base ] && src=${AB_BASE:?AB_BASE names the other tree}
          # -P: without it `python -m` puts the working directory, this tree, ahead of AB_BASE
          PYTHONPATH=$src:$PYTHONPATH timeout ${AB_TIMEOUT:-150} $PY -P -m pocketllm bench latency --model $preset \
            --load-format dummy ${AB_ARGS:-} > "$OUT/ab-$preset-$which.log" 2>&1
          echo "ab $preset $which: $(grep '^pocketllm:' "$OUT/ab-$preset-$which.log" | tail -1)" | tee -a "$OUT/bench.log"
        done
      done ;;
    throughput)
      # 16,384 tokens a step: vLLM's offline default on GPUs of 70 GB or more.
      timeout ${THROUGHPUT_TIMEOUT:-160} $PY -m pocketllm bench throughput --model qwen3-0.6b --load-format dummy --max-num-seqs 256 \
        --max-num-batched-tokens 16384 ${THROUGHPUT_ARGS:-} --output-json "$OUT/throughput.json" \
        --plot "$OUT/throughput.png" 2>&1 | tee -a "$OUT/bench.log" ;;
  esac
  echo "[$stage: $(( $(date +%s) - start )) s]" | tee -a "$OUT/bench.log"
done
