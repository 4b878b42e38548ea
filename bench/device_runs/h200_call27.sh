#!/usr/bin/env bash
# Device call 27 (nvidia-h200), session 6: three more passes of torch fused vs ours 8-bit / 4-bit (4bit.v4) on the
# Llama2-7B matrix's setting, each order rotated (fused, ours8, ours4; ours8, ours4, fused; ours4, fused, ours8),
# 20 steps each, to average over the processes' spread (several %) that one run's ratio cannot. Into
# bench/results/llama2_7b_h200_ab.json as passes session6_rot1..3.
export PYTHONPATH=$PWD:$PWD/.devsite/site PYTHONUNBUFFERED=1
mkdir -p /tmp/data/alpaca /tmp/data/llama2_tokenizer
xz -dc .devsite/data/alpaca_data.json.xz > /tmp/data/alpaca/alpaca_data.json
cp .devsite/data/tokenizer.model /tmp/data/llama2_tokenizer/
COMMON=(--config configs/llama2/7B_full.yaml --quiet --steps 20 --skip-steps 4)
DATA=(data_dir=/tmp/data checkpoint_dir=null tokenizer.path=/tmp/data/llama2_tokenizer/tokenizer.model tokenizer.max_seq_len=512)
k=0
for order in fused,ours8,ours4 ours8,ours4,fused ours4,fused,ours8; do
  k=$((k + 1))
  timeout 170 python bench/compare.py "${COMMON[@]}" --runs-dir /tmp/rot$k --out $OUT/rot$k/compare.json \
    --title "Llama2-7B (random init), batch 16 x 512 tokens, 1x H200, order $order" --variants $order --timeout 60 \
    "${DATA[@]}" > $OUT/rot$k.log 2>&1
  rm -f $OUT/rot$k/*.png
  grep "^| [o]\|^| torch" $OUT/rot$k.log; tail -1 $OUT/rot$k.log
done
