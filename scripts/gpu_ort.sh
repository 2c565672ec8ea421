#!/usr/bin/env bash
# ONNX Runtime on the H200 (issue 16), in one call of at most ~8 minutes: onnxruntime-gpu unpacked from the carried
# parts, `m3export verify --provider cuda` on the tiny model, the GPU tests (a sync-free ORT-CUDA step equal to the
# torch backend; generation through the onnxruntime backend on CUDA equal to the torch backend token for token; a steady
# CUDA step binding and allocating nothing; the rejected PagedAttention lowering's distance to the torch backend,
# reported; the indexer / MoE bodies' tie rule and the attention bodies' adversarial and 16k cases under ORT's CUDA
# kernels; one pytest process per test file, each with its own limit), then a `mini` bf16 artifact with the
# ort-contrib flavour (MoE and MXFP8Linear lowered; PagedAttention is rejected, lowering.REJECTED) and bench/ort_gpu.py
# (plain vs lowered vs torch, batch 1 / 8 x context 4k / 32k, roofline) after `verify` on it, then its --profile of
# batch 1 / 4k (where an ORT step's time goes) if time is left. Every step has its own time limit, cut to what is left of
# the script's budget (GPU_ORT_BUDGET seconds, default 480), so the whole script ends in time; a step with too little
# time left is skipped and says so. Everything lands in $OUT (./out), in six files (a call brings back at most 8):
# gpu_ort.log (every step's output), summary.txt (each step's exit code and time), ort_gpu_h200.json (the benchmark),
# ort_gpu_profile_h200.json (the profile), flavour_record.json (the lowerings the manifest records), gpu.txt.
#
# onnxruntime-gpu is not on the machine: carry it in parts .c1 .. .cN (`scripts/pack_ort_gpu.py ... --parts 2`:
# two ~28.6 MiB parts, since a call carries the ~8.5 MiB working tree too and 64 MiB in all; `chunk-for-gpu`'s
# layout, so its parts of a plain wheel work too), one part per call, back to back, this script in the call with the
# last part. A carried folder does not outlive its call in the tree (the next call removes an ignored path it does not
# carry; seen 2026-12-01), so each earlier call copies its part out, `cp -r .c1 /tmp/c1`, and the last links it back,
# `ln -sfn /tmp/c1 .c1` (the machine keeps /tmp only while warm). It joins them under /tmp/ortgpu (a zip or an xz
# tar), ahead of the machine's CPU onnxruntime on sys.path, with the CUDA libraries of the machine's torch wheels
# on LD_LIBRARY_PATH.
#   bash scripts/gpu_ort.sh                  # on the H200, with .c1 .. .cN carried
#   GPU_ORT_DRY=1 bash scripts/gpu_ort.sh    # CPU dry run of the same commands: the installed onnxruntime, the CPU
#                                            # EP, tiny artifacts only, PagedAttention not lowered (no CPU kernel)
#   GPU_ORT_LOWER=MoE,MXFP8Linear  # (with either) the `mini` export's --lower (default MoE,MXFP8Linear,PagedAttentionCore,DecodeAttention)
#   GPU_ORT_PAGE=128               # (with either) the `mini` export's --page-size (default 16; ORT's paged
#                                  # FlashAttention needs a multiple of 128 at head size 128)
#   GPU_ORT_DECODE=1 bash scripts/gpu_ort.sh # the decode-only graph's steps only (GPU tests, the graph passes'
#                                            # GPU tests, mini bf16 export, plain / decode / decode-graph rows ->
#                                            # ort_gpu_decode_h200.json; DECODE_STEPS picks and orders them, e.g.
#                                            # DECODE_STEPS=export,kernels,passes for the kernel profile first)
set -uo pipefail
cd "$(dirname "$0")/.."
R=$PWD
export OUT="${OUT:-$R/out}" PYTHONUNBUFFERED=1 OMP_NUM_THREADS="${OMP_NUM_THREADS:-8}"
unset TRITON_INTERPRET
mkdir -p "$OUT"
DRY="${GPU_ORT_DRY:-0}"
DEADLINE=$((SECONDS + ${GPU_ORT_BUDGET:-480}))
: > "$OUT/summary.txt"; : > "$OUT/gpu_ort.log"
status=0

# step NAME LIMIT CMD...: run CMD (a program or a shell function) with a time limit of min(LIMIT, time left - 5 s), its output appended to
# $OUT/gpu_ort.log under a header
step() {
  local name=$1 limit=$2; shift 2
  local left=$((DEADLINE - SECONDS - 5))
  [ "$left" -lt "$limit" ] && limit=$left
  if [ "$limit" -lt 15 ]; then
    echo "$name: SKIPPED (budget spent)" | tee -a "$OUT/summary.txt"; status=1; return 1
  fi
  local t0=$SECONDS
  echo "== $name (limit ${limit}s)" | tee -a "$OUT/gpu_ort.log"
  if declare -F "$1" > /dev/null; then  # a shell function (unpack): timeout runs programs, not functions (exit
    # 127 on the H200), so the function runs in a child bash under the same limit
    timeout "$limit" bash -c "$(declare -f "$1"); \"\$@\"" bash "$@" > /tmp/gpu_ort_step.log 2>&1
  else
    timeout "$limit" "$@" > /tmp/gpu_ort_step.log 2>&1
  fi
  local rc=$?
  grep -v "it/s\]\|s/step\|tensor/s\]" /tmp/gpu_ort_step.log >> "$OUT/gpu_ort.log"  # progress bars dropped
  tail -n 25 /tmp/gpu_ort_step.log
  echo "$name: exit $rc in $((SECONDS - t0))s$([ $rc = 124 ] && echo ' (TIMED OUT)')" | tee -a "$OUT/summary.txt"
  [ "$rc" = 0 ] || status=1
  return "$rc"
}

if [ "$DRY" = 1 ]; then
  PROVIDER=cpu BIG_PRESET=tiny BIG_DTYPE=float16 LOWER=MoE,MXFP8Linear BENCH_ARGS="--smoke" PROFILE_SHAPES=""
  export PYTHONPATH="$R${PYTHONPATH:+:$PYTHONPATH}"
else
  # GPU_ORT_LOWER: the ort-contrib lowerings of the `mini` export; default MoE,MXFP8Linear,PagedAttentionCore,
  # DecodeAttention (lowering.DEFAULT: the dense layers as com.microsoft.PagedAttention, the decode graphs' with
  # one-token bounds; the lowered-decode-graph rows time it); e.g. MoE,MXFP8Linear,DecodeAttention for the dense
  # decode attention as ONNX Attention-24 on gathered rows instead (export/decode_attention.py)
  PROVIDER=cuda BIG_PRESET=mini BIG_DTYPE=bfloat16 LOWER="${GPU_ORT_LOWER:-MoE,MXFP8Linear,PagedAttentionCore,DecodeAttention}" BENCH_ARGS=""
  PROFILE_SHAPES="--shapes 1x4096"
  if ! ls .c1/part.* >/dev/null 2>&1; then
    echo "no .c1/part.*: carry onnxruntime-gpu (scripts/pack_ort_gpu.py + chunk-for-gpu)" | tee -a "$OUT/summary.txt"
    exit 2
  fi
  unpack() {
    rm -rf /tmp/ortgpu /tmp/ortgpu.blob && mkdir -p /tmp/ortgpu || return 1
    cat $(ls -d .c[0-9]* | sort -V | sed 's#$#/part.*#') > /tmp/ortgpu.blob || return 1
    ls -l .c[0-9]*/part.*
    if python3 -c "import zipfile,sys; sys.exit(not zipfile.is_zipfile('/tmp/ortgpu.blob'))"; then
      python3 -m zipfile -e /tmp/ortgpu.blob /tmp/ortgpu
    elif xz -t /tmp/ortgpu.blob; then
      tar -xJf /tmp/ortgpu.blob -C /tmp/ortgpu
    else
      echo "the parts above do not join into a whole zip or xz file: was every .cN carried (in this machine's lease)?"
      return 1
    fi && rm -f /tmp/ortgpu.blob
  }
  step unpack 90 unpack || exit 2
  NV=$(timeout 30 python3 -c "import nvidia, os; print(':'.join(os.path.join(p, d, 'lib') for p in nvidia.__path__ for d in sorted(os.listdir(p)) if os.path.isdir(os.path.join(p, d, 'lib'))))" 2>/dev/null)
  export LD_LIBRARY_PATH="${NV}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  export PYTHONPATH="/tmp/ortgpu:$R${PYTHONPATH:+:$PYTHONPATH}"
fi
timeout 30 nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader > "$OUT/gpu.txt" 2>&1
step providers 60 python3 -c "
import onnxruntime as o, onnx_graphsurgeon as g, torch
print('onnxruntime', o.__version__, o.__file__, o.get_available_providers(), 'graphsurgeon', g.__version__, 'torch', torch.__version__)
if '$PROVIDER' == 'cuda':
    assert 'CUDAExecutionProvider' in o.get_available_providers(), 'no CUDA EP in this onnxruntime'
" || { [ "$DRY" = 1 ] || exit 2; }

M="python3 -m m3export.cli"
if [ "${GPU_ORT_DECODE:-0}" = 1 ]; then
  # the decode-only graph (issue 16, export/decode_graph.py) alone: its GPU tests (captured ORT CUDA-graph replay
  # equal to the eager decode graph, generation equal to the torch backend), then a `mini` bf16 artifact (with its
  # ort-contrib flavour, whose decode graph keeps com.microsoft.MoE) and bench/ort_gpu.py's plain /
  # decode-graph / lowered-decode-graph rows beside the torch backend (DECODE_VARIANTS; each backend holds its own
  # weights, ~12 GB a session for mini bf16, and a decode variant opens up to three), then generation through the
  # onnxruntime backend on CUDA (the decode graph is its default there now)
  # DECODE_STEPS: which steps, in that order (default: tests,passes,shared,export,bench,runtime); `shared`: the
  # sessions' one copy of the weights on the device (plugins/onnxruntime/shared_weights.py); `kernels` (after
  # `export`) is bench/ort_kernels.py: where the GPU time of a decode-graph step goes, kernel by kernel, eager and
  # replayed (ort_kernels_h200.json); `kernels_lowered` the same for the ort-contrib flavour's decode graph (its MoE on
  # com.microsoft.MoE; ort_kernels_lowered_h200.json); `passes` runs the RMSNorm / RoPE graph passes' GPU tests (tiny artifacts:
  # each pass alone at batch 8 / 7 / 1, eager and replayed; what ORT's CUDA optimiser made of each pass, written to
  # optimized_ops_<dtype>.json); `passes_mini` (after `export`) is bench/ort_passes.py: the same passes applied to
  # the `mini` artifact's own decode graph, each against the no-pass graph and the torch backend at batch 8 and 1
  # (ort_passes_h200.json); `ties` the indexer / MoE bodies' tie rule and the bodies' index checks under ORT's CUDA
  # kernels (tests/test_indexer_tie_order.py, tests/test_onnx_body_indices.py)
  for s in $(echo "${DECODE_STEPS:-tests,passes,shared,export,bench,runtime}" | tr , ' '); do
    case "$s" in
      tests) step "gpu_tests test_ort_decode_graph_gpu" 150 python3 -m pytest -v -p no:cacheprovider -m gpu -rfs \
          --tb=short --durations=3 tests/test_ort_decode_graph_gpu.py tests/test_onnx_decode_bodies.py ;;
      ties) step "gpu_tests test_indexer_tie_order" 120 python3 -m pytest -v -p no:cacheprovider -m gpu -rfs \
          --tb=short tests/test_indexer_tie_order.py tests/test_onnx_body_indices.py ;;
      passes)
        step "gpu_tests test_ort_fused_norms_decode" "${PASSES_LIMIT:-200}" python3 -m pytest -v -p no:cacheprovider \
            -m gpu -rfs --tb=short --durations=5 tests/test_ort_fused_norms_decode.py
        step "gpu_tests test_ort_fused_norms(_rope)" 60 python3 -m pytest -v -p no:cacheprovider -m gpu -rfs \
            --tb=short tests/test_ort_fused_norms.py tests/test_ort_fused_norms_rope.py ;;
      shared) step "gpu_tests test_ort_shared_weights" 60 python3 -m pytest -v -p no:cacheprovider -m gpu -rfs \
          --tb=short tests/test_ort_shared_weights.py ;;
      export) step export_big 200 $M export --preset "$BIG_PRESET" --dtype "$BIG_DTYPE" --flavour ort-contrib \
          --lower "$LOWER" --page-size "${GPU_ORT_PAGE:-16}" --out /tmp/ortgpu-art/big --force ;;
      kernels) step kernel_profile "${KERNELS_LIMIT:-240}" python3 bench/ort_kernels.py --artifact /tmp/ortgpu-art/big \
          --provider "$PROVIDER" --shapes "${KERNEL_SHAPES:-1x4096,8x4096}" \
          --all-experts-shapes "${KERNEL_ALL_EXPERTS_SHAPES-1x4096}" --steps "${KERNEL_STEPS:-5}" \
          --json "$OUT/ort_kernels_h200.json" ;;
      kernels_lowered) step kernel_profile_lowered "${KERNELS_LIMIT:-240}" python3 bench/ort_kernels.py \
          --artifact /tmp/ortgpu-art/big --provider "$PROVIDER" --flavour ort-contrib \
          --shapes "${KERNEL_LOWERED_SHAPES:-1x4096}" --steps "${KERNEL_STEPS:-5}" \
          --json "$OUT/ort_kernels_lowered_h200.json" ;;
      passes_mini) step passes_mini 150 python3 bench/ort_passes.py --artifact /tmp/ortgpu-art/big \
          --provider "$PROVIDER" --json "$OUT/ort_passes_h200.json" ;;
      bench) step bench_decode 240 python3 bench/ort_gpu.py --artifact /tmp/ortgpu-art/big --provider "$PROVIDER" \
          $BENCH_ARGS --variants "${DECODE_VARIANTS:-plain,decode-graph,lowered-decode-graph}" \
          ${DECODE_SHAPES:---shapes 1x4096,8x4096,1x32768} --json "$OUT/ort_gpu_decode_h200.json" ;;
      runtime) step "gpu_tests test_runtime_onnxruntime" 90 python3 -m pytest -v -p no:cacheprovider -m gpu -rfs \
          --tb=short tests/test_runtime_onnxruntime.py ;;
      *) echo "DECODE_STEPS: unknown step $s (tests, ties, passes, shared, export, kernels, kernels_lowered, passes_mini, bench, runtime)" \
             | tee -a "$OUT/summary.txt"
         status=1 ;;
    esac
  done
  cat "$OUT/summary.txt"
  exit "$status"
fi
step export_tiny 120 $M export --preset tiny --dtype float32 --out /tmp/ortgpu-art/tiny --force
step verify_tiny 120 $M verify /tmp/ortgpu-art/tiny --provider "$PROVIDER" --fast
# the FP8 cache artifact: its verify once aborted at interpreter exit (ORT freeing pinned memory after the CUDA
# runtime shut down); sessions are closed explicitly now, so the exit code is the verdict
step export_tiny_fp8 120 $M export --preset tiny --dtype float32 --kv-cache-dtype fp8 --out /tmp/ortgpu-art/tiny-fp8 \
    --force
step verify_tiny_fp8 120 $M verify /tmp/ortgpu-art/tiny-fp8 --provider "$PROVIDER" --fast
# GPU tests (they skip, with their reason, without onnxruntime-gpu and a CUDA device), one pytest process per file
# with its own limit (at most GPU_TEST_LIMIT, and all of them together at most 240 s of the budget): a crash in one
# file (the last call's "Fatal Python error: Aborted") costs that file only, its exit code is in summary.txt and
# the next file runs. -v names each test as it starts, so a crash's log ends at the test that crashed.
TESTS_END=$((SECONDS + 240))
for f in tests/test_ort_cuda_stream.py tests/test_runtime_onnxruntime.py tests/test_paged_session_binding.py \
    tests/test_indexer_tie_order.py tests/test_onnx_body_indices.py tests/test_bench_ort_gpu.py \
    tests/test_paged_session_close.py; do
  limit=$((TESTS_END - SECONDS)); [ "$limit" -gt "${GPU_TEST_LIMIT:-90}" ] && limit=${GPU_TEST_LIMIT:-90}
  step "gpu_tests $(basename "$f" .py)" "$limit" python3 -m pytest -v -p no:cacheprovider -m gpu -rfs --tb=short \
      --durations=3 "$f"
done
step export_big 200 $M export --preset "$BIG_PRESET" --dtype "$BIG_DTYPE" --flavour ort-contrib --lower "$LOWER" \
    --page-size "${GPU_ORT_PAGE:-16}" --out /tmp/ortgpu-art/big --force
timeout 30 python3 -c "import json; r = json.load(open('/tmp/ortgpu-art/big/manifest.json'))['flavours']['ort-contrib']
print(json.dumps(r, indent=1))" > "$OUT/flavour_record.json" 2>&1
# the big artifact through `verify` (its PyTorch reference runs on the host), before the benchmarks: a verdict is
# worth more than a timing when the budget runs short
step verify_big 200 $M verify /tmp/ortgpu-art/big --provider "$PROVIDER" --fast
step bench 240 python3 bench/ort_gpu.py --artifact /tmp/ortgpu-art/big --provider "$PROVIDER" $BENCH_ARGS \
    --json "$OUT/ort_gpu_h200.json"
# where a batch 1 / 4k ORT step's time goes (its own process: the timed rows above carry no profiler)
step bench_profile 150 python3 bench/ort_gpu.py --artifact /tmp/ortgpu-art/big --provider "$PROVIDER" $BENCH_ARGS \
    $PROFILE_SHAPES --profile --json "$OUT/ort_gpu_profile_h200.json"
cat "$OUT/summary.txt"
exit "$status"
