#!/usr/bin/env bash
# Device call 9 (nvidia-h200), session 3: GPU tests of the final optimizer code, a launch-shape sweep of the 4-bit
# format (now word-loaded, one-warp programs), then the committed optimizer-step benchmark. Results under $OUT.
export PYTHONPATH=$PWD:$PWD/.devsite/site PYTHONUNBUFFERED=1
timeout 200 python -m pytest -q -m gpu tests/test_optimizers.py -p no:cacheprovider > $OUT/gpu_tests.log 2>&1
tail -2 $OUT/gpu_tests.log
V=("optimizers.AdamW4bit" "optimizers.AdamW4bit(tile_blocks=4,num_warps=1,programs_per_sm=16)"
   "optimizers.AdamW4bit(tile_blocks=2,num_warps=1,programs_per_sm=12)" "optimizers.AdamW4bit(tile_blocks=4,num_warps=4,programs_per_sm=4)"
   "optimizers.AdamW4bit(tile_blocks=8,num_warps=4,programs_per_sm=8)" "optimizers.AdamW4bit(second_moment='dynamic')"
   "optimizers.AdamW8bit" "optimizers.AdamWFp8" "optimizers.AdamW")
timeout 150 python bench/optimizer_step.py --steps 10 --variants "${V[@]}" > $OUT/sweep.log 2>&1
grep "^|" $OUT/sweep.log
timeout 230 python bench/optimizer_step.py --steps 10 --out $OUT/optimizer_step_h200.json > $OUT/optimizer_step.log 2>&1
grep "^|" $OUT/optimizer_step.log
