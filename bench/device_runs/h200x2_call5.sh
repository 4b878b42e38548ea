#!/usr/bin/env bash
# Device call on nvidia-h200-x2 (the last of the session):
#  1. the distributed recipe (FSDP2, NCCL) at the Llama2-7B architecture (random init), global batch 16 (8 per GPU)
#     x 512-token Alpaca samples: torch fused AdamW vs our 8-bit and 4-bit;
#  2. in parallel, one GPU each: the optimizer-step benchmark (all variants, one process) and a re-run of the
#     single-GPU rows fused / ours 8-bit / ours 4-bit (run-to-run spread of the matrix);
#  3. torchao's CPU offload through the single-device recipe.
export PYTHONPATH=$PWD:$PWD/.devsite/site PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1  # keep NVLink multicast off
mkdir -p /tmp/data/alpaca /tmp/data/llama2_tokenizer
xz -dc .devsite/data/alpaca_data.json.xz > /tmp/data/alpaca/alpaca_data.json
cp .devsite/data/tokenizer.model /tmp/data/llama2_tokenizer/
DATA=(data_dir=/tmp/data checkpoint_dir=null tokenizer.path=/tmp/data/llama2_tokenizer/tokenizer.model tokenizer.max_seq_len=512)
timeout 300 python bench/compare.py --nproc 2 --config configs/llama2/7B_full_distributed.yaml --variants fused,ours8,ours4 \
  --steps 8 --skip-steps 3 --runs-dir /tmp/dist_runs --timeout 95 --out-dir /tmp/o1 --out $OUT/llama2_7b_2xh200.json --quiet \
  --title "Llama2-7B (random init), FSDP2 on 2x H200, global batch 16 x 512 tokens" "${DATA[@]}" > $OUT/dist.log 2>&1
tail -6 $OUT/dist.log
CUDA_VISIBLE_DEVICES=0 timeout 200 python bench/optimizer_step.py --steps 10 --out $OUT/optimizer_step_h200.json > $OUT/opt_step.log 2>&1 &
CUDA_VISIBLE_DEVICES=1 timeout 200 python bench/compare.py --config configs/llama2/7B_full.yaml --variants fused,ours8,ours4 \
  --steps 8 --skip-steps 3 --runs-dir /tmp/bench_runs --timeout 65 --out-dir /tmp/o2 --out $OUT/llama2_7b_h200_rerun.json --quiet \
  --title "Llama2-7B (random init), batch 16 x 512 tokens, 1x H200 (re-run)" "${DATA[@]}" > $OUT/rerun.log 2>&1
wait
grep "^|" $OUT/opt_step.log | tail -12; tail -5 $OUT/rerun.log
CUDA_VISIBLE_DEVICES=0 timeout 120 python bench/compare.py --config configs/llama2/7B_full.yaml --variants torchao.optim.CPUOffloadOptimizer \
  --steps 4 --skip-steps 1 --runs-dir /tmp/bench_runs --timeout 115 --out-dir /tmp/o3 --out $OUT/offload.json --quiet \
  --title "Llama2-7B (random init), batch 16 x 512 tokens, 1x H200, CPU offload" "${DATA[@]}" optimizer.offload_gradients=True \
  clip_grad_norm=null > $OUT/offload.log 2>&1
tail -4 $OUT/offload.log
grep -B2 -A8 "Traceback" /tmp/bench_runs/torchao*/run.log | tail -20
