#!/usr/bin/env bash
# Device call 4 (nvidia-h200): GPU spot check of the new launch defaults, then the Llama2-7B matrix rows of torch
# fused, ours, torchao FP8, ours 4-bit in backward (= configs/llama2/7B_full_24gb.yaml) and torchao's CPU offload.
export PYTHONPATH=$PWD:$PWD/.devsite/site PYTHONUNBUFFERED=1
timeout 60 python -m pytest -q -m gpu tests/test_optimizers.py -p no:cacheprovider -k "tracks_fp32_reference or triton_matches" > $OUT/gpu_tests.log 2>&1
tail -2 $OUT/gpu_tests.log
mkdir -p /tmp/data/alpaca /tmp/data/llama2_tokenizer
xz -dc .devsite/data/alpaca_data.json.xz > /tmp/data/alpaca/alpaca_data.json
cp .devsite/data/tokenizer.model /tmp/data/llama2_tokenizer/
cp .device_prev/llama2_7b_h200.json $OUT/llama2_7b_h200.json  # call 3's results, carried (carry=[".devsite", ".device_prev"])
COMMON=(--config configs/llama2/7B_full.yaml --runs-dir /tmp/bench_runs --merge --out $OUT/llama2_7b_h200.json --quiet
  --title "Llama2-7B (random init), batch 16 x 512 tokens, 1x H200")
DATA=(data_dir=/tmp/data checkpoint_dir=null tokenizer.path=/tmp/data/llama2_tokenizer/tokenizer.model tokenizer.max_seq_len=512)
timeout 330 python bench/compare.py "${COMMON[@]}" --variants fused,ours8,ours4,oursfp8,ours16,aofp8 --steps 8 --skip-steps 3 \
  --timeout 80 "${DATA[@]}" > $OUT/matrix2.log 2>&1
tail -3 $OUT/matrix2.log
timeout 75 python bench/compare.py "${COMMON[@]}" --variants ours4 --in-bwd-only --steps 8 --skip-steps 3 --timeout 70 \
  "${DATA[@]}" > $OUT/matrix3.log 2>&1
tail -3 $OUT/matrix3.log
timeout 130 python bench/compare.py "${COMMON[@]}" --variants torchao.optim.CPUOffloadOptimizer --steps 4 --skip-steps 1 \
  --timeout 125 "${DATA[@]}" optimizer.offload_gradients=True clip_grad_norm=null > $OUT/matrix4.log 2>&1
tail -14 $OUT/matrix4.log
