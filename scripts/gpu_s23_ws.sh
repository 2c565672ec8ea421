#!/bin/bash
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1; unset TRITON_INTERPRET
mkdir -p $OUT
timeout 120 python3 bench/moe_prefill_ab.py --tokens 2560,3072 --variants prefill_bm64_gu_group8_tma --rounds 5 --calls 5 --json $OUT/moe_prefill_ab_s23_crossover2.json 2>&1 | grep -v "round .* done"
timeout 150 python3 -m pytest -q -x -m gpu tests/test_moe_prefill_ws.py 2>&1 | tail -3
timeout 120 python3 bench/long_prefill.py --device cuda --lengths 65536 --json $OUT/long_prefill_s23_ws64.json 2>&1 | tail -4
timeout 120 python3 -c "
import runpy, sys
from m3export.plugins.kernels import moe
moe.WS_LEAST_MEAN = 256
sys.argv = ['bench/long_prefill.py', '--device', 'cuda', '--lengths', '65536', '--json', '$OUT/long_prefill_s23_ws256.json']
runpy.run_path('bench/long_prefill.py', run_name='__main__')
" 2>&1 | tail -4
timeout 150 python3 -m pytest -q -x -m gpu tests/test_gpu_engine.py tests/test_moe_prefill_round6.py 2>&1 | tail -3
timeout 200 python3 -m pytest -q -x -m gpu tests/test_kernels_moe.py --durations=5 2>&1 | tail -9
