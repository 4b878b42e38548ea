#!/usr/bin/env bash
# Device call 21 (nvidia-h200), session 6: the 4-bit first moment rounded stochastically ((2^E - 1)/127 levels, a
# Weyl dither, format 4bit.v4). Every GPU-marked optimizer test; a launch-shape sweep of the new 4-bit kernel
# (registers per thread x programs per SM, two rounds; scratch script, table in bench/results/optimizer_sweep_h200.log);
# then the committed optimizer-step benchmark (all variants, one process). Results under $OUT.
export PYTHONPATH=$PWD:$PWD/.devsite/site PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,temperature.gpu --format=csv,noheader
timeout 220 python -m pytest -q -m gpu tests/test_optimizers.py -p no:cacheprovider > $OUT/gpu_tests.log 2>&1
tail -3 $OUT/gpu_tests.log
timeout 150 python scratch/sweep4.py > $OUT/sweep4.log 2>&1; cat $OUT/sweep4.log | grep "^|"
timeout 200 python bench/optimizer_step.py --steps 10 --out $OUT/optimizer_step_h200.json > $OUT/optimizer_step.log 2>&1
grep "^|" $OUT/optimizer_step.log
