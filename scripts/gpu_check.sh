#!/usr/bin/env bash
# One device call: GPU tests, profiles and the three H200 benchmark numbers; logs and JSON under $OUT.
# Usage (on the GPU machine, repository root): bash scripts/gpu_check.sh [tests|gdn|gemv|profile|latency|throughput|hybrid ...]
# fla-core (optional, for Qwen3.5 prefill) is picked up from PYTHONPATH if installed or unpacked there.
set -u
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
OUT=${OUT:-build/gpu-check}; mkdir -p "$OUT"
PY=${PY:-python3}
PLOTS=${PLOTS:-$OUT}  # at most 8 files come back from a device call: point PLOTS elsewhere to keep fewer
stages=${*:-tests gemv profile latency throughput}
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv | tee "$OUT/bench.log"
$PY -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)" | tee -a "$OUT/bench.log"
for stage in $stages; do
  start=$(date +%s)
  case $stage in
    tests)
      # Every test file with a gpu-marked test, found by the marker (pytest's collection), not listed by hand.
      # One shard per GPU (POCKETLLM_TEST_SHARD, tests/conftest.py): compiling every kernel variant on one GPU
      # took longer than a call's time limit.
      files=$($PY -m pytest -m gpu --collect-only -q -p no:cacheprovider tests 2>/dev/null | grep '::' | cut -d: -f1 | sort -u)
      if [ -z "$files" ]; then echo "no gpu-marked tests were collected" | tee -a "$OUT/bench.log"; exit 1; fi
      echo "gpu test files: $(echo $files)" | tee -a "$OUT/bench.log"
      gpus=$(nvidia-smi -L | wc -l)
      # Kernel compilation is CPU-bound: with pytest-xdist (carried as wheels in build/wheels) each GPU gets
      # several workers, which compile in parallel.
      workers=""
      if ls build/wheels/pytest_xdist-*.whl > /dev/null 2>&1; then
        $PY -m pip install -q --no-deps --target build/pydeps build/wheels/*.whl > /dev/null 2>&1
        export PYTHONPATH=$PYTHONPATH:$PWD/build/pydeps
        workers="-n ${TEST_WORKERS_PER_GPU:-6}"
      fi
      for ((i = 0; i < gpus; i++)); do
        CUDA_VISIBLE_DEVICES=$i POCKETLLM_TEST_SHARD=$i/$gpus timeout ${TESTS_TIMEOUT:-480} $PY -m pytest -m gpu \
          $files $workers -q -rfs -p no:cacheprovider > "$OUT/tests-$i.log" 2>&1 &
      done
      wait
      for ((i = 0; i < gpus; i++)); do
        echo "gpu tests shard $i/$gpus: $(tail -1 "$OUT/tests-$i.log")" | tee -a "$OUT/bench.log"
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
    hybrid)
      for preset in qwen3.5-9b qwen3.5-35b-a3b; do
        timeout ${HYBRID_TIMEOUT:-150} $PY -m pocketllm bench latency --model $preset --load-format dummy \
          --output-json "$OUT/latency-$preset.json" 2>&1 | grep -v Warning | tee -a "$OUT/bench.log"
        timeout ${HYBRID_TIMEOUT:-150} $PY -m pocketllm bench throughput --model $preset --load-format dummy \
          --num-requests ${HYBRID_REQUESTS:-64} --max-num-seqs 64 --max-num-batched-tokens 8192 \
          --output-json "$OUT/throughput-$preset.json" 2>&1 | grep -v Warning | tee -a "$OUT/bench.log"
      done ;;
    throughput)
      # 16,384 tokens a step: vLLM's offline default on GPUs of 70 GB or more.
      timeout ${THROUGHPUT_TIMEOUT:-160} $PY -m pocketllm bench throughput --model qwen3-0.6b --load-format dummy --max-num-seqs 256 \
        --max-num-batched-tokens 16384 ${THROUGHPUT_ARGS:-} --output-json "$OUT/throughput.json" \
        --plot "$OUT/throughput.png" 2>&1 | tee -a "$OUT/bench.log" ;;
  esac
  echo "[$stage: $(( $(date +%s) - start )) s]" | tee -a "$OUT/bench.log"
done
