#!/usr/bin/env bash
# Tensor / expert parallelism on the 2-GPU machine (nvidia-h200-x2), one call, under 8 minutes in all:
# bench/parallel.py in three stages, each with its own time limit and JSON (a stage cut short keeps the others):
#   1. equality: mini (real per-layer dims, 4 layers, 16 experts, fp32) on 1 GPU vs TP=2 vs TP=2 + EP, greedy tokens
#   2. throughput: mini with 8 layers and 32 experts (bf16, CUDA graphs): decode tok/s at batch 1 / 8 / 64 and
#      prefill tok/s on 1 GPU, TP=2 and TP=2 + EP, with the NCCL share of rank 0's GPU time
#   3. beyond one GPU: mini with 12 layers and 128 experts (about 160 GB in bf16), TP=2 only
# Runs from the working tree on the machine's preinstalled torch / Triton, laid out under /tmp/m3pkg as pyproject
# maps it (plugins/ -> m3export.plugins, runtime/ -> m3export.runtime), like scripts/gpu_moe.sh. NVLink multicast
# stays off (the runtime sets NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1, NVSHMEM_DISABLE_NVLS=1 in
# every rank; exported here too). Everything lands in $OUT (or ./out).
#   bash scripts/gpu_multi.sh
set -uo pipefail
cd "$(dirname "$0")/.."
R=$PWD
export OUT="${OUT:-$R/out}" PYTHONUNBUFFERED=1 TRITON_INTERPRET=0
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
mkdir -p "$OUT"
rm -rf /tmp/m3pkg && mkdir -p /tmp/m3pkg
cp -r m3export /tmp/m3pkg/ && cp -r plugins /tmp/m3pkg/m3export/plugins && cp -r runtime /tmp/m3pkg/m3export/runtime
export PYTHONPATH="/tmp/m3pkg:$R"
nvidia-smi --query-gpu=index,name,memory.total --format=csv | tee "$OUT/gpu_multi_gpus.txt"
timeout 130 python3 bench/parallel.py --skip throughput --json "$OUT/parallel_equality.json" 2>&1 \
    | grep -v "USDT\|loading weights" | tee "$OUT/parallel_equality.log"
timeout 230 python3 bench/parallel.py --skip equality --json "$OUT/parallel_h200x2.json" 2>&1 \
    | grep -v "USDT\|loading weights" | tee "$OUT/parallel_throughput.log"
timeout 100 python3 bench/parallel.py --skip equality,throughput --big-layers 12 --big-experts 128 \
    --batches 1,8,64 --json "$OUT/parallel_beyond_one_gpu.json" 2>&1 \
    | grep -v "USDT\|loading weights" | tee "$OUT/parallel_big.log"
cp "$OUT"/parallel_*.json "$R/bench/results/" 2>/dev/null || true
