#!/usr/bin/env bash
# Device call 1 (nvidia-h200): GPU tests of optimizers/, launch-shape sweep of the new kernel, and the first
# rows of the Llama2-7B matrix that do not depend on our kernel. Results under $OUT.
export PYTHONPATH=$PWD:$PWD/.devsite/site PYTHONUNBUFFERED=1 TRITON_DEFAULT_FP_FUSION=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $OUT/gpu.txt
python -c "import torch, triton; print(torch.__version__, triton.__version__)" >> $OUT/gpu.txt
timeout 170 python -m pytest -q -m gpu tests/test_optimizers.py -p no:cacheprovider > $OUT/gpu_tests.log 2>&1
tail -5 $OUT/gpu_tests.log
V=()
for c in "4,4,8" "4,4,4" "2,4,8" "2,4,12" "4,8,4" "2,2,16" "8,4,4"; do IFS=, read nb w p <<< "$c"; V+=("optimizers.AdamW8bit(tile_blocks=$nb,num_warps=$w,programs_per_sm=$p)"); done
for c in "8,4,4" "8,4,8" "4,4,8" "4,4,12" "8,8,4" "4,2,16"; do IFS=, read nb w p <<< "$c"; V+=("optimizers.AdamW4bit(tile_blocks=$nb,num_warps=$w,programs_per_sm=$p)"); done
for c in "8,4,4" "4,4,8" "2,4,12" "4,8,4"; do IFS=, read nb w p <<< "$c"; V+=("optimizers.AdamWFp8(tile_blocks=$nb,num_warps=$w,programs_per_sm=$p)"); done
for c in "4,4,8" "2,4,12" "4,8,4" "8,4,4"; do IFS=, read nb w p <<< "$c"; V+=("optimizers.AdamW(tile_blocks=$nb,num_warps=$w,programs_per_sm=$p)"); done
V+=("optimizers.AdamW4bit(second_moment='linear')" "torch.optim.AdamW(fused=True)")
timeout 170 python bench/optimizer_step.py --steps 8 --warmup 2 --variants "${V[@]}" > $OUT/sweep.log 2>&1
tail -32 $OUT/sweep.log
# Probe: the 24 GiB configuration (ours 4-bit in backward, 512-token samples), 5 steps, random init.
mkdir -p /tmp/data/alpaca /tmp/data/llama2_tokenizer
xz -dc .devsite/data/alpaca_data.json.xz > /tmp/data/alpaca/alpaca_data.json
cp .devsite/data/tokenizer.model /tmp/data/llama2_tokenizer/
timeout 200 python bench/compare.py --config configs/llama2/7B_full_24gb.yaml --variants ours4 --in-bwd-only --steps 5 \
  --skip-steps 2 --runs-dir /tmp/bench_runs --timeout 190 --out $OUT/probe_24gb.json \
  data_dir=/tmp/data checkpoint_dir=null tokenizer.path=/tmp/data/llama2_tokenizer/tokenizer.model > $OUT/probe.log 2>&1
tail -5 $OUT/probe.log
cp /tmp/bench_runs/*/run.log $OUT/probe_run.log 2>/dev/null
