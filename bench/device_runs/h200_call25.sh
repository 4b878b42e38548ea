#!/usr/bin/env bash
# Device call 25 (nvidia-h200), session 6: the Llama2-7B matrix's rows that the new 4-bit first moment (4bit.v4)
# changes, re-run in one call: torch fused, ours 8-bit and ours 4-bit (fused is the tokens/s baseline, ours 8-bit
# the unchanged kernel as a control), then torch fused and ours 4-bit with optimizer-in-backward; merged into the
# committed file (carried in scratch/prev/, the session's uncommitted folder). Calls 22-24 were exploratory (scratch
# copies of optimizers/, tables in bench/results/optimizer_sweep_h200.log).
export PYTHONPATH=$PWD:$PWD/.devsite/site PYTHONUNBUFFERED=1
mkdir -p /tmp/data/alpaca /tmp/data/llama2_tokenizer
xz -dc .devsite/data/alpaca_data.json.xz > /tmp/data/alpaca/alpaca_data.json
cp .devsite/data/tokenizer.model /tmp/data/llama2_tokenizer/
cp scratch/prev/llama2_7b_h200.json $OUT/llama2_7b_h200.json
COMMON=(--config configs/llama2/7B_full.yaml --runs-dir /tmp/bench_runs --merge --out $OUT/llama2_7b_h200.json --quiet
  --title "Llama2-7B (random init), batch 16 x 512 tokens, 1x H200" --steps 20 --skip-steps 4)
DATA=(data_dir=/tmp/data checkpoint_dir=null tokenizer.path=/tmp/data/llama2_tokenizer/tokenizer.model tokenizer.max_seq_len=512)
nvidia-smi --query-gpu=clocks.sm,temperature.gpu,power.draw --format=csv > $OUT/gpu_state.csv
timeout 250 python bench/compare.py "${COMMON[@]}" --variants fused,ours8,ours4 --timeout 75 "${DATA[@]}" \
  > $OUT/matrix1.log 2>&1
grep "^|" $OUT/matrix1.log; tail -1 $OUT/matrix1.log
timeout 170 python bench/compare.py "${COMMON[@]}" --variants fused,ours4 --in-bwd-only --timeout 70 \
  "${DATA[@]}" > $OUT/matrix2.log 2>&1
grep "^|" $OUT/matrix2.log; tail -1 $OUT/matrix2.log
nvidia-smi --query-gpu=clocks.sm,temperature.gpu,power.draw --format=csv,noheader >> $OUT/gpu_state.csv
tar czf $OUT/metrics.tgz /tmp/bench_runs/*/metrics.jsonl 2>/dev/null
