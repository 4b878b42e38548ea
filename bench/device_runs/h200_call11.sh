#!/usr/bin/env bash
# Device call 11 (nvidia-h200), session 3: the 4-bit GPU tests (new tolerance), then torch fused against ours
# 8-bit / 4-bit at Llama2-7B in two passes of opposite order (A: fused, ours8, ours4; B: ours4, ours8, fused), 14
# steps each, to separate the optimizers from run-order drift (call 10's matrix slowed down as it went on).
export PYTHONPATH=$PWD:$PWD/.devsite/site PYTHONUNBUFFERED=1
timeout 90 python -m pytest -q -m gpu tests/test_optimizers.py -p no:cacheprovider -k "AdamW4bit" > $OUT/gpu_tests.log 2>&1
tail -1 $OUT/gpu_tests.log
mkdir -p /tmp/data/alpaca /tmp/data/llama2_tokenizer
xz -dc .devsite/data/alpaca_data.json.xz > /tmp/data/alpaca/alpaca_data.json
cp .devsite/data/tokenizer.model /tmp/data/llama2_tokenizer/
DATA=(data_dir=/tmp/data checkpoint_dir=null tokenizer.path=/tmp/data/llama2_tokenizer/tokenizer.model tokenizer.max_seq_len=512)
nvidia-smi --query-gpu=clocks.sm,temperature.gpu,power.draw --format=csv > $OUT/gpu_state.csv
for p in A:fused,ours8,ours4 B:ours4,ours8,fused; do
  timeout 215 python bench/compare.py --config configs/llama2/7B_full.yaml --runs-dir /tmp/ab${p%%:*} --out $OUT/ab_${p%%:*}.json \
    --quiet --title "Llama2-7B (random init), batch 16 x 512, 1x H200, pass ${p%%:*}" --variants ${p#*:} --steps 14 \
    --skip-steps 4 --timeout 70 "${DATA[@]}" > $OUT/ab_${p%%:*}.log 2>&1
  grep "^| [to]" $OUT/ab_${p%%:*}.log
  nvidia-smi --query-gpu=clocks.sm,temperature.gpu,power.draw --format=csv,noheader >> $OUT/gpu_state.csv
done
tar czf $OUT/ab_metrics.tgz /tmp/abA/*/metrics.jsonl /tmp/abB/*/metrics.jsonl 2>/dev/null
