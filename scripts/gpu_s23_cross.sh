#!/bin/bash
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1; unset TRITON_INTERPRET
mkdir -p $OUT
timeout 400 python3 bench/moe_prefill_ab.py --tokens 1024,2048,4096,6144,8192,12288 --variants prefill_ws_bm256_down128_s4c2_half,prefill_bm64_gu_group8_tma --rounds 5 --calls 5 --json $OUT/moe_prefill_ab_s23_crossover.json 2>&1 | grep -v "round .* done"
