#!/usr/bin/env bash
# Device call 18 (nvidia-h200), session 5: the Llama2-7B matrix (random init, batch 16 x 512) with this session's
# kernel, part 1: torch fused against ours and bitsandbytes, 20 steps each (tokens/s: median of steps 5-20, and the
# median of step-by-step ratios to fused), then optimizer-in-backward for fused / ours 8-bit / ours 4-bit.
# Part 2 (call 19) adds the torch foreach and torchao rows to the same JSON (--merge).
export PYTHONPATH=$PWD:$PWD/.devsite/site PYTHONUNBUFFERED=1
mkdir -p /tmp/data/alpaca /tmp/data/llama2_tokenizer
xz -dc .devsite/data/alpaca_data.json.xz > /tmp/data/alpaca/alpaca_data.json
cp .devsite/data/tokenizer.model /tmp/data/llama2_tokenizer/
COMMON=(--config configs/llama2/7B_full.yaml --runs-dir /tmp/bench_runs --merge --out $OUT/llama2_7b_h200.json --quiet
  --title "Llama2-7B (random init), batch 16 x 512 tokens, 1x H200" --steps 20 --skip-steps 4)
DATA=(data_dir=/tmp/data checkpoint_dir=null tokenizer.path=/tmp/data/llama2_tokenizer/tokenizer.model tokenizer.max_seq_len=512)
nvidia-smi --query-gpu=clocks.sm,temperature.gpu,power.draw --format=csv > $OUT/gpu_state.csv
timeout 390 python bench/compare.py "${COMMON[@]}" --variants fused,ours8,ours4,oursfp8,ours16,bnb8 --timeout 75 \
  "${DATA[@]}" > $OUT/matrix1.log 2>&1
grep "^|" $OUT/matrix1.log; tail -1 $OUT/matrix1.log
nvidia-smi --query-gpu=clocks.sm,temperature.gpu,power.draw --format=csv,noheader >> $OUT/gpu_state.csv
timeout 190 python bench/compare.py "${COMMON[@]}" --variants fused,ours8,ours4 --in-bwd-only --timeout 60 \
  "${DATA[@]}" > $OUT/matrix2.log 2>&1
grep "^|" $OUT/matrix2.log; tail -1 $OUT/matrix2.log
tar czf $OUT/metrics.tgz /tmp/bench_runs/*/metrics.jsonl 2>/dev/null
