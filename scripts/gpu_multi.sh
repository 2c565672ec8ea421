#!/usr/bin/env bash
# Tensor / expert parallelism on the 2-GPU machine (nvidia-h200-x2), one call, within M3_MULTI_BUDGET_S seconds
# (default 440: run it as `timeout 470 bash scripts/gpu_multi.sh`). Stages, in order of value, each with its own
# time limit cut to what is left of the budget, each log written straight to a file (no pipelines):
#   0. sanity (bench/parallel_sanity.py, ~20 s): start-up, NCCL collectives, a captured all_reduce replayed, every
#      step message kind, close. If it fails, the model stages are skipped (they would hang or fail the same way).
#   1. equality: mini (real per-layer dims, 4 layers, 16 experts, fp32) on 1 GPU vs TP=2 vs TP=2 + EP, greedy tokens
#   2. throughput: mini with 8 layers and 32 experts (bf16, CUDA graphs): decode tok/s at batch 1 / 8 / 64 and
#      prefill tok/s on 1 GPU, TP=2 and TP=2 + EP, with the NCCL share of rank 0's GPU time
#   3. the GPU test of the runtime (tests/test_parallel_runtime.py -m gpu: engine, NCCL, CUDA graphs, close)
#   4. beyond one GPU: mini with 12 layers and 128 experts (about 160 GB in bf16), TP=2 only
#   5. with what is left: the spawn-based NCCL model test (tests/test_parallel_model.py -m gpu -k models), whose
#      ranks write their progress per scenario
# Diagnostics (m3export/parallel/diagnostics.py): every rank writes its Python stacks every M3EXPORT_STACKS_EVERY_S
# seconds and on SIGUSR1, its NCCL log (NCCL_DEBUG=INFO) and its progress lines under $W/diag. A stage that
# overruns gets SIGUSR1 on its whole process group (`timeout -s USR1`: every rank dumps its stacks), then SIGKILL
# 15 s later. After every stage all logs are packed into $OUT/gpu_multi_logs.tgz, so a cut-short call keeps them.
# $OUT receives 7 files (a call brings back at most 8): gpu_multi_summary.txt, gpu_multi_logs.tgz,
# gpu_multi_gpus.txt and the four JSONs parallel_sanity.json, parallel_equality.json, parallel_h200x2.json,
# parallel_beyond_one_gpu.json (each written after every check / run, so partial results survive).
# Runs from the working tree on the machine's preinstalled torch / Triton, laid out under /tmp/m3pkg as pyproject
# maps it (plugins/ -> m3export.plugins, runtime/ -> m3export.runtime). NVLink multicast stays off.
#   timeout 470 bash scripts/gpu_multi.sh
#   M3_MULTI_DEVICE=cpu M3_MULTI_BUDGET_S=200 bash scripts/gpu_multi.sh   # dry run of the script on CPU (gloo, smoke)
set -uo pipefail
cd "$(dirname "$0")/.."
R=$PWD
START=$(date +%s)
BUDGET=${M3_MULTI_BUDGET_S:-440}
DEV=${M3_MULTI_DEVICE:-cuda}
SMOKE=$([ "$DEV" = cpu ] && echo --smoke)
export OUT="${OUT:-$R/out}" PYTHONUNBUFFERED=1 TRITON_INTERPRET=0
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
W=/tmp/m3multi
rm -rf "$W" /tmp/m3pkg && mkdir -p "$OUT" "$W/diag" /tmp/m3pkg
export M3EXPORT_DIAG_DIR="$W/diag" M3EXPORT_STACKS_EVERY_S="${M3EXPORT_STACKS_EVERY_S:-45}" NCCL_DEBUG=INFO
export TORCH_CPP_LOG_LEVEL=INFO  # ProcessGroupNCCL's own lines: communicator init, destroy / abort
SUMMARY="$OUT/gpu_multi_summary.txt"
: >"$SUMMARY"
cp -r m3export /tmp/m3pkg/ && cp -r plugins /tmp/m3pkg/m3export/plugins && cp -r runtime /tmp/m3pkg/m3export/runtime
export PYTHONPATH="/tmp/m3pkg:$R"

note() { echo "[$(date +%H:%M:%S) +$(($(date +%s) - START))s] $*" | tee -a "$SUMMARY"; }
pack() { tar -czf "$OUT/gpu_multi_logs.tgz.part" -C "$W" . 2>/dev/null && mv "$OUT/gpu_multi_logs.tgz.part" "$OUT/gpu_multi_logs.tgz"; }

# stage NAME CAP_SECONDS COMMAND...: runs COMMAND with its output in $W/NAME.log, at most CAP seconds and never past
# the budget (15 s kept for the kill and the packing); its exit code in the summary (124: timed out).
stage() {
    local name=$1 cap=$2 left t rc t0
    shift 2
    left=$((BUDGET - ($(date +%s) - START) - 20))
    t=$((cap < left ? cap : left))
    if [ "$t" -lt 20 ]; then
        note "$name: skipped ($left s left of the budget)"
        return 99
    fi
    note "$name: starting, up to $t s"
    t0=$(date +%s)
    timeout -s USR1 -k 15 "$t" "$@" >"$W/$name.log" 2>&1
    rc=$?
    note "$name: exit $rc after $(($(date +%s) - t0)) s$([ $rc -eq 124 ] && echo ' (timed out: stacks of every rank in diag/stacks_*)')"
    grep -v "USDT\|loading weights" "$W/$name.log" | tail -n 15 | sed "s/^/    $name| /" >>"$SUMMARY"
    pack
    return $rc
}

{
    nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv
    nvidia-smi topo -m
    python3 -c "import torch; print('torch', torch.__version__, 'gpus', torch.cuda.device_count(),
                'nccl', torch.cuda.nccl.version() if torch.cuda.is_available() else None)"
} >"$OUT/gpu_multi_gpus.txt" 2>&1
note "$(tail -n 1 "$OUT/gpu_multi_gpus.txt")"

if stage sanity 60 python3 bench/parallel_sanity.py --device "$DEV" --json "$OUT/parallel_sanity.json"; then
    stage equality 140 python3 bench/parallel.py --device "$DEV" $SMOKE --skip throughput --json "$OUT/parallel_equality.json"
    stage throughput 150 python3 bench/parallel.py --device "$DEV" $SMOKE --skip equality --json "$OUT/parallel_h200x2.json"
    stage runtime_gpu_test 70 python3 -m pytest -q -x -p no:cacheprovider -m gpu -o faulthandler_timeout=55 \
        tests/test_parallel_runtime.py
    stage beyond_one_gpu 100 python3 bench/parallel.py --device "$DEV" $SMOKE --skip equality,throughput --big-layers 12 --big-experts 128 \
        --batches 1,8,64 --json "$OUT/parallel_beyond_one_gpu.json"
    stage spawn_model_test 150 python3 -m pytest -q -x -p no:cacheprovider -m gpu -o faulthandler_timeout=120 \
        tests/test_parallel_model.py -k models
else
    note "sanity failed: model stages skipped (see diag/ and sanity.log in gpu_multi_logs.tgz)"
fi
[ "$DEV" = cuda ] && cp "$OUT"/parallel_*.json "$R/bench/results/" 2>/dev/null  # not a dry run's CPU numbers
note "done"
pack
