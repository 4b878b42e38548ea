#!/usr/bin/env bash
# Device call 14 (nvidia-h200), session 4: the table-coded 4-bit first moment, bf16 weights/grads loaded as words,
# and the tile-level finite check (a select-free copy of the update for all-finite tiles): all GPU-marked optimizer
# tests, then a launch-shape sweep of the step at Llama2-7B shapes with torch fused as the yardstick. Results under $OUT.
export PYTHONPATH=$PWD:$PWD/.devsite/site PYTHONUNBUFFERED=1
timeout 240 python -m pytest -q -m gpu tests/test_optimizers.py -p no:cacheprovider > $OUT/gpu_tests.log 2>&1
tail -3 $OUT/gpu_tests.log
V=("torch.optim.AdamW(fused=True)" "optimizers.AdamW4bit" "optimizers.AdamW4bit(programs_per_sm=10)"
   "optimizers.AdamW4bit(programs_per_sm=8)" "optimizers.AdamW4bit(tile_blocks=2,programs_per_sm=12)"
   "optimizers.AdamW4bit(tile_blocks=2,programs_per_sm=20)" "optimizers.AdamW4bit(tile_blocks=8,programs_per_sm=6)"
   "optimizers.AdamW8bit" "optimizers.AdamW8bit(programs_per_sm=20)" "optimizers.AdamW8bit(tile_blocks=2,programs_per_sm=12)"
   "optimizers.AdamWFp8" "optimizers.AdamWFp8(programs_per_sm=20)" "optimizers.AdamW" "optimizers.AdamW(programs_per_sm=12)"
   "torch.optim.AdamW(fused=True)")
timeout 240 python bench/optimizer_step.py --steps 10 --variants "${V[@]}" > $OUT/sweep.log 2>&1
grep "^|" $OUT/sweep.log
