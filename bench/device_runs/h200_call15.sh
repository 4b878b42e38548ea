#!/usr/bin/env bash
# Device call 15 (nvidia-h200), session 4: the kernel as committed after this session's changes (table-coded 4-bit
# first moment, bf16 weights/grads loaded as words, non-finite gradients counted in a second pass only when seen,
# the one hyper-parameter row as kernel arguments, 128 registers for 4-bit): every GPU-marked optimizer test, then
# the committed optimizer-step benchmark (all variants, one process). Results under $OUT.
export PYTHONPATH=$PWD:$PWD/.devsite/site PYTHONUNBUFFERED=1
timeout 280 python -m pytest -q -m gpu tests/test_optimizers.py -p no:cacheprovider > $OUT/gpu_tests.log 2>&1
tail -3 $OUT/gpu_tests.log
timeout 265 python bench/optimizer_step.py --steps 10 --out $OUT/optimizer_step_h200.json > $OUT/optimizer_step.log 2>&1
grep "^|" $OUT/optimizer_step.log
