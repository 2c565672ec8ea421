#!/bin/bash
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1; unset TRITON_INTERPRET
mkdir -p $OUT
timeout 200 python3 -m pytest -q -x -m gpu tests/test_moe_prefill_ws.py -k "quarter" -s 2>&1 | grep -v "^$" | tail -12
nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu,clocks_throttle_reasons.active --format=csv,noheader -lms 100 > $OUT/moe_prefill_ab_s23_quarter_smi.csv &
SMI=$!
timeout 150 python3 bench/moe_prefill_ab.py --variants prefill_ws_bm256_down128_s4c2_quarter --rounds 10 --calls 10 --json $OUT/moe_prefill_ab_s23_quarter.json 2>&1 | tail -5
timeout 100 python3 bench/moe_prefill_ab.py --tokens 8192 --variants prefill_ws_bm256_down128_s4c2_half,prefill_ws_bm256_down128_s4c2_quarter --rounds 10 --calls 10 --json $OUT/moe_prefill_ab_s23_quarter_8k.json 2>&1 | tail -5
kill $SMI
