#!/usr/bin/env bash
# ONNX Runtime on the H200 (issue 16): `m3export verify --provider cuda` on a tiny fp32 and a mini bf16 artifact,
# generation through the onnxruntime backend on CUDA against the torch backend (gpu test), then bench/ort_gpu.py.
# onnxruntime-gpu is not on the machine: carry it in the .c1 .. .cN parts of `../shared/scripts/chunk-for-gpu`
# (the wheel itself, or an xz tar of its unpacked tree, as ../shared/docs/gpu-kernels.md describes); this script
# reassembles and unpacks it under /tmp/ortgpu, ahead of any CPU onnxruntime on sys.path, with the CUDA libraries
# of the machine's torch wheels on LD_LIBRARY_PATH. Everything lands in $OUT (or ./out). Not run yet.
#   bash scripts/gpu_ort.sh            # about 10 minutes at most (each step has its own timeout)
set -uo pipefail
cd "$(dirname "$0")/.."
R=$PWD
export OUT="${OUT:-$R/out}" PYTHONUNBUFFERED=1 TRITON_INTERPRET=0 OMP_NUM_THREADS=8
mkdir -p "$OUT"
if ! ls .c1/part.* >/dev/null 2>&1; then echo "no .c1/part.*: carry onnxruntime-gpu with chunk-for-gpu" >&2; exit 2; fi
rm -rf /tmp/ortgpu && mkdir -p /tmp/ortgpu
cat $(ls -d .c[0-9]* | sort -V | sed 's#$#/part.*#') > /tmp/ortgpu.blob
if python3 -c "import zipfile,sys; sys.exit(not zipfile.is_zipfile('/tmp/ortgpu.blob'))"; then
  python3 -m zipfile -e /tmp/ortgpu.blob /tmp/ortgpu
else
  tar -xJf /tmp/ortgpu.blob -C /tmp/ortgpu
fi
NV=$(python3 -c "import nvidia, os; print(':'.join(os.path.join(p, d, 'lib') for p in nvidia.__path__ for d in os.listdir(p) if os.path.isdir(os.path.join(p, d, 'lib'))))" 2>/dev/null)
export LD_LIBRARY_PATH="${NV}:${LD_LIBRARY_PATH:-}"
rm -rf /tmp/m3pkg && mkdir -p /tmp/m3pkg
cp -r m3export /tmp/m3pkg/ && cp -r plugins /tmp/m3pkg/m3export/plugins && cp -r runtime /tmp/m3pkg/m3export/runtime
export PYTHONPATH="/tmp/ortgpu:/tmp/m3pkg:$R"
python3 -c "import onnxruntime as o; print(o.__version__, o.get_available_providers())" | tee "$OUT/ort_providers.txt"
M="python3 -m m3export.cli"
timeout 120 $M export --preset tiny --dtype float32 --out /tmp/art-tiny --force 2>&1 | tail -1
timeout 120 $M verify /tmp/art-tiny --provider cuda --fast 2>&1 | tee "$OUT/verify_tiny_cuda.txt" | tail -4
timeout 200 $M export --preset mini --dtype bfloat16 --flavour ort-contrib --out /tmp/art-mini --force 2>&1 | tail -1
timeout 200 $M verify /tmp/art-mini --provider cuda --fast 2>&1 | tee "$OUT/verify_mini_cuda.txt" | tail -4
(cd / && timeout 120 python3 -m pytest -q --import-mode=importlib -m gpu -p no:cacheprovider \
    "$R/tests/test_runtime_onnxruntime.py" 2>&1 | tail -8 | tee "$OUT/gpu_ort_tests.txt")
timeout 150 python3 bench/ort_gpu.py --artifact /tmp/art-mini --json "$OUT/ort_gpu_h200.json" 2>&1 \
    | tee "$OUT/ort_gpu.log"
