#!/usr/bin/env bash
# Device call 17 (nvidia-h200), session 5: the code as committed after this session's host-side changes (the bucket's
# first launch over a tenth of its elements before the rest of the grads are read, direct relaunch of the compiled
# kernel, seed not specialized, counter-hash stochastic rounding, 4-bit at 160 registers / 12 programs per SM): every
# GPU-marked optimizer test, then the committed optimizer-step benchmark (all variants, one process). Results under $OUT.
export PYTHONPATH=$PWD:$PWD/.devsite/site PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,temperature.gpu --format=csv,noheader
timeout 200 python -m pytest -q -m gpu tests/test_optimizers.py -p no:cacheprovider > $OUT/gpu_tests.log 2>&1
tail -3 $OUT/gpu_tests.log
timeout 300 python bench/optimizer_step.py --steps 10 --out $OUT/optimizer_step_h200.json > $OUT/optimizer_step.log 2>&1
grep "^|" $OUT/optimizer_step.log
