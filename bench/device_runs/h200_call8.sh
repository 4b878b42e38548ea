#!/usr/bin/env bash
# Device call 8 (nvidia-h200), session 3: GPU tests of the float-coded 8-bit format and the contiguous-run kernel,
# then a launch-shape sweep of our variants (with torch fused as the yardstick). Results under $OUT.
export PYTHONPATH=$PWD:$PWD/.devsite/site PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.max.sm,memory.total --format=csv > $OUT/gpu.txt 2>&1
timeout 240 python -m pytest -q -m gpu tests/test_optimizers.py > $OUT/gpu_tests.log 2>&1
tail -3 $OUT/gpu_tests.log
V=("torch.optim.AdamW(fused=True)" "optimizers.AdamW" "optimizers.AdamW8bit" "optimizers.AdamWFp8" "optimizers.AdamW4bit"
   "optimizers.AdamW8bit(tile_blocks=2)" "optimizers.AdamW8bit(programs_per_sm=8)" "optimizers.AdamW8bit(programs_per_sm=24)"
   "optimizers.AdamW8bit(tile_blocks=4,num_warps=4,programs_per_sm=4)" "optimizers.AdamW8bit(tile_blocks=2,num_warps=2,programs_per_sm=8)"
   "optimizers.AdamWFp8(tile_blocks=2)" "optimizers.AdamWFp8(programs_per_sm=24)"
   "optimizers.AdamW4bit(tile_blocks=2,num_warps=1,programs_per_sm=16)" "optimizers.AdamW4bit(tile_blocks=4,num_warps=2,programs_per_sm=8)"
   "optimizers.AdamW(tile_blocks=1,programs_per_sm=16)")
timeout 320 python bench/optimizer_step.py --steps 10 --variants "${V[@]}" --out $OUT/sweep.json > $OUT/sweep.log 2>&1
grep "^|" $OUT/sweep.log
