#!/usr/bin/env bash
# Device call 26 (nvidia-h200), session 6: torch fused vs ours 8-bit / 4-bit (4bit.v4) on the Llama2-7B matrix's
# setting, twice in opposite orders (fused, ours8, ours4, then ours4, ours8, fused), 20 steps each: the run-to-run
# spread of tokens/s is several %, larger than the ~0.7 % an optimizer step 17-20 ms shorter than fused's can give.
# Into bench/results/llama2_7b_h200_ab.json as passes session6_fwd and session6_rev.
export PYTHONPATH=$PWD:$PWD/.devsite/site PYTHONUNBUFFERED=1
mkdir -p /tmp/data/alpaca /tmp/data/llama2_tokenizer
xz -dc .devsite/data/alpaca_data.json.xz > /tmp/data/alpaca/alpaca_data.json
cp .devsite/data/tokenizer.model /tmp/data/llama2_tokenizer/
COMMON=(--config configs/llama2/7B_full.yaml --quiet --steps 20 --skip-steps 4)
DATA=(data_dir=/tmp/data checkpoint_dir=null tokenizer.path=/tmp/data/llama2_tokenizer/tokenizer.model tokenizer.max_seq_len=512)
timeout 200 python bench/compare.py "${COMMON[@]}" --runs-dir /tmp/fwd --out $OUT/fwd/compare.json \
  --title "Llama2-7B (random init), batch 16 x 512 tokens, 1x H200" --variants fused,ours8,ours4 --timeout 60 \
  "${DATA[@]}" > $OUT/fwd.log 2>&1
grep "^| [o]\|^| torch" $OUT/fwd.log; tail -1 $OUT/fwd.log
timeout 200 python bench/compare.py "${COMMON[@]}" --runs-dir /tmp/rev --out $OUT/rev/compare.json \
  --title "Llama2-7B (random init), batch 16 x 512 tokens, 1x H200, reverse order" --variants ours4,ours8,fused \
  --timeout 60 "${DATA[@]}" > $OUT/rev.log 2>&1
grep "^| [o]\|^| torch" $OUT/rev.log; tail -1 $OUT/rev.log
