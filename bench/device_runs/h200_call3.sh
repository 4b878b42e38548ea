#!/usr/bin/env bash
# Device call 3 (nvidia-h200): GPU tests of optimizers/; launch-shape sweep with one-warp programs (device-time
# column); the torchao / bitsandbytes rows of the Llama2-7B matrix (they do not depend on our kernel). Under $OUT.
export PYTHONPATH=$PWD:$PWD/.devsite/site PYTHONUNBUFFERED=1
timeout 150 python -m pytest -q -m gpu tests/test_optimizers.py -p no:cacheprovider > $OUT/gpu_tests.log 2>&1
tail -3 $OUT/gpu_tests.log
V=()
for c in "1,1,16" "2,1,12" "4,4,8"; do IFS=, read nb w p <<< "$c"; V+=("optimizers.AdamW8bit(tile_blocks=$nb,num_warps=$w,programs_per_sm=$p)"); done
for c in "1,1,16" "2,1,12" "8,4,8"; do IFS=, read nb w p <<< "$c"; V+=("optimizers.AdamW4bit(tile_blocks=$nb,num_warps=$w,programs_per_sm=$p)"); done
for c in "1,1,16" "2,1,12" "8,4,4"; do IFS=, read nb w p <<< "$c"; V+=("optimizers.AdamWFp8(tile_blocks=$nb,num_warps=$w,programs_per_sm=$p)"); done
for c in "2,1,16" "4,1,12" "8,4,4"; do IFS=, read nb w p <<< "$c"; V+=("optimizers.AdamW(tile_blocks=$nb,num_warps=$w,programs_per_sm=$p)"); done
V+=("torch.optim.AdamW(fused=True)")
timeout 150 python bench/optimizer_step.py --steps 6 --warmup 2 --variants "${V[@]}" > $OUT/sweep2.log 2>&1
grep "^|" $OUT/sweep2.log
mkdir -p /tmp/data/alpaca /tmp/data/llama2_tokenizer
xz -dc .devsite/data/alpaca_data.json.xz > /tmp/data/alpaca/alpaca_data.json
cp .devsite/data/tokenizer.model /tmp/data/llama2_tokenizer/
timeout 290 python bench/compare.py --config configs/llama2/7B_full.yaml --variants bnb8,ao8,ao4 \
  --steps 8 --skip-steps 3 --runs-dir /tmp/bench_runs --timeout 95 --out $OUT/llama2_7b_h200.json --quiet \
  --title "Llama2-7B (random init), batch 16 x 512 tokens, 1x H200" \
  data_dir=/tmp/data checkpoint_dir=null tokenizer.path=/tmp/data/llama2_tokenizer/tokenizer.model tokenizer.max_seq_len=512 \
  > $OUT/matrix1.log 2>&1
tail -8 $OUT/matrix1.log
