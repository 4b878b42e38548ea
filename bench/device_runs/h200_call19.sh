#!/usr/bin/env bash
# Device call 19 (nvidia-h200), session 5: the Llama2-7B matrix, part 2: torch foreach and the torchao rows, merged
# into call 18's JSON (carried in scratch/, the session's uncommitted folder).
export PYTHONPATH=$PWD:$PWD/.devsite/site PYTHONUNBUFFERED=1
mkdir -p /tmp/data/alpaca /tmp/data/llama2_tokenizer
xz -dc .devsite/data/alpaca_data.json.xz > /tmp/data/alpaca/alpaca_data.json
cp .devsite/data/tokenizer.model /tmp/data/llama2_tokenizer/
cp scratch/llama2_7b_h200.json $OUT/llama2_7b_h200.json
COMMON=(--config configs/llama2/7B_full.yaml --runs-dir /tmp/bench_runs --merge --out $OUT/llama2_7b_h200.json --quiet
  --title "Llama2-7B (random init), batch 16 x 512 tokens, 1x H200" --steps 20 --skip-steps 4)
DATA=(data_dir=/tmp/data checkpoint_dir=null tokenizer.path=/tmp/data/llama2_tokenizer/tokenizer.model tokenizer.max_seq_len=512)
timeout 560 python bench/compare.py "${COMMON[@]}" --variants foreach,ao8,ao4,aofp8 --timeout 130 \
  "${DATA[@]}" > $OUT/matrix3.log 2>&1
grep "^|" $OUT/matrix3.log; tail -1 $OUT/matrix3.log
tar czf $OUT/metrics.tgz /tmp/bench_runs/*/metrics.jsonl 2>/dev/null
