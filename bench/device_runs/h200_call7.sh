#!/usr/bin/env bash
# Device call 7 (nvidia-h200): configs/llama2/7B_full_24gb.yaml as committed (with stochastic rounding) against the
# fused-AdamW baseline at the same batch and length, in one call. Results under $OUT.
export PYTHONPATH=$PWD:$PWD/.devsite/site PYTHONUNBUFFERED=1
mkdir -p /tmp/data/alpaca /tmp/data/llama2_tokenizer
xz -dc .devsite/data/alpaca_data.json.xz > /tmp/data/alpaca/alpaca_data.json
cp .devsite/data/tokenizer.model /tmp/data/llama2_tokenizer/
DATA=(data_dir=/tmp/data checkpoint_dir=null tokenizer.path=/tmp/data/llama2_tokenizer/tokenizer.model tokenizer.max_seq_len=512)
timeout 75 python bench/compare.py --config configs/llama2/7B_full.yaml --variants fused --steps 8 --skip-steps 3 \
  --runs-dir /tmp/r --timeout 70 --out-dir /tmp/o --out $OUT/llama2_7b_24gb_h200.json --quiet "${DATA[@]}" > $OUT/a.log 2>&1
timeout 75 python bench/compare.py --config configs/llama2/7B_full_24gb.yaml --variants ours4 --steps 8 --skip-steps 3 \
  --runs-dir /tmp/r --timeout 70 --out-dir /tmp/o --merge --out $OUT/llama2_7b_24gb_h200.json --quiet \
  --title "configs/llama2/7B_full_24gb.yaml vs fused AdamW, batch 16 x 512 tokens, 1x H200" "${DATA[@]}" > $OUT/b.log 2>&1
grep "^|" $OUT/b.log
