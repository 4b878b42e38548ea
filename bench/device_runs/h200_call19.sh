#!/usr/bin/env bash
# Device call 19 (nvidia-h200), session 5: the Llama2-7B matrix, part 2: torch foreach and the torchao rows, merged
# into call 18's JSON (carried in scratch/, the session's uncommitted folder); then torch fused and ours 8- / 4-bit
# once more in the opposite order of call 18 (ours4, ours8, fused), into a separate file, to see how much of
# call 18's gap to fused is run order and machine drift.
export PYTHONPATH=$PWD:$PWD/.devsite/site PYTHONUNBUFFERED=1
mkdir -p /tmp/data/alpaca /tmp/data/llama2_tokenizer
xz -dc .devsite/data/alpaca_data.json.xz > /tmp/data/alpaca/alpaca_data.json
cp .devsite/data/tokenizer.model /tmp/data/llama2_tokenizer/
cp scratch/llama2_7b_h200.json $OUT/llama2_7b_h200.json
COMMON=(--config configs/llama2/7B_full.yaml --quiet --steps 20 --skip-steps 4)
DATA=(data_dir=/tmp/data checkpoint_dir=null tokenizer.path=/tmp/data/llama2_tokenizer/tokenizer.model tokenizer.max_seq_len=512)
timeout 400 python bench/compare.py "${COMMON[@]}" --runs-dir /tmp/bench_runs --merge --out $OUT/llama2_7b_h200.json \
  --title "Llama2-7B (random init), batch 16 x 512 tokens, 1x H200" --variants foreach,ao8,ao4,aofp8 --timeout 100 \
  "${DATA[@]}" > $OUT/matrix3.log 2>&1
grep "^| [tb]" $OUT/matrix3.log; tail -1 $OUT/matrix3.log
timeout 170 python bench/compare.py "${COMMON[@]}" --runs-dir /tmp/reverse --out $OUT/reverse/compare.json \
  --title "Llama2-7B (random init), batch 16 x 512 tokens, 1x H200, reverse order" --variants ours4,ours8,fused \
  --timeout 55 "${DATA[@]}" > $OUT/reverse.log 2>&1
grep "^| [o]\|^| torch" $OUT/reverse.log; tail -1 $OUT/reverse.log
tar czf $OUT/metrics.tgz /tmp/bench_runs/*/metrics.jsonl /tmp/reverse/*/metrics.jsonl 2>/dev/null
