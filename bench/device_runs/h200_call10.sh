#!/usr/bin/env bash
# Device call 10 (nvidia-h200), session 3: a short launch-shape check of 8-bit / FP8 with two blocks per tile (fewer
# instructions per element, fewer resident programs), then the whole Llama2-7B matrix in one call with this session's
# formats (the kernel then walked one contiguous run of tiles per program; call 13 changed the walk order): every
# variant, then optimizer-in-backward for fused / ours 8-bit / ours 4-bit. Results under $OUT.
export PYTHONPATH=$PWD:$PWD/.devsite/site PYTHONUNBUFFERED=1
V=("optimizers.AdamW8bit" "optimizers.AdamW8bit(tile_blocks=2,programs_per_sm=12)" "optimizers.AdamW8bit(programs_per_sm=20)"
   "optimizers.AdamWFp8" "optimizers.AdamWFp8(tile_blocks=2,programs_per_sm=12)" "optimizers.AdamWFp8(programs_per_sm=20)"
   "optimizers.AdamW4bit" "optimizers.AdamW(tile_blocks=1)")
timeout 100 python bench/optimizer_step.py --steps 10 --variants "${V[@]}" > $OUT/sweep.log 2>&1
grep "^|" $OUT/sweep.log
mkdir -p /tmp/data/alpaca /tmp/data/llama2_tokenizer
xz -dc .devsite/data/alpaca_data.json.xz > /tmp/data/alpaca/alpaca_data.json
cp .devsite/data/tokenizer.model /tmp/data/llama2_tokenizer/
COMMON=(--config configs/llama2/7B_full.yaml --runs-dir /tmp/bench_runs --merge --out $OUT/llama2_7b_h200.json --quiet
  --title "Llama2-7B (random init), batch 16 x 512 tokens, 1x H200")
DATA=(data_dir=/tmp/data checkpoint_dir=null tokenizer.path=/tmp/data/llama2_tokenizer/tokenizer.model tokenizer.max_seq_len=512)
timeout 400 python bench/compare.py "${COMMON[@]}" --variants fused,foreach,bnb8,ao8,ao4,aofp8,ours8,ours4,oursfp8,ours16 \
  --steps 8 --skip-steps 3 --timeout 75 "${DATA[@]}" > $OUT/matrix1.log 2>&1
tail -2 $OUT/matrix1.log
timeout 90 python bench/compare.py "${COMMON[@]}" --variants fused,ours8,ours4 --in-bwd-only --steps 8 --skip-steps 3 \
  --timeout 45 "${DATA[@]}" > $OUT/matrix2.log 2>&1
grep "^|" $OUT/matrix2.log
